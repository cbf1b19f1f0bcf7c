"""What sensitivity and mixed precision share: one load, one placement, one calibration, one
gated session, the float model's outputs once.

`prepare` loads the model, decides placement (the target's policy, with the caller's
exclusions), splits the data into a calibration part and an evaluation part, calibrates once,
inserts Q/DQ once (the one inserter), puts every site behind a gate, and runs the float model once
on the evaluation data (its outputs are the reference of every later run).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx

from ..errors import ConfigError, PlacementError
from ..scales import ScaleTable
from .figures import OutputError, output_error
from .gated import gate_model, join_flat, lift_scales
from .sites import Site, sites_of, tensors_to_calibrate

logger = logging.getLogger(__name__)

#: Share of the samples held out for evaluation when no evaluation data is given.
HOLDOUT = 0.25
#: Metrics a ranking or a threshold can use.
METRICS = ("cosine", "sqnr", "max_abs")


@dataclass
class Prepared:
    """The shared state of one accuracy run (see the module docstring)."""

    float_model: onnx.ModelProto
    placement: object
    sites: Tuple[Site, ...]
    table: ScaleTable
    calibration: object  # Dataset the ranges came from (None with given scales)
    evaluation: object  # Dataset the errors are measured on
    feeds: Tuple[Dict[str, np.ndarray], ...]
    reference: Dict[str, np.ndarray]
    runner: object  # the settings runner: LocalSettings or PooledSettings (onnx_qat.accuracy.parallel)
    method: str
    int4: object = None  # precision int4: the WeightOnly state (onnx_qat.accuracy.format_settings)
    #: with range candidates (``prepare(..., range_candidates=True)``): ``{tensor: {candidate: amax}}``
    #: of every calibrated tensor, and ``{tensor: scale input}`` of the gated model's lifted scales
    options: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    scale_inputs: Mapping[str, str] = field(default_factory=dict)
    qmax: float = 127.0

    def error(self, quantized, amax: Optional[Mapping[str, float]] = None) -> OutputError:
        """Output error with exactly the sites ``quantized`` (indices) in INT8, in the gated session;
        with ``amax`` (``{tensor: amax}``, every activation the placement quantizes), the activation
        ranges of that table instead of the ones the gated model was built with (needs
        ``scale_inputs``, whose runner is always this process's `LocalSettings`). Every trial of a
        search is one call of this function."""
        if amax is None:
            return self.runner.errors([quantized])[0]
        return output_error(self.reference, self.runner.run(quantized, self.scale_feeds(amax)))

    def errors(self, settings, on_run=None) -> List[OutputError]:
        """`error` of each setting (an iterable of site indices), in order; on the workers when there
        are several (`onnx_qat.accuracy.parallel`). ``on_run()`` is called after each run."""
        return self.runner.errors(list(settings), on_run)

    @property
    def runs(self) -> int:
        """Settings run so far."""
        return self.runner.runs

    def close(self) -> None:
        """Stop the worker processes, if any (the local runner needs nothing)."""
        self.runner.close()

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def scale_feeds(self, amax: Optional[Mapping[str, float]]) -> Optional[Dict[str, np.ndarray]]:
        """``{scale input: float32 scale}`` of the lifted scales under ``{tensor: amax}`` (scale groups
        share their largest range, as the inserter computes them); None for None."""
        if amax is None:
            return None
        from ..insertion.inserter import activation_scales, group_amax

        grouped = group_amax(self.placement, ScaleTable(dict(amax)))
        tensors = [t for t in self.scale_inputs if t in grouped]
        values = activation_scales([grouped[t] for t in tensors], self.qmax)
        return {self.scale_inputs[t]: np.asarray(v, dtype=np.float32) for t, v in zip(tensors, values)}


def split_data(data, eval_data, model: onnx.ModelProto, holdout: float = HOLDOUT):
    """``(calibration, evaluation)`` Datasets: ``eval_data`` when given, else the last ``holdout``
    share of ``data`` (at least one sample, or feed), which calibration then does not see
    (`onnx_qat.io.data.Dataset.split`; a stateful model's held-out part starts from the initial
    state)."""
    from ..io.data import load_data

    calib = load_data(data, model, what="calibration data")
    if eval_data is not None:
        return calib, load_data(_layout_like(eval_data, data), model, what="evaluation data")
    return calib.split(holdout)


def _layout_like(eval_data, data):
    """``eval_data`` with ``data``'s state and batch axes unless it has its own."""
    from ..io.layout import LaidOut, split_layout

    layout = split_layout(data)[1]
    if isinstance(eval_data, LaidOut) or not (layout.state or layout.batch_axis):
        return eval_data
    return LaidOut(eval_data, layout)


def _table(scales) -> ScaleTable:
    import os

    if isinstance(scales, ScaleTable):
        return scales
    if isinstance(scales, Mapping):
        return ScaleTable(scales, producer="mapping")
    if isinstance(scales, (str, os.PathLike)):
        return ScaleTable.load(scales)
    raise ConfigError(f"scales must be a ScaleTable, its JSON path or a mapping, not {type(scales).__name__}")


def prepare(model, data, *, scales=None, method: str = "max", eval_data=None, config=None,
            batch_size: int = 16, progress: bool = True, calibration_options: Optional[Mapping] = None,
            activation_stats: Optional[Sequence[str]] = (), workers=1,
            range_candidates: bool = False, weight_scales: Optional[ScaleTable] = None
            ) -> Tuple[Prepared, Dict[str, dict]]:
    """Everything later runs share (see the module docstring), and the statistics (amax, clipped
    share, quantization SQNR) of the activation tensors ``activation_stats`` on the evaluation data
    (None: every activation tensor placement quantizes). The settings (and the calibration's batches)
    run on ``workers`` processes (a count, None for `onnx_qat.accuracy.parallel.choose_workers`, or a
    `WorkerSpec`, Ray included); close the result (``with prepared:``) to stop them.

    ``range_candidates`` (with ``method="auto"``, calibration data and a format with activation
    ranges): keep every candidate range of every tensor (``Prepared.options``, from `auto`'s one
    pass, `onnx_qat.calibration.runner.collect`) and make the activation scales of the gated model
    inputs, so that a setting can choose each tensor's range (`onnx_qat.accuracy.ranges`). The
    gated model starts from each tensor's least-error candidate (``auto``'s per-tensor table);
    ``weight_scales`` (a ScaleTable) gives weight ranges to use instead of each weight's own max
    (weights already rounded onto their grid). With range candidates the settings run in this process
    whatever ``workers`` says (`LocalSettings`: the search's trials feed scales and move the runner's
    reference, which worker processes do not share); the calibration pass still uses ``workers``."""
    from ..runtime.workers import worker_spec

    workers = worker_spec(workers)
    from ..calibration import calibrate
    from ..config import QuantizeConfig
    from ..io.models import load_model
    from ..graph.index import GraphIndex, assign_node_names
    from ..rewrite import nothing_to_quantize, rewrite_model, refuse_quantized
    from ..placement.policy import policy_for

    from ..formats.numeric import get_format
    from .format_settings import insertion_config, weight_only_ranges

    config = config or QuantizeConfig()
    float_model = load_model(model, min_opset=get_format(config.precision).min_opset)
    refuse_quantized(float_model)
    assign_node_names(float_model)
    index = GraphIndex(float_model)
    placement = policy_for(config.target).place(index, config)
    if placement.empty:
        raise PlacementError(nothing_to_quantize(placement, precision=config.precision))
    sites = sites_of(placement, index)
    tensors = tensors_to_calibrate(placement, sites, index)
    del index
    if data is None and eval_data is None:
        raise ConfigError("give data (calibration data) or eval_data")
    base, int4 = float_model, None  # the model every setting is built from (int4: after the AWQ edits)
    options: Mapping[str, Mapping[str, float]] = {}
    if scales is not None:
        table = _table(scales)
        calib = None
        evaluation = _evaluation_only(eval_data if eval_data is not None else data, float_model)
    elif get_format(config.precision).weight_only:  # no activation ranges (see .formats)
        calib, evaluation = (None, _evaluation_only(eval_data, float_model)) if data is None else \
            split_data(data, eval_data, float_model)
        int4 = weight_only_ranges(float_model, placement, calib, config, progress=progress,
                                  batch_size=batch_size)
        base, table = int4.base, int4.table
    else:
        calib, evaluation = split_data(data, eval_data, float_model)
        if range_candidates and method == "auto":
            found = _collect(float_model, calib, tensors, batch_size, progress, calibration_options, workers,
                             fp16_grid=config.target == "tensorrt")
            table, options = found.table(), found.options
            if weight_scales is not None:
                table = table.merged(ScaleTable(weights=dict(weight_scales.weights)))
        else:
            table = calibrate(float_model, calib, method=method, tensors=tensors, progress=progress,
                              batch_size=batch_size, workers=workers, config=config,
                              **dict(calibration_options or {}))
    qdq = rewrite_model(base if int4 is None else int4.model(), scales=table, data=None, method="max",
                          config=insertion_config(config), calib_kw={}, placement=placement,
                          progress=False, fold_scales=False).model  # paired node by node with `base`
    gated = gate_model(qdq, base, sites)
    del qdq
    lifted = lift_scales(gated, placement.activation_tensors()) if options else {}
    feeds = tuple(evaluation.batches(batch_size))
    observed = placement.activation_tensors() if activation_stats is None else tuple(activation_stats)
    state = evaluation.state
    started = time.perf_counter()
    reference, stats = _float_run(float_model, feeds, observed, placement, table, state)
    if lifted:
        runner = _local_runner(gated, sites, feeds, reference, state, lifted, workers)
    else:
        runner = _settings_runner(gated, sites, feeds, reference, state, workers,
                                  time.perf_counter() - started)
    return Prepared(base, placement, sites, table, calib, evaluation, feeds, reference, runner,
                    method if scales is None else "given", int4, options,
                    {t: name for t, (name, _) in lifted.items()}, get_format(config.precision).qmax), stats


def _collect(float_model, calib, tensors, batch_size: int, progress: bool, calibration_options, workers,
             fp16_grid: bool):
    """``auto``'s one calibration pass with every candidate range kept (`Calibration.options`);
    ``fp16_grid``: the TensorRT form's ranges on the FP16 grid (`onnx_qat.calibration.runner.collect`)."""
    from ..calibration.runner import collect

    kw = {k: v for k, v in dict(calibration_options or {}).items() if k == "num_bins"}
    found = collect(float_model, calib, tensors, method="auto", batch_size=batch_size, progress=progress,
                    workers=workers, fp16_grid=fp16_grid, **kw)
    if found.unobserved:
        logger.warning("%d tensor(s) sit in If branches no calibration batch took or in Loop/Scan bodies "
                       "(e.g. %r); they get no range", len(found.unobserved), found.unobserved[0])
    return found


def _local_runner(gated, sites, feeds, reference, state, lifted, workers):
    """`LocalSettings` on a gated runner fed the lifted scales (see `prepare`'s range candidates)."""
    from .gated import GatedRunner
    from .parallel import LocalSettings

    if workers.ray is not None or (workers.count or 1) > 1:
        logger.info("the range search's settings run in this process (--workers applies to its calibration)")
    scales = {name: value for name, value in lifted.values()}
    return LocalSettings(GatedRunner(gated, len(sites), feeds, tuple(reference), state=state, scales=scales),
                         reference)


def _settings_runner(gated, sites, feeds, reference, state, workers, float_seconds: float):
    from .cuts import CUT_CACHE_BYTES
    from .parallel import choose_workers, peak_memory, settings_runner

    count = choose_workers(workers, gated_bytes=gated.ByteSize(), feeds=feeds, reference=reference,
                           num_sites=len(sites), float_seconds=float_seconds, cut_bytes=CUT_CACHE_BYTES,
                           peak_bytes=peak_memory())
    return settings_runner(gated, len(sites), feeds, reference, state, count, workers)


def _evaluation_only(data, model):
    from ..io.data import load_data

    return load_data(data, model, what="evaluation data")


def _float_run(float_model, feeds, observed: Tuple[str, ...], placement, table, state=None):
    """The float model's float outputs on ``feeds`` (flattened) and the statistics of ``observed``
    (a stateful model's ``state`` carried from feed to feed)."""
    from ..insertion.inserter import group_amax
    from ..runtime.sessions import make_session
    from ..runtime.stateful import carry_state

    outputs = [o.name for o in float_model.graph.output
               if o.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                   onnx.TensorProto.DOUBLE)]
    if not outputs:
        raise PlacementError("the model has no float output to measure the quantization error on")
    graph_inputs = {i.name for i in float_model.graph.input}
    fetched = [t for t in observed if t not in graph_inputs and t not in outputs]
    session = carry_state(make_session(float_model, extra_outputs=fetched, spin=False), state)
    amax = group_amax(placement, table)
    stats = {t: _Accumulator(amax.get(t, table.activations.get(t, 0.0))) for t in observed}
    parts: Dict[str, list] = {name: [] for name in outputs}
    for feed in feeds:
        values = dict(zip(outputs + fetched, session.run(outputs + fetched, feed)))
        for name in outputs:
            parts[name].append(values[name])
        given = getattr(session, "last_given", feed)  # with a carried state input
        for t, acc in stats.items():
            acc.update(given[t] if t in given else values[t])
    # float64 once: every later comparison reads the reference in float64
    reference = {name: join_flat(v).astype(np.float64) for name, v in parts.items()}
    return reference, {t: acc.result() for t, acc in stats.items()}


