"""Calibration: activation ranges from running the float model in onnxruntime.

* `collect` — one pass of the runner (batches, progress bar, bounded memory) -> `Calibration`
  (ranges; for ``auto`` also the candidate tables and the evidence to choose among them).
* [`calibrate`][onnx_qat.calibration.calibrate] — the public entry: load, place, `collect`, for ``auto``
  `choice.choose` -> ScaleTable. The rewrite behind [`onnx_qat.quantize`][onnx_qat.quantize.quantize] calls
  `collect` and `choice.choose` itself, with the model and placement it holds.
* One collector per method, sharing `RangeCollector`:
  `MaxCollector` (``max``), `PercentileCollector` (``percentile``),
  `EntropyCollector` (``entropy``), `MseCollector` (``mse``),
  `AutoCollector` (``auto``, the default: the best of max / percentile / mse per tensor,
  then whole tables judged by the model's output, `choice`).
* `parallel` — the batches split over worker processes or Ray actors in contiguous parts, each
  part's collectors merged exactly into one pass's (``workers=``, ``ray=``).

Owns: running the float model to observe tensors (If branches and Loop/Scan bodies included),
turning observations into ranges and, for ``auto``, judging its candidate tables by the output
(`choice`, called by whoever holds the model and the placement; never the rewrite).
May import: io, graph, formats, config, scales, runtime, placement (which tensors to observe),
insertion (the judge model of `choice`).
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
