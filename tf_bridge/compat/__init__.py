"""tf_bridge.compat: the public names of NVIDIA's ``tensorflow_quantization``, one import away.

A script written for the toolkit switches by changing its import line::

    from tensorflow_quantization import quantize_model, utils          # before
    from tf_bridge.compat import quantize_model, utils                 # after

The submodules mirror the toolkit's: `quantize` (``quantize_model``,
``QuantizationSpec`` with ``.layers``, ``LayerConfig``), `custom_qdq_cases`,
`custom_qdq_case_base`, `quantize_wrapper_base`
(``BaseQuantizeWrapper``: new layer support) and `utils`
(``CreateAssetsFolders``, ``convert_saved_model_to_onnx``, ``convert_keras_model_to_onnx``,
``KerasModelTraveller``, ``find_my_predecessors``, ``find_my_successors``).

Everything runs on tf_bridge (Keras 3): the converters write the Q/DQ ONNX model of a QAT model
through [`tf_bridge.export_onnx`][], with its parity proof. Differences from the toolkit are
listed in the documentation's migration page (``docs/migration.md``).
"""
from __future__ import annotations

from . import custom_qdq_cases, utils
from .custom_qdq_case_base import CustomQDQInsertionCase
from .quantize import LayerConfig, QuantizationSpec, quantize_model
from .quantize_wrapper_base import BaseQuantizeWrapper
from .utils import CreateAssetsFolders, convert_keras_model_to_onnx, convert_saved_model_to_onnx

__all__ = [
    "quantize_model", "QuantizationSpec", "LayerConfig", "CustomQDQInsertionCase", "custom_qdq_cases",
    "utils", "BaseQuantizeWrapper", "CreateAssetsFolders", "convert_saved_model_to_onnx",
    "convert_keras_model_to_onnx",
]
