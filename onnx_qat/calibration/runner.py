"""calibrate(): run the float model in onnxruntime and reduce activations into ranges.

Only the tensors placement will quantize are observed: they are added as extra
outputs of a copy of the model, the data is fed in batches, and each batch is
reduced at once into per-tensor running statistics (a max or a fixed-size
histogram), so memory does not grow with the number of samples.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx

from ..errors import ConfigError, DataError, ModelError, PlacementError, QatError, brief
from ..formats.scale_grid import fp16_grid_values
from ..io.models import cyclic_gc_paused
from ..runtime.ray_workers import shared_cluster
from ..scales import CALIBRATION_TARGET_KEY, ScaleTable
from .branches import make_runner
from .choice import CHECK_SAMPLES, judge_samples
from .auto import AutoCollector
from .collector import RangeCollector
from .entropy import EntropyCollector
from .max_collector import MaxCollector
from .mse import MseCollector
from .percentile import PercentileCollector

logger = logging.getLogger(__name__)

#: Calibration methods and how to build one collector for each.
METHODS: Mapping[str, Callable[..., RangeCollector]] = {
    "max": lambda percentile, num_bins: MaxCollector(),
    "percentile": lambda percentile, num_bins: PercentileCollector(percentile, num_bins),
    "entropy": lambda percentile, num_bins: EntropyCollector(num_bins),
    "mse": lambda percentile, num_bins: MseCollector(num_bins),
    "auto": lambda percentile, num_bins: AutoCollector(num_bins),
}

#: The method [`calibrate`][onnx_qat.calibration.runner.calibrate] and
#: [`onnx_qat.quantize`][onnx_qat.quantize.quantize] use when none is given: ``auto`` matched or beat
#: ``max`` on every real model measured (docs/sensitivity.md, "Calibration methods on real models").
DEFAULT_METHOD = "auto"

#: The ``qmax`` of `collect`'s FP16 grid: INT8's, whatever the precision (one ScaleTable serves every
#: precision, and the mixed-format search quantizes INT8 and FP8 sites from one table).
SCALE_QMAX = 127.0
#: amax given to a tensor that was zero on every sample (a ScaleTable refuses 0).
ZERO_TENSOR_AMAX = 1e-6
#: Magnitudes at or above this are treated like infinities: masking constants such as -1e9 or
#: -3.4e38 (an int8 range that wide would leave every real value at zero anyway).
MASK_MAGNITUDE = 1e8


class TensorObserver:
    """One tensor's collector behind the non-finite guard.

    NaN, ±Inf and masking magnitudes (>= `MASK_MAGNITUDE`) are counted and left
    out of the statistics; `result` warns about them, raises DataError when
    nothing finite was seen, and gives an all-zero tensor `ZERO_TENSOR_AMAX`.
    Whatever the method, the smallest and largest value kept are tracked too (`bounds`).

    In front of a histogram collector (``auto``, ``percentile``, ``entropy``, ``mse``) small float
    batches are held and reduced together once they hold as many values as the histogram has bins
    (`flush`): one pass of the guard, the bounds and the binning instead of one per batch (the
    histogram's counts do not depend on how its values are grouped, nor do the minimum, maximum and
    counts of the guard: the same numbers). `result`, `bounds`, `merge` and `ignored` flush first.
    """

    __slots__ = ("name", "collector", "seen", "_ignored", "low", "high", "_limit", "_held", "_held_size")

    def __init__(self, name: str, collector: RangeCollector):
        self.name = name
        self.collector = collector
        self.seen = 0
        self._ignored = 0
        self.low = np.inf
        self.high = -np.inf
        hist = getattr(collector, "hist", None)
        self._limit = int(hist.num_bins) if hist is not None else 0  # 0: every batch reduced at once
        self._held: list = []
        self._held_size = 0

    @property
    def ignored(self) -> int:
        """Values left out so far (NaN, Inf, masking magnitudes)."""
        self.flush()
        return self._ignored

    def update(self, values: np.ndarray) -> None:
        """Reduce one batch of the tensor into the running statistics (or hold it, see the class).

        The usual batch costs two reading passes (its min and max); only a batch holding
        NaN, Inf or masking magnitudes is filtered value by value.
        """
        values = np.asarray(values)
        if values.dtype.kind not in "fiub":
            raise DataError(f"tensor {self.name!r} has dtype {values.dtype}; only numeric tensors can be "
                            f"calibrated")
        if values.dtype.kind != "f":
            values = values.astype(np.float32)
        if values.size == 0:
            return
        self.seen += values.size
        if values.size < self._limit:
            self._held.append(values.reshape(-1).copy())
            self._held_size += values.size
            if self._held_size >= self._limit:
                self.flush()
            return
        self._reduce(values)

    def flush(self) -> None:
        """Reduce the batches held (see the class) into the statistics."""
        if not self._held:
            return
        values = np.concatenate(self._held) if len(self._held) > 1 else self._held[0]
        self._held, self._held_size = [], 0
        self._reduce(values, keep=True)  # the observer's own array: the collector may keep it

    def _reduce(self, values: np.ndarray, keep: bool = False) -> None:
        low, high = float(values.min()), float(values.max())
        peak = max(-low, high)  # NaN when any value is NaN
        if peak < MASK_MAGNITUDE:  # False for NaN and Inf too
            self.low, self.high = min(self.low, low), max(self.high, high)
            self.collector.update_values(values, peak, keep=keep)
            return
        magnitudes = np.abs(values)
        keep = magnitudes < MASK_MAGNITUDE
        self._ignored += int(magnitudes.size - np.count_nonzero(keep))
        kept = values[keep]
        if kept.size:
            self.low, self.high = min(self.low, float(kept.min())), max(self.high, float(kept.max()))
        self.collector.update(np.abs(kept))

    def merge(self, other: "TensorObserver") -> None:
        """Add what ``other`` (the same tensor's observer over other batches) has seen (exactly: counts
        add, `bounds` take the smaller minimum and the larger maximum, collectors merge)."""
        self.flush()
        other.flush()
        self.seen += other.seen
        self._ignored += other._ignored
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)
        self.collector.merge(other.collector)

    def result(self) -> float:
        """The final amax (finite, > 0)."""
        self.flush()
        if self.seen and self.ignored == self.seen:
            raise DataError(f"tensor {self.name!r} has no finite values on the calibration data (all NaN, "
                            f"Inf or masking constants); exclude its consumer or check the data")
        if self.ignored:
            logger.warning("tensor %r: %d of %d values were NaN, Inf or masking constants (|x| >= %g) "
                           "and were left out of its range", self.name, self.ignored, self.seen,
                           MASK_MAGNITUDE)
        amax = float(self.collector.amax())
        if not np.isfinite(amax):
            raise DataError(f"tensor {self.name!r}: calibration gave a non-finite range {amax}")
        if amax <= 0.0:
            logger.warning("tensor %r is zero on every calibration sample; using amax %g", self.name,
                           ZERO_TENSOR_AMAX)
            return ZERO_TENSOR_AMAX
        return amax

    def bounds(self) -> Optional[Tuple[float, float]]:
        """``(min, max)`` of the finite values kept (not masking constants), or None when none was."""
        self.flush()
        if not self.low <= self.high:
            return None
        return float(self.low), float(self.high)


def make_collector(method: str, *, percentile: float = 99.99, num_bins: int = 2048) -> RangeCollector:
    """A new collector for ``method`` (validated options)."""
    factory = METHODS.get(method)
    if factory is None:
        raise ConfigError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    return factory(percentile, num_bins)


def new_observers(names: Sequence[str], method: str, percentile: float, num_bins: int
                  ) -> Dict[str, TensorObserver]:
    """One new `TensorObserver` of ``method``'s collector per tensor name."""
    return {n: TensorObserver(n, make_collector(method, percentile=percentile, num_bins=num_bins))
            for n in names}


