"""Calibration: activation ranges from running the float model in onnxruntime.

* [`calibrate`][onnx_qat.calibration.calibrate] — the runner (batches, progress bar, bounded memory) ->
  ScaleTable.
* One collector per method, sharing `RangeCollector`:
  `MaxCollector` (``max``), `PercentileCollector` (``percentile``),
  `EntropyCollector` (``entropy``), `MseCollector` (``mse``),
  `AutoCollector` (``auto``, the default: the best of max / percentile / mse per tensor,
  then whole tables judged by the model's output, `output_check`).

Owns: running the float model to observe tensors (If branches and Loop/Scan bodies included) and
turning observations into ranges.
May import: io, graph, formats, config, scales, runtime, placement (which tensors to observe).
"""
from __future__ import annotations

from .auto import AutoCollector
from .collector import AbsHistogram, RangeCollector
from .entropy import EntropyCollector
from .max_collector import MaxCollector
from .mse import MseCollector
from .percentile import PercentileCollector
from .runner import DEFAULT_METHOD, METHODS, TensorObserver, calibrate, make_collector

__all__ = [
    "calibrate", "DEFAULT_METHOD", "METHODS", "make_collector", "RangeCollector", "AbsHistogram",
    "TensorObserver",
    "MaxCollector", "PercentileCollector", "EntropyCollector", "MseCollector",
    "AutoCollector",
]
