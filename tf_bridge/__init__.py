"""tf_bridge: quantization-aware training for Keras 3 on TensorFlow 2.16+.

Public API (names users of NVIDIA's ``tensorflow_quantization`` know):

* :func:`quantize_model` — a new model with INT8 quantizers (TensorRT placement).
* :func:`float_model` — the float twin of a QAT model (trained weights, no quantizers).
* :class:`QuantizationSpec` — per-layer / per-class choices.
* :class:`CustomQDQInsertionCase` and :mod:`tf_bridge.custom_qdq_cases` — pattern rules.
* :func:`calibrate` — activation ranges from data.
* :func:`describe`, :func:`quantizer_records` — the quantizer state (table / records).
* :class:`ActivationQuantizer`, :class:`QuantizeWrapper` — the Keras layers
  (registered serializable, so ``.keras`` files load with ``safe_mode=True``).
* :func:`fake_quant`, :func:`fake_quant_reference` — the numerics contract.
* :func:`load_model` — a ``.keras`` archive, always with Keras's safe mode (one-line errors).
* :class:`NonFiniteGuard` — the callback a QAT model's ``fit`` adds: one line naming the layer
  when training diverges (:class:`QATFunctional`, :class:`QATSequential` are the model classes).
* :func:`check_finite`, :func:`nonfinite_weights` — find NaN/Inf weights and ranges by name.
* :func:`export_onnx` — Q/DQ ONNX with the learned scales, proven equal in onnxruntime
  (:class:`ExportReport`).
"""
from __future__ import annotations

from . import custom_qdq_cases
from .calibrate import CalibrationResult, UntrainedBatchNormWarning, calibrate
from .cases import CustomQDQInsertionCase
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