def _check_options(method: str, percentile, num_bins, batch_size) -> None:
    if method not in METHODS:
        raise ConfigError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise ConfigError(f"percentile must be a number in (0, 100], got {percentile!r}")
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 256 \
            or num_bins & (num_bins - 1):
        raise ConfigError(f"num_bins must be a power of two >= 256, got {num_bins!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a whole number >= 1, got {batch_size!r}")


@dataclass(frozen=True)
class Calibration:
    """What one calibration pass over the data gives: ranges, and for ``auto`` the evidence to choose.

    Attributes:
        ranges: ``{tensor: amax}`` of the method for every observed tensor (``auto``: each tensor's
            least-error candidate, the ``tensor`` table).
        unobserved: the tensors no batch reached (tensors of If branches no batch took, of Loop/Scan
            bodies that cannot be observed per iteration); they have no range.
        metadata: the ScaleTable metadata (method, samples, bins).
        producer: the ScaleTable producer.
        candidates: ``auto`` only: the whole tables to choose from, ``{"max": ..., "tensor": ...}``,
            both read from the same histograms.
        choices: ``auto`` only: ``{tensor: candidate}`` of the per-tensor table.
        check_feeds: ``auto`` only: the calibration batches holding the first `CHECK_SAMPLES`
            samples (fewer on large graphs, `onnx_qat.calibration.choice.judge_samples`), which the
            candidate tables are judged on.
        reference: ``auto`` only: the float model's float outputs on ``check_feeds`` (flattened and
            joined over the batches), taken during the calibration run itself.
        bounds: ``{tensor: (min, max)}`` of the finite values seen, whatever the method (the ScaleTable's
            ``bounds``: the ``ort-cpu`` target's asymmetric ranges).
        options: ``auto`` only: every candidate range of every tensor, ``{tensor: {candidate: amax}}``
            (``max``, ``percentile(99.9)``, ``percentile(99.99)``, ``percentile(99.999)``, ``mse``, and
            ``entropy`` unless `collect` was told not to search it), all read from the same histograms:
            what a search over each tensor's range
            (`onnx_qat.accuracy.ranges`) chooses from.
        batch_axis: ``{input: axis}`` of the inputs whose batch axis is not the first (as the data
            declared it): the axis the judgement's pieces declare symbolic.
    """

    ranges: Mapping[str, float]
    unobserved: Tuple[str, ...]
    metadata: Mapping[str, str]
    producer: str
    candidates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    choices: Mapping[str, str] = field(default_factory=dict)
    check_feeds: Tuple[dict, ...] = field(default=(), repr=False)
    reference: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False)
    bounds: Mapping[str, Tuple[float, float]] = field(default_factory=dict)
    options: Mapping[str, Mapping[str, float]] = field(default_factory=dict, repr=False)
    batch_axis: Mapping[str, int] = field(default_factory=dict)

    def table(self, name: Optional[str] = None, **metadata) -> ScaleTable:
        """The ScaleTable of `ranges` (or of candidate ``name``), with ``metadata`` and `bounds` added."""
        amax = self.ranges if name is None else self.candidates[name]
        return ScaleTable(dict(amax), producer=self.producer, metadata={**self.metadata, **metadata},
                          bounds={k: v for k, v in self.bounds.items() if k in amax})




