"""``onnx_qat.sensitivity``: which quantized site costs how much output accuracy.

For every site (`onnx_qat.accuracy.sites`) the model's output error against the float model
is measured in two settings on the evaluation data: only this site in INT8, and every site but
this one in INT8. Per quantized tensor the result also gives its amax, the share of values the
range clips, and the tensor's own quantization SQNR. Ranges are calibrated once; every setting is
one run of the gated model (`onnx_qat.accuracy.gated`), from the latest cut it can start at
(`onnx_qat.accuracy.cuts`); the float outputs are computed once.

The idea follows the layer-wise tools TensorRT users know (Polygraphy's layer-wise comparison and
precision debugging; onnxruntime's ``qdq_loss_debug``): measure one layer's effect with the others
held fixed.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

from ..errors import ConfigError
from .prepared import METRICS, OutputError, prepare, weight_statistics
from .sites import Site
from ..runtime.ray_workers import shared_cluster

logger = logging.getLogger(__name__)

REPORT_FORMAT = "onnx-qat-sensitivity"
REPORT_VERSION = 1


@dataclass(frozen=True)
class TensorStats:
    """One quantized tensor of a site: ``kind`` is ``activation`` or ``weight``; ``amax`` the range
    used (a weight's largest channel amax); ``clipped`` the share of evaluation values beyond the
    range; ``sqnr_db`` the tensor's own INT8 quantization SQNR (10 log10 Σx² / Σ(x - q(x))²)."""

    tensor: str
    kind: str
    amax: float
    clipped: float
    sqnr_db: float

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"tensor": self.tensor, "kind": self.kind, "amax": self.amax, "clipped": self.clipped,
                "sqnr_db": self.sqnr_db}


@dataclass(frozen=True)
class SiteSensitivity:
    """The figures of one site.

    Attributes:
        site: the `Site`.
        only: output error with only this site in INT8 (everything else float).
        all_but: output error with every site but this one in INT8.
        tensors: `TensorStats` of the tensors this site quantizes.
        rank: 1 for the most sensitive site.
        only_group: 1 when ``only`` was measured for this site alone; else the size of the group of
            sites measured together, whose effect was too small to split (`onnx_qat.accuracy.bisect`):
            ``only`` is then the group's error (this site alone loses about that much or less).
        all_but_group: the same for ``all_but`` (this site alone in float gains about that much or less).
    """

    site: Site
    only: OutputError
    all_but: OutputError
    tensors: Tuple[TensorStats, ...]
    rank: int = 0
    only_group: int = 1
    all_but_group: int = 1

    @property
    def name(self) -> str:
        return self.site.name

    def to_dict(self) -> dict:
        """JSON-ready form: the site, its two errors, group sizes and tensor statistics."""
        return {"rank": self.rank, **self.site.to_dict(), "only": self.only.to_dict(),
                "all_but": self.all_but.to_dict(), "only_group": self.only_group,
                "all_but_group": self.all_but_group, "tensors": [t.to_dict() for t in self.tensors]}


def _loss(error: OutputError, metric: str) -> float:
    """Larger is worse, for every metric."""
    if metric == "cosine":
        return 1.0 - error.cosine
    if metric == "sqnr":
        return -error.sqnr_db
    return error.max_abs


