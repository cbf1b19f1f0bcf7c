"""Calibration: activation ranges from running the float model in onnxruntime.

* :func:`collect` — one pass of the runner (batches, progress bar, bounded memory) -> :class:`Calibration`
  (ranges; for ``auto`` also the candidate tables and the evidence to choose among them).
* :func:`calibrate` — the public entry: load, place, :func:`collect`, for ``auto`` :func:`.choice.choose`
  -> ScaleTable. The rewrite behind :func:`onnx_qat.quantize` calls :func:`collect` and
  :func:`.choice.choose` itself, with the model and placement it holds.
* One collector per method, sharing :class:`~.collector.RangeCollector`:
  :class:`MaxCollector` (``max``), :class:`PercentileCollector` (``percentile``),
  :class:`EntropyCollector` (``entropy``), :class:`MseCollector` (``mse``),
  :class:`AutoCollector` (``auto``, the default: the best of max / percentile / mse per tensor,
  then whole tables judged by the model's output, :mod:`.choice`).

Owns: running the float model to observe tensors (If branches and Loop/Scan bodies included),
turning observations into ranges and, for ``auto``, judging its candidate tables by the output
(:mod:`.choice`, called by whoever holds the model and the placement; never the rewrite).
May import: io, graph, formats, config, scales, runtime, placement (which tensors to observe),
insertion (the judge model of :mod:`.choice`).
"""
from __future__ import annotations

from .auto import AutoCollector
from .collector import AbsHistogram, RangeCollector
from .entropy import EntropyCollector
from .max_collector import MaxCollector
from .mse import MseCollector
from .percentile import PercentileCollector
from .runner import (DEFAULT_METHOD, METHODS, Calibration, TensorObserver, calibrate, collect,
                     make_collector)

__all__ = [
    "calibrate", "collect", "Calibration", "DEFAULT_METHOD", "METHODS", "make_collector", "RangeCollector",
    "AbsHistogram",
    "TensorObserver",
    "MaxCollector", "PercentileCollector", "EntropyCollector", "MseCollector",
    "AutoCollector",
]