@shared_cluster()
def calibrate(model, data, *, method: str = DEFAULT_METHOD, percentile: float = 99.99, num_bins: int = 2048,
              batch_size: int = 16, config=None, tensors: Optional[Iterable[str]] = None,
              progress: bool = True, output=None, state: Optional[Mapping[str, str]] = None,
              batch_axis: Optional[Mapping[str, int]] = None, workers: Optional[int] = None, ray=None,
              **placement_options) -> ScaleTable:
    """Compute activation ranges of ``model`` on ``data`` with onnxruntime.

    Args:
        model: a float ONNX model (``ModelProto``, not modified, or a path).
        data: calibration data: an ``.npz`` path, a dict of arrays, an array, a stream of feeds
            (a directory or list of ``.npz`` files, a list or iterator of feed dicts, an object with
            ``get_next()``) or a `Dataset` (see [`onnx_qat.load_data`][onnx_qat.io.data.load_data]).
        method: ``"auto"`` (the default: of two tables -- ``max`` everywhere, and per tensor whichever
            of the max, percentile and mse candidates quantizes that tensor with the least error --
            the one whose quantized model's output is closest to the float
            model's on the first 64 calibration samples (fewer on graphs over 625 nodes), a later
            table replacing an earlier one only where the samples agree, `choose`; on fewer than 8
            samples ``max`` everywhere, the paired rule's minimum;
            the metadata keys ``auto_table``, ``auto_output_cosine``, ``auto_choices`` and
            ``auto_note`` record the choice), ``"max"`` (max |x|), ``"percentile"`` (the
            ``percentile``-th percentile of |x|), ``"entropy"`` (TensorRT's KL-divergence threshold,
            guarded) or ``"mse"`` (threshold with the least expected quantization error).
        percentile: for ``method="percentile"``, in (0, 100].
        num_bins: histogram bins for the histogram methods (a power of two >= 256).
        batch_size: samples per onnxruntime run.
        config: a [`QuantizeConfig`][onnx_qat.config.QuantizeConfig]; with ``placement_options``
            (its field names) it decides which tensors are observed. Its ``target`` (``target=``,
            ``"tensorrt"`` by default) names the deployment form the table is for: ``"ort-cpu"``
            also observes the tensors that form adds (the requantization points that need a range of
            their own, rule CPU1: `onnx_qat.insertion.ort_cpu.OrtCpuAdapter.calibration_tensors`),
            leaves the ranges off the FP16 grid and records ``calibration_target`` ``"ort-cpu"`` in
            the metadata (`onnx_qat.scales.CALIBRATION_TARGET_KEY`), so that ``quantize(model,
            scales=table, target="ort-cpu")`` builds the form ``quantize(model, data=..., target=
            "ort-cpu")`` builds with the same method, except rule CPU7's bias correction, which needs
            the data itself (docs/performance.md, "Calibrating once for the CPU target").
        tensors: observe exactly these tensors instead of placement's activation tensors (with
            ``auto``, tables that leave out an activation placement quantizes cannot be judged by
            the output: the per-tensor table is kept, with a warning and ``auto_table`` ``tensor``).
        progress: show a tqdm progress bar on stderr.
        output: when given, the ScaleTable is also saved there (atomically).
        state: ``{output: input}`` of a stateful model: the data runs in order, each run's
            ``output`` fed to the next run as ``input`` (the first feed gives the initial state).
        batch_axis: ``{input: axis}`` for inputs whose batch axis is not the first.
        workers: worker processes the batches are split over, in contiguous parts, each with its own
            session and ``cores // workers`` onnxruntime threads; the parts' collectors are merged
            exactly, so the ranges are identical for any count (`onnx_qat.calibration.parallel`).
            ``1``: in this process. None (the default): one per usable core within memory when the
            batches are estimated to take long enough to gain from workers, else this process. A
            stateful model (``state``) is calibrated in one process (its feeds run in order).
        ray: split the batches over Ray actors instead of local processes: True for the cluster
            ``ray.init()`` finds (``RAY_ADDRESS``) or starts locally, or a cluster address; ``workers``
            actors (None: one per CPU of the cluster). Needs the ``ray`` extra
            (`onnx_qat.runtime.ray_workers`).

    Returns:
        A [`ScaleTable`][onnx_qat.scales.ScaleTable] of per-tensor activation amax whose
        producer names the method. For the ``tensorrt`` target (the default) each amax is raised by
        at most 2^-10 of itself so that its scale ``amax / 127`` is an FP16 value, unless FP16 cannot
        hold that scale within its precision (`onnx_qat.formats.scale_grid`; the metadata key
        ``scale_grid`` says so): FP16 float parts then hold the same scales as the FP32 model.

    Raises:
        ModelError, DataError, ConfigError, PlacementError, OutputError: one line each (the models
        `quantize` refuses are refused here too, before any run: `onnx_qat.placement.refusals`).
    """
    from ..config import QuantizeConfig
    from ..io.data import load_data
    from ..io.layout import with_layout
    from ..io.files import check_output_path
    from ..io.models import load_model
    from ..runtime.workers import worker_spec

    _check_options(method, percentile, num_bins, batch_size)
    workers = worker_spec(workers, ray)
    data = with_layout(data, state=state, batch_axis=batch_axis)
    if output is not None:
        check_output_path(output, inputs=_paths(model, data), what="ScaleTable output")
    proto = load_model(model)
    resolved = QuantizeConfig.from_options(config, **placement_options)
    index = placement = None
    if tensors is None or method == "auto":  # auto's tables are judged with the placement
        index, placement = _placement(proto, resolved, model)
    names = _tensors_to_observe(placement if tensors is None else None, tensors, config, placement_options)
    if tensors is None:
        names = tuple(dict.fromkeys(names + form_tensors(index, placement, resolved.target)))
    dataset = load_data(data, proto, what="calibration data")
    from ..placement.cpu_latency import INPUT_SHAPES_KEY, sample_shapes

    # the form's latency placement times symbolic image sizes at one sample's (read before an iterator of
    # feeds is used up: not at all, see sample_feed)
    sizes = sample_shapes(dataset, proto) if resolved.target != "tensorrt" else {}
    result = collect(proto, dataset, names, method=method, percentile=percentile, num_bins=num_bins,
                     batch_size=batch_size, progress=progress, workers=workers,
                     fp16_grid=resolved.target == "tensorrt", entropy=False)
    if resolved.target != "tensorrt":  # the tensorrt table stays as it was, byte for byte
        result = replace(result, metadata={**result.metadata, CALIBRATION_TARGET_KEY: resolved.target,
                                           **({INPUT_SHAPES_KEY: json.dumps(
                                               {k: list(v) for k, v in sizes.items()})} if sizes else {})})
    if result.unobserved:
        logger.warning("%d tensor(s) sit in If branches no calibration batch took or in Loop/Scan bodies "
                       "that cannot be observed per iteration (e.g. %r); they get no range",
                       len(result.unobserved), result.unobserved[0])
    if method != "auto":
        table = result.table()
    else:
        from ..insertion.inserter import missing_activations, without_unreached_branches
        from .choice import choose

        reached = without_unreached_branches(placement, result.table())
        if missing_activations(reached, result.table()):
            logger.warning("auto calibration: the tensors observed leave out activations placement "
                           "quantizes, so the candidate tables cannot be judged by the model's output; "
                           "keeping each tensor's least-error candidate")
            table = auto_table(result, "tensor", {})
        else:
            table = auto_table(result, *choose(proto, reached, result, target=resolved.target,
                                               precision=resolved.precision, block_size=resolved.block_size))
    if output is not None:
        table.save(output)
    return table