@dataclass(frozen=True)
class SensitivityResult:
    """Every site's sensitivity, most sensitive first: sites measured alone before sites known only
    through their group, each ranked by the ``only`` error in ``metric``, ties by how much leaving the
    site float recovers.

    Attributes:
        sites: `SiteSensitivity` records, ranked.
        metric: ``cosine``, ``sqnr`` or ``max_abs``.
        all_int8: output error with every site in INT8 (what ``quantize`` gives).
        method: calibration method (``given`` for a given ScaleTable).
        num_eval_samples: evaluation samples the errors are measured on.
        runs: settings run in the gated session.
        seconds: wall time of the analysis.
        precision: the format the sites are quantized in (``int8``, ``fp8``, ``int4``); ``all_int8``
            and ``only`` are then errors in that format.
        eval_source: what the errors were measured on (``"calibration data d.npz (last 4 samples,
            held out)"``).
        ranges: how the ranges were chosen, for ``auto`` which table it kept (the line ``quantize``
            prints, e.g. ``"ranges: auto kept max everywhere | output cosine on the calibration
            data: ..."``); empty for given scales.
    """

    sites: Tuple[SiteSensitivity, ...]
    metric: str
    all_int8: OutputError
    method: str
    num_eval_samples: int
    runs: int = 0
    seconds: float = field(default=0.0, compare=False)
    precision: str = "int8"  # the format the sites are quantized in (all_int8: every site in it)
    eval_source: str = field(default="", compare=False)
    ranges: str = field(default="", compare=False)

    def __len__(self) -> int:
        return len(self.sites)

    def __iter__(self):
        return iter(self.sites)

    def top(self, n: int) -> Tuple[SiteSensitivity, ...]:
        """The ``n`` most sensitive sites."""
        return self.sites[:n]

    def to_dict(self) -> dict:
        """JSON-ready form: format, metric, method, sample and run counts, the all-INT8 error and
        every site's figures, ranked (what [`save`][onnx_qat.accuracy.sensitivity.SensitivityResult.save]
        writes)."""
        return {"format": REPORT_FORMAT, "version": REPORT_VERSION, "metric": self.metric,
                "method": self.method, "num_eval_samples": self.num_eval_samples,
                **({"eval_data": self.eval_source} if self.eval_source else {}), "runs": self.runs,
                "seconds": round(self.seconds, 3), "all_int8": self.all_int8.to_dict(),
                **({} if self.precision == "int8" else {"precision": self.precision}),
                "sites": [s.to_dict() for s in self.sites]}

    def save(self, path) -> None:
        """Write [`to_dict`][onnx_qat.accuracy.sensitivity.SensitivityResult.to_dict] as JSON (atomically;
        inf/NaN as strings)."""
        from ..io.files import write_json

        write_json(path, self.to_dict())

    def header(self) -> str:
        """The lines above the table: the all-sites error, where the ranges came from and what the
        errors were measured on, and (for ranges other than ``auto``'s) why ``compare`` of the model
        ``quantize`` writes by default gives another figure."""
        fmt = self.precision.upper()
        ranges = "ranges from the given ScaleTable" if self.method == "given" else \
            f"ranges calibrated with {self.method}"
        if self.method == "auto" and self.ranges:
            ranges = self.ranges
        samples = f"{self.num_eval_samples} sample{'' if self.num_eval_samples == 1 else 's'}"
        where = f"evaluated on {self.eval_source}" if self.eval_source else f"evaluated on {samples}"
        lines = [f"all sites {fmt}: {self.all_int8} | {ranges} | {where} | {self.runs} runs, "
                 f"{self.seconds:.1f} s"]
        if self.method not in ("auto", "given"):
            lines.append("note: quantize's default method is auto and compare measures all the data it "
                         "is given, so compare's cosine for that model differs; --method auto ranks "
                         "auto's ranges")
        return "\n".join(lines)

    def table(self, top: Optional[int] = None) -> str:
        """A plain-text table of the ``top`` most sensitive sites (all when None): the sites measured
        alone first, then, under a line that explains the ``>``/``<`` marks, the sites known only
        through the group they were measured in."""
        rows = self.sites if top is None else self.sites[:top]
        width = min(max([4] + [len(s.name) for s in rows]), 40)
        head = (f"{'rank':>4}  {'site':<{width}}  {'op':<10} {'kind':<9} {'only: cos':>10} {'SQNR':>7} "
                f"{'all-but: cos':>12} {'worst tensor':>13}")
        lines = [self.header(), head, "-" * len(head)]
        explained = False
        for s in rows:
            if not explained and (s.only_group > 1 or s.all_but_group > 1):
                from .bisect import SCREEN_FLOOR, SCREEN_SHARE

                lines.append(GROUP_NOTE.format(fmt=self.precision.upper(), share=SCREEN_SHARE,
                                               floor=SCREEN_FLOOR))
                explained = True
            worst = min((t.sqnr_db for t in s.tensors), default=math.inf)
            group = "" if s.only_group == 1 else ">"  # a group's figure: the site alone costs less
            only, sqnr = f"{group}{s.only.cosine:.5f}", group + _fmt_db(s.only.sqnr_db)
            all_but = ("" if s.all_but_group == 1 else "<") + f"{s.all_but.cosine:.5f}"
            lines.append(f"{s.rank:>4}  {_tail(s.name, width):<{width}}  {s.site.op_type[:10]:<10} "
                         f"{s.site.kind:<9} {only:>10} {sqnr:>7} "
                         f"{all_but:>12} {_fmt_db(worst) + ' dB':>13}")
        if top is not None and len(self.sites) > top:
            more = len(self.sites) - top
            lines.append(f"... {more} more site{'' if more == 1 else 's'} (--top shows more; the JSON "
                         f"report holds every site)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table(top=20)

    def plot(self, path, top: int = 20) -> None:
        """A ranked bar chart (PNG) of the ``top`` most sensitive sites: the output loss with only
        the site in INT8, and what leaving only it in float recovers."""
        from .chart import sensitivity_chart

        sensitivity_chart(self, path, top=top)


#: The line above the first site known only through its group (the table's ``>``/``<`` marks).
GROUP_NOTE = ("---- measured in groups from here on (a joint effect too small to split: under "
              "{share:.0%} of the all-{fmt} cosine loss or {floor:g}): '>c' / '<c' are the group's "
              "figures; the site alone costs about that much or less")


def _tail(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters: its end, where exporters' long hierarchical names
    (``model/block_3/conv/Conv``) differ, after an ellipsis."""
    return name if len(name) <= width else "\u2026" + name[len(name) - width + 1:]


def _fmt_db(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.1f}"


@shared_cluster()
def sensitivity(model, data, *, scales=None, method: str = "max", eval_data=None, metric: str = "cosine",
                config=None, batch_size: int = 16, progress: bool = True, exhaustive: bool = False,
                calibration_options=None, state=None, batch_axis=None, workers: Optional[int] = None,
                ray=None, **placement_options) -> SensitivityResult:
    """Measure how much each quantized site costs in output accuracy.

    Args:
        model: a float ONNX model (path or ``ModelProto``, never modified).
        data: calibration data (anything [`onnx_qat.load_data`][onnx_qat.io.data.load_data] accepts). Without
            ``eval_data`` its last quarter is held out for evaluation and not calibrated on.
        scales: a ScaleTable (or its path, or ``{tensor: amax}``) to use instead of calibrating;
            the errors are then measured on ``eval_data`` (or on all of ``data``).
        method: calibration method (see [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate]).
        eval_data: data the output errors are measured on.
        metric: what ranks the sites: ``cosine``, ``sqnr`` or ``max_abs`` (all three are reported).
        config: a [`QuantizeConfig`][onnx_qat.config.QuantizeConfig]; ``placement_options`` (its field names)
            override its fields. Sites are what this placement quantizes.
        batch_size: samples per onnxruntime run.
        progress: show progress bars on stderr.
        exhaustive: measure every site alone in both settings (``2 n + 1`` runs). By default, for
            more than 16 sites, group bisection (`onnx_qat.accuracy.bisect`) measures alone only
            the sites whose group moves the output cosine by at least 1% of the all-INT8 loss; the
            others get their group's figures as bounds (``SiteSensitivity.only_group`` > 1).
        calibration_options: further keywords of [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate]
            (``percentile``, ``num_bins``).
        state: ``{output: input}`` of a stateful model: every run goes through the data in order,
            each run's ``output`` fed to the next as ``input`` (the first feed gives the initial
            state; a held-out quarter starts from it again).
        batch_axis: ``{input: axis}`` for inputs whose batch axis is not the first.
        workers: worker processes the settings run on, each with its own sessions and
            ``cores // workers`` onnxruntime threads (`onnx_qat.accuracy.parallel`); the figures are
            identical for any count. ``1``: in this process. None (the default): one per usable core
            within memory, and this process alone when the runs are estimated to be too short to gain
            from workers (docs/performance.md, "Work spread over cores and machines").
        ray: run the settings (and the calibration's batches) as Ray actors instead of local
            processes: True for the cluster ``ray.init()`` finds (``RAY_ADDRESS``) or starts locally,
            or a cluster address (``"auto"``, ``"ray://HOST:10001"``); ``workers`` actors (None: one
            per CPU of the cluster). Needs the ``ray`` extra (`onnx_qat.runtime.ray_workers`).

    Returns:
        A [`SensitivityResult`][onnx_qat.accuracy.sensitivity.SensitivityResult], most sensitive site first.
    """
    from ..config import QuantizeConfig

    if metric not in METRICS:
        raise ConfigError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    from ..runtime.workers import worker_spec

    workers = worker_spec(workers, ray)  # a bad count, or Ray missing: one line before any work
    from ..io.layout import with_layout

    config = QuantizeConfig.from_options(config, **placement_options)
    data = with_layout(data, state=state, batch_axis=batch_axis)
    eval_data = with_layout(eval_data, state=state, batch_axis=batch_axis)
    start = time.perf_counter()
    prepared, act_stats = prepare(model, data, scales=scales, method=method, eval_data=eval_data,
                                  config=config, batch_size=batch_size, progress=progress,
                                  calibration_options=calibration_options, activation_stats=None,
                                  workers=workers)
    with prepared:
        only, all_but, all_int8 = _measure(prepared, exhaustive, progress)
    sites = prepared.sites
    weights = _weight_stats(prepared)

    def key(k):  # sites measured alone first (bisection measures alone the ones that matter)
        return (only[k][1] > 1, -_loss(only[k][0], metric), _loss(all_but[k][0], metric), sites[k].name)

    result_sites = tuple(
        SiteSensitivity(sites[k], only[k][0], all_but[k][0], _site_tensors(sites[k], act_stats, weights),
                        rank, only[k][1], all_but[k][1])
        for rank, k in enumerate(sorted(range(len(sites)), key=key), 1))
    return SensitivityResult(result_sites, metric, all_int8, prepared.method, prepared.evaluation.num_samples,
                             prepared.runs, time.perf_counter() - start, config.precision,
                             getattr(prepared.evaluation, "source", ""), _ranges(prepared))


def _measure(prepared, exhaustive: bool, progress: bool):
    """``(only, all_but, all_int8)``: every site's two errors (`onnx_qat.accuracy.bisect`) and the
    all-sites error."""
    from . import bisect

    sites = prepared.sites
    exhaustive = exhaustive or len(sites) <= bisect.MIN_SITES
    bar = _bar(2 * len(sites) + 1 if exhaustive else None, progress, "sensitivity")
    try:
        all_int8 = prepared.error(range(len(sites)))
        bar.update(1)
        if exhaustive:
            only = bisect.exhaustive(prepared, "only", lambda: bar.update(1))
            all_but = bisect.exhaustive(prepared, "all_but", lambda: bar.update(1))
        else:
            only = bisect.screen(prepared, all_int8, "only", on_run=lambda: bar.update(1))
            all_but = bisect.screen(prepared, all_int8, "all_but", on_run=lambda: bar.update(1))
    finally:
        bar.close()
    return only, all_but, all_int8


def _ranges(prepared) -> str:
    """How the ranges were chosen, from the calibrated table's metadata (empty for given scales)."""
    from ..scales import describe_method

    if prepared.method == "given":
        return ""
    return describe_method(getattr(prepared.table, "metadata", None) or {})


def _weight_stats(prepared) -> dict:
    from ..io.models import tensor_array

    inits = {t.name: t for t in prepared.float_model.graph.initializer}
    for node in prepared.float_model.graph.node:  # weights some exporters keep in Constant nodes
        value = [a for a in node.attribute if a.name == "value"] if node.op_type == "Constant" else []
        if value and node.output:
            inits.setdefault(node.output[0], value[0].t)
    stats = {}
    for mark in prepared.placement.weights:
        if mark.tensor in inits and mark.tensor not in stats:
            stats[mark.tensor] = weight_statistics(tensor_array(inits[mark.tensor]), mark.axis)
    return stats


def _site_tensors(site: Site, act_stats: dict, weights: dict) -> Tuple[TensorStats, ...]:
    out = [TensorStats(t, "activation", **act_stats[t]) for t in site.activations if t in act_stats]
    out += [TensorStats(t, "weight", **weights[t]) for t in site.weights if t in weights]
    return tuple(out)


def _bar(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not enabled)


__all__ = ["sensitivity", "SensitivityResult", "SiteSensitivity", "TensorStats", "REPORT_FORMAT"]