class _Accumulator:
    """Clipped share and quantization SQNR of one activation tensor under INT8 with ``amax``."""

    def __init__(self, amax: float):
        self.amax = float(amax)
        self.count = self.clipped = 0
        self.signal = self.noise = 0.0

    def update(self, values: np.ndarray) -> None:
        x = np.asarray(values, dtype=np.float32).ravel()
        if not self.amax > 0:
            return
        scale = self.amax / 127.0
        q = np.clip(np.rint(x / scale), -128, 127)
        self.clipped += int(np.count_nonzero((x > 127 * scale) | (x < -128 * scale)))
        self.count += x.size
        xd = x.astype(np.float64)
        self.signal += float(xd @ xd)
        err = xd - q * scale
        self.noise += float(err @ err)

    def result(self) -> dict:
        return {"amax": self.amax, "clipped": self.clipped / self.count if self.count else 0.0,
                "sqnr_db": _db(self.signal, self.noise)}


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def weight_statistics(values: np.ndarray, axis: Optional[int]) -> dict:
    """amax (largest channel), clipped share (0: weights take their own max) and SQNR of INT8
    weight quantization, per channel along ``axis`` (per tensor when None), range [-127, 127]."""
    w = np.asarray(values, dtype=np.float64)
    if axis is None:
        amax = np.array(np.abs(w).max())
        scale = np.maximum(amax, 1e-30) / 127.0
    else:
        reduce = tuple(i for i in range(w.ndim) if i != axis)
        amax = np.abs(w).max(axis=reduce, keepdims=True)
        scale = np.maximum(amax, 1e-30) / 127.0
    q = np.clip(np.rint(w / scale), -127, 127) * scale
    err = w - q
    return {"amax": float(np.max(amax)), "clipped": 0.0, "sqnr_db": _db(float((w * w).sum()),
                                                                         float((err * err).sum()))}


__all__ = ["prepare", "Prepared", "OutputError", "output_error", "split_data", "weight_statistics",
           "METRICS", "HOLDOUT"]