def auto_table(result: Calibration, best: str, cosines: Mapping[str, float], note: str = "") -> ScaleTable:
    """``auto``'s ScaleTable: candidate ``best`` of ``result``, its metadata recording the per-tensor
    picks (``auto_choices``: the candidate names, or ``best`` everywhere for a whole-model table),
    the table kept (``auto_table``), each table's output cosine (``auto_output_cosine``) and, when
    the paired rule did not decide, why (``auto_note``, `onnx_qat.calibration.choice.TableChoice`)."""
    choices = dict(result.choices) if best == "tensor" else {name: best for name in result.ranges}
    meta = {"auto_table": best, "auto_choices": json.dumps(choices, sort_keys=True, separators=(",", ":"))}
    if note:
        meta["auto_note"] = note
    if cosines:
        meta["auto_output_cosine"] = json.dumps({k: round(v, 6) for k, v in cosines.items()},
                                                sort_keys=True, separators=(",", ":"))
        logger.info("auto calibration: output cosine on the calibration data %s; keeping %s",
                    ", ".join(f"{k} {v:.5f}" for k, v in cosines.items()), best)
    counts = Counter(choices.values())
    logger.info("auto calibration: %s", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return result.table(best, **meta)


@cyclic_gc_paused()
def collect(model: onnx.ModelProto, dataset, names: Sequence[str], *, method: str = DEFAULT_METHOD,
            percentile: float = 99.99, num_bins: int = 2048, batch_size: int = 16,
            progress: bool = True, workers=1, fp16_grid: bool = True, entropy: bool = True) -> Calibration:
    """One calibration pass of ``model`` (a loaded float ModelProto, not changed) over ``dataset``
    (a `Dataset`), observing ``names``: the `Calibration` (ranges, and
    for ``auto`` the candidate tables, the check batches and the float outputs on them).

    With ``fp16_grid`` (the default; the TensorRT form's) every range it gives (the ranges,
    ``auto``'s candidate tables and every candidate range in ``options``) is raised by at most 2^-10
    of itself so that its INT8 scale ``amax / 127`` is an FP16 value
    ([`on_fp16_grid`][onnx_qat.formats.scale_grid.on_fp16_grid]): the FP32 Q/DQ model then holds
    the scales its FP16 float parts will hold, and whatever judges a table judges the grid written.
    False (the ``ort-cpu`` form, FP32 only): the ranges as the collectors give them.
    With ``workers`` other than 1 (a count, None for as many as pay, or a `WorkerSpec`, Ray included)
    the batches are split over worker processes and the collectors merged exactly
    (`onnx_qat.calibration.parallel`).

    With ``entropy`` (``auto`` only; the default) ``options`` holds every tensor's ``entropy`` range too
    (the KL search: a candidate of the search over each tensor's range, `onnx_qat.accuracy.ranges`);
    ``calibrate`` and ``quantize`` pass False, since their choice between whole tables does not read it.

    This is all calibration does: choosing among ``auto``'s tables is the caller's (it holds the
    placement the tables are inserted with: `onnx_qat.calibration.choice.choose`).

    Python's cyclic garbage collector is paused meanwhile (`onnx_qat.io.models.cyclic_gc_paused`): the
    observers of tens of thousands of tensors and their analysis allocate ~10^5 containers, none of
    them cyclic garbage, and each collection rescanned all of them (1.8 s of ``auto``'s CPU time on the
    50,000-node benchmark graph).
    """
    from ..runtime.stateful import carry_state, state_outputs
    from ..runtime.workers import worker_spec
    from .parallel import observe_split, split_reason

    _check_options(method, percentile, num_bins, batch_size)
    workers = worker_spec(workers)
    names = tuple(dict.fromkeys(names))
    graph_inputs = set(dataset.input_names)
    observers = new_observers(names, method, percentile, num_bins)
    fetched = [n for n in names if n not in graph_inputs]
    outputs: Tuple[str, ...] = ()
    if method == "auto":
        outputs = tuple(o.name for o in model.graph.output
                        if o.type.tensor_type.elem_type in _FLOAT_TYPES and o.name not in graph_inputs)
    # a stateful model's runs also fetch its state outputs, fed back into the next run
    run_outputs = list(dict.fromkeys(fetched + list(outputs) + list(state_outputs(dataset))))
    desc = f"calibrate ({method})"
    check = judge_samples(len(model.graph.node))  # auto's check batches: fewer samples on large graphs
    why = "" if workers.local else split_reason(model, dataset, run_outputs)
    if not workers.local and not why:
        fresh = functools.partial(new_observers, names, method, percentile, num_bins)
        reached, kept = observe_split(model, dataset, observers, fetched, outputs, run_outputs,
                                      new_observers=fresh,
                                      observe_feeds=functools.partial(observe_feeds, check_samples=check),
                                      count_samples=_samples_in, check_samples=check,
                                      batch_size=batch_size, progress=progress, desc=desc, workers=workers)
    else:
        if why and (workers.count is not None or workers.ray is not None):
            logger.warning("note: %s; --workers and --ray do not apply to it", why)
        session = carry_state(make_runner(model, run_outputs, batch_axis=_batch_axis(dataset)), dataset)
        reached, kept = _observe(session, dataset, observers, fetched, batch_size, progress, desc, outputs,
                                 check)
        reached -= set(getattr(session, "unobservable", ()))  # a body found unobservable after some batches
        del session
    unobserved = tuple(name for name in names if name not in reached)
    if method == "auto":  # every tensor's searches at once
        from .auto import analyze

        analyze([observers[name].collector for name in names if name in reached], entropy=entropy)
    grid = functools.partial(fp16_grid_values, qmax=SCALE_QMAX) if fp16_grid else _floats
    found = {name: observer.result() for name, observer in observers.items() if name in reached}
    ranges = dict(zip(found, grid(list(found.values()))))
    bounds = {name: found for name in ranges for found in (observers[name].bounds(),) if found is not None}
    meta = {**_metadata(method, percentile, num_bins, dataset.num_samples),
            **({"scale_grid": f"fp16 (amax / {SCALE_QMAX:g})"} if fp16_grid else {})}
    producer = f"onnx_qat.calibrate(method={_describe(method, percentile)})"
    if method != "auto":
        return Calibration(ranges, unobserved, meta, producer, bounds=bounds, batch_axis=_batch_axis(dataset))

    # every candidate range of every tensor on the grid at once, a zero range replaced by ZERO_TENSOR_AMAX
    collectors = [observers[name].collector for name in ranges]
    peaks = [c.max_amax() for c in collectors]
    found_options = [[(c, amax) for c, (amax, _) in collector.errors.items()] if collector.errors else []
                     for collector in collectors]
    if entropy:
        for row, collector in zip(found_options, collectors):
            row.append(("entropy", collector.entropy_amax()))
    flat = peaks + [amax for row in found_options for _, amax in row]
    gridded = iter(grid([value if value > 0.0 else ZERO_TENSOR_AMAX for value in flat]))
    candidates = {"max": {n: next(gridded) for n in ranges}, "tensor": ranges}
    choices = {name: collector.choice for name, collector in zip(ranges, collectors)}
    options = {name: {c: next(gridded) for c, _ in row} for name, row in zip(ranges, found_options)}
    for name, collector in zip(ranges, collectors):
        if not collector.errors:  # everything was zero: max only (and entropy when asked)
            options[name] = {"max": candidates["max"][name], **options[name]}
    feeds = tuple(feed for feed, _ in kept)
    reference = {name: np.concatenate([values[name].ravel() for _, values in kept]) for name in outputs} \
        if kept else {}
    return Calibration(ranges, unobserved, meta, producer, candidates, choices, feeds, reference, bounds,
                       options, _batch_axis(dataset))


def _batch_axis(dataset) -> Dict[str, int]:
    """``{input: axis}`` of ``dataset``'s inputs whose batch axis is not the first."""
    return dict(getattr(dataset, "batch_axis", None) or {})


def _floats(values: Sequence[float]) -> list:
    return [float(v) for v in values]


_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                onnx.TensorProto.BFLOAT16)


