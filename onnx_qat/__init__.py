"""onnx_qat: place INT8 QuantizeLinear/DequantizeLinear pairs in any float ONNX model
the way TensorRT wants them, from calibration data or from given scales.

Public API (imported lazily so ``import onnx_qat`` stays fast):

* [`quantize`][onnx_qat.quantize.quantize] — float ONNX + (ScaleTable | calibration data) -> Q/DQ ONNX.
* [`calibrate`][onnx_qat.calibration.runner.calibrate] — run the float model in onnxruntime and return a
  [`ScaleTable`][onnx_qat.scales.ScaleTable].
* [`place`][onnx_qat.placement.policy.place] — the placement decisions only (what ``onnx-qat inspect``
  prints).
* [`check`][onnx_qat.check.check] — TensorRT-readiness report for any Q/DQ model.
* [`compare`][onnx_qat.runtime.compare.compare] — numerics of two models on the same data, as a typed result.
* [`sensitivity`][onnx_qat.accuracy.sensitivity.sensitivity] — per-site output error of quantization, ranked
  ([`SensitivityResult`][onnx_qat.accuracy.sensitivity.SensitivityResult]).
* [`cast_float_parts`][onnx_qat.formats.float_parts.cast_float_parts] — a float or Q/DQ model with its float
  parts in FP16/BF16, what stays FP32 kept with its reason
  ([`FloatPartsResult`][onnx_qat.formats.float_parts.FloatPartsResult]).
* [`load_model`][onnx_qat.io.models.load_model], [`save_model`][onnx_qat.io.models.save_model],
  [`load_data`][onnx_qat.io.data.load_data] — the I/O edges.
* [`ScaleTable`][onnx_qat.scales.ScaleTable], [`QuantizeConfig`][onnx_qat.config.QuantizeConfig] and the
  errors in `onnx_qat.errors`.
"""
from __future__ import annotations

import importlib
import sys
import types

from .errors import (  # noqa: F401  (cheap, and users catch these)
    AccuracyError, ConfigError, DataError, ExportError, ModelError, OutputError, PlacementError, QatError,
    ScalesError, TensorRTUnavailable, WorkerError,
)

__version__ = "0.1.0"

_LAZY = {
    "quantize": "onnx_qat.quantize",
    "QuantizeResult": "onnx_qat.quantize",
    "place": "onnx_qat.placement",
    "Placement": "onnx_qat.placement.marks",
    "calibrate": "onnx_qat.calibration",
    "check": "onnx_qat.check",
    "CheckReport": "onnx_qat.check",
    "compare": "onnx_qat.runtime.compare",
    "Comparison": "onnx_qat.runtime.compare",
    "load_model": "onnx_qat.io.models",
    "save_model": "onnx_qat.io.models",
    "load_data": "onnx_qat.io.data",
    "ScaleTable": "onnx_qat.scales",
    "WeightRange": "onnx_qat.scales",
    "QuantizeConfig": "onnx_qat.config",
    "sensitivity": "onnx_qat.accuracy",
    "cast_float_parts": "onnx_qat.formats.float_parts",
    "SensitivityResult": "onnx_qat.accuracy",
}


#: Public functions that share their name with the module defining them.
_SHADOWED = frozenset({"quantize", "check"})


class _Package(types.ModuleType):
    """Keeps ``onnx_qat.quantize``/``check`` the functions.

    Importing a submodule sets it as an attribute of its package; for the two
    modules named after the function they define, the function is kept instead,
    so ``onnx_qat.check(model)`` works whatever was imported before.
    ``from onnx_qat.check import Finding`` still reads the module itself.
    """

    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_qat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY) + [
    "QatError", "ModelError", "DataError", "ScalesError", "PlacementError", "OutputError",
    "ConfigError", "ExportError", "AccuracyError", "TensorRTUnavailable", "WorkerError",
]
