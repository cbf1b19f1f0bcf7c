"""tf_bridge: quantization-aware training for Keras 3 on TensorFlow 2.16+.

Public API (names users of NVIDIA's ``tensorflow_quantization`` know):

* [`quantize_model`][tf_bridge.quantize_model] — a new model with INT8 quantizers (TensorRT placement).
* [`float_model`][tf_bridge.float_model] — the float twin of a QAT model (trained weights, no quantizers).
* [`QuantizationSpec`][tf_bridge.QuantizationSpec] — per-layer / per-class choices.
* [`CustomQDQInsertionCase`][tf_bridge.CustomQDQInsertionCase] and [`tf_bridge.custom_qdq_cases`][] — pattern
  rules.
* [`calibrate`][tf_bridge.calibrate.calibrate] — activation ranges from data.
* [`describe`][tf_bridge.describe.describe], [`quantizer_records`][tf_bridge.quantizer_records] — the
  quantizer state (table / records).
* [`ActivationQuantizer`][tf_bridge.ActivationQuantizer], [`QuantizeWrapper`][tf_bridge.QuantizeWrapper] — the
  Keras layers (registered serializable, so ``.keras`` files load with ``safe_mode=True``).
* [`fake_quant`][tf_bridge.fake_quant.fake_quant], [`fake_quant_reference`][tf_bridge.fake_quant_reference] —
  the numerics contract.
* [`load_model`][tf_bridge.load_model] — a ``.keras`` archive, always with Keras's safe mode (one-line
  errors).
* [`NonFiniteGuard`][tf_bridge.NonFiniteGuard] — the callback a QAT model's ``fit`` adds: one line naming the
  layer when training diverges ([`QATFunctional`][tf_bridge.QATFunctional],
  [`QATSequential`][tf_bridge.QATSequential] are the model classes).
* [`check_finite`][tf_bridge.check_finite], [`nonfinite_weights`][tf_bridge.nonfinite_weights] — find NaN/Inf
  weights and ranges by name.
* [`export_onnx`][tf_bridge.export_onnx] — Q/DQ ONNX with the learned scales, proven equal in onnxruntime
  ([`ExportReport`][tf_bridge.ExportReport]).
"""
from __future__ import annotations

from . import custom_qdq_cases
from .calibrate import CalibrationResult, UntrainedBatchNormWarning, calibrate
from .case_base import CustomQDQInsertionCase
from .describe import QuantizerRecord, describe, quantizer_records
from .export import ExportReport, export_onnx
from .fake_quant import fake_quant, fake_quant_reference
from .finite import check_finite, nonfinite_weights
from .guard import NonFiniteGuard, QATFunctional, QATSequential
from .loading import load_model
from .quantizers import ActivationQuantizer, QuantizeWrapper, UncalibratedQuantizerWarning
from .spec import QuantizationSpec
from .wrap import float_model, quantize_model

__all__ = [
    "quantize_model", "float_model", "QuantizationSpec", "CustomQDQInsertionCase", "custom_qdq_cases",
    "calibrate", "CalibrationResult", "UntrainedBatchNormWarning", "describe", "quantizer_records",
    "QuantizerRecord", "ActivationQuantizer", "QuantizeWrapper", "UncalibratedQuantizerWarning",
    "fake_quant", "fake_quant_reference", "export_onnx", "ExportReport", "load_model",
    "NonFiniteGuard", "QATFunctional", "QATSequential", "check_finite", "nonfinite_weights",
]