def _observe(session, dataset, observers: Dict[str, TensorObserver], fetched, batch_size: int,
             progress: bool, desc: str, outputs: Sequence[str] = (), check_samples: int = CHECK_SAMPLES):
    """Run every batch once and reduce each observed tensor into its observer (fed inputs from the feed).

    When only graph inputs are observed (and no ``outputs`` are asked for) the model is not run at
    all. ``session`` may be a `BranchRunner`, which gives None
    for the tensors of If branches a batch does not take (and a Loop/Scan body's tensors stacked over
    its iterations). Returns the names observed on at least one batch, and ``(feed, {output: value})``
    of the batches holding the first ``check_samples`` samples (when ``outputs`` are given).
    """
    from ..runtime.sessions import feeds_with_progress

    feeds = feeds_with_progress(dataset, batch_size, progress, desc)
    reached, kept, _ = observe_feeds(session, dataset, feeds, observers, fetched, outputs,
                                     check_samples=check_samples)
    return reached, kept


def observe_feeds(session, dataset, feeds, observers: Dict[str, TensorObserver], fetched,
                  outputs: Sequence[str] = (), samples: int = 0, first_batch: int = 0,
                  check_samples: int = CHECK_SAMPLES):
    """`_observe`'s loop over ``feeds`` (a contiguous part of ``dataset``'s batches whose first sample
    is ``samples`` and first batch ``first_batch``): ``(names reached, kept check batches, samples
    counted)``; batches are kept while fewer than ``check_samples`` samples were, and samples are
    counted only then. Calibration on worker processes
    runs the same loop on each part (`onnx_qat.calibration.parallel`)."""
    reached = set()
    kept: list = []
    asked = list(dict.fromkeys(list(fetched) + list(outputs)))
    for index, feed in enumerate(feeds, first_batch):
        try:
            values = dict(zip(asked, session.run(asked, feed))) if asked else {}
        except QatError:
            raise
        except Exception as exc:
            raise ModelError(f"onnxruntime failed on batch {index} of {dataset.source}: "
                             f"{brief(exc, 300)}") from None
        given = getattr(session, "last_given", feed)  # a stateful model's carried state input too
        if outputs and samples < check_samples:
            kept.append((given, {name: values[name] for name in outputs}))
            samples += _samples_in(dataset, given)
        for name, observer in observers.items():
            value = values.pop(name) if name in values else given[name]
            if value is not None:
                observer.update(value)
                reached.add(name)
        del values, feed
    for observer in observers.values():  # batches an observer still holds (`TensorObserver.flush`)
        observer.flush()
    return reached, kept, samples


def _samples_in(dataset, feed) -> int:
    """Samples one run of ``dataset`` holds: one for a model without a sample axis, a stream of feeds or
    a stateful model's step; else the feed's first axis."""
    from ..io.data import Dataset

    per_sample = getattr(dataset, "per_sample", None)  # a part of the data in a worker says it
    if per_sample is None:
        per_sample = isinstance(dataset, Dataset) and not dataset.unbatched and not dataset.state
    if not per_sample:
        return 1
    return len(next(iter(feed.values())))


def form_tensors(index, placement, target: str) -> Tuple[str, ...]:
    """The tensors ``target``'s deployment form needs a range for beyond ``placement``'s activations
    (``ort-cpu``: the Conv outputs requantized with their own range, rule CPU1,
    `onnx_qat.insertion.ort_cpu.OrtCpuAdapter.calibration_tensors`); empty for ``tensorrt``. What
    ``quantize(..., data=...)`` calibrates for that form too. ``index``: the `GraphIndex` the
    placement was decided on."""
    from ..insertion.adapters import make_adapter

    wanted = getattr(make_adapter(target), "calibration_tensors", None)
    return () if wanted is None else tuple(wanted(index, placement))


def _placement(proto, config, model):
    """``(GraphIndex, placement)`` of ``proto`` under the resolved ``config``, after the models `quantize`
    refuses are refused in its words (already quantized; a weight it quantizes holding NaN or
    infinities: `onnx_qat.placement.refusals`), so that no table is written for a model that cannot be
    quantized. ``model``: what the caller gave (a path names it in the messages)."""
    from ..graph.index import GraphIndex
    from ..placement.policy import policy_for
    from ..placement.refusals import model_words, refuse_non_finite_weights, refuse_quantized

    what = model_words(model)
    index = GraphIndex(proto)
    refuse_quantized(proto, what, index)
    placement = policy_for(config.target).place(index, config)
    refuse_non_finite_weights(index, placement, what)
    return index, placement


def _tensors_to_observe(placement, tensors, config, placement_options) -> Tuple[str, ...]:
    if tensors is not None:
        if isinstance(tensors, str):
            tensors = (tensors,)
        names = tuple(dict.fromkeys(tensors))
        if not names:
            raise ConfigError("tensors is empty; give at least one tensor name, or None to use placement")
        return names
    names = placement.activation_tensors()
    if not names:
        from ..config import QuantizeConfig
        from ..formats.numeric import get_format

        fmt = get_format(QuantizeConfig.from_options(config, **placement_options).precision)
        if fmt.weight_only:
            raise PlacementError(f"nothing to calibrate: precision {fmt.name} is weight-only (no activation "
                                 "is quantized); quantize it without --data, or with --data for the "
                                 "activation-aware weight scales")
        raise PlacementError("nothing to calibrate: placement quantizes no activation in the model "
                             "(see 'onnx-qat inspect' for each node's decision)")
    return names


def _paths(*items) -> Tuple:
    return tuple(i for i in items if isinstance(i, (str, os.PathLike)))


def _describe(method: str, percentile: float) -> str:
    return f"percentile, percentile={percentile:g}" if method == "percentile" else method


def _metadata(method: str, percentile: float, num_bins: int, num_samples: int) -> Dict[str, str]:
    meta = {"calibration_method": method, "calibration_samples": str(num_samples)}
    if method == "percentile":
        meta["percentile"] = f"{percentile:g}"
    if method in ("percentile", "entropy", "mse", "auto"):
        meta["num_bins"] = str(num_bins)
    return meta
