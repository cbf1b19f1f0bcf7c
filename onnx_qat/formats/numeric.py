"""Numeric formats of Q/DQ as data: ``int8``, ``fp8`` and ``int4``.

A `Format` says how a quantized tensor is stored and which marks apply; placement
(`onnx_qat.placement.format_marks.adapt_placement`), the one inserter
(`onnx_qat.insertion.inserter`) and the checker (`onnx_qat.check.rules_formats`) read the same
record, so the three never disagree on a format. The `onnx_qat.insertion.targets` Target says how
the same marks are deployed (TensorRT, onnxruntime CPU); the format says which numbers.

==========  ==============  ==============  ===========  =====  =====================================
format      activations     weights         scale        opset  marks that apply
==========  ==============  ==============  ===========  =====  =====================================
``int8``    int8, zp 0      int8 per chan.  amax / 127   13     every rule (R1-R10)
``fp8``     E4M3FN, zp 0    E4M3FN per ch.  amax / 448   19     every rule; attention BMM inputs and
                                                                the Softmax output by default
``int4``    (float)         int4 blocks     amax / 7     21     weights of MatMul/Gemm only (W4)
==========  ==============  ==============  ===========  =====  =====================================

Sources: TensorRT Developer Guide, "Working with Quantized Types" -> "Quantization Schemes"
(FP8: ``castToFp8(clip(x / s, -448, 448))``; INT4: ``clip(x / s, -8, 7)``, per-block scales,
block sizes 64 and 128 along one of the last two dimensions, weight-only); ONNX operator
docs (QuantizeLinear/DequantizeLinear: float8 types since opset 19, int4 and ``block_size``
since opset 21).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Tuple

from ..errors import ConfigError

#: ONNX ``TensorProto`` element types (numbers, so that ``import onnx_qat.config`` stays free of onnx).
ONNX_INT8, ONNX_FLOAT8E4M3FN, ONNX_INT4 = 3, 17, 22


@dataclass(frozen=True)
class Format:
    """One numeric form of quantized tensors.

    Attributes:
        name: the ``precision`` option value.
        description: one line for reports and docs.
        activation_type: ONNX element type of quantized activations, or None when the format
            is weight-only (activations stay float).
        weight_type: ONNX element type of stored weights.
        qmax: the quantized value ``amax`` maps to (scale = amax / qmax).
        weight_range: ``(min, max)`` weights are clipped to after scaling.
        min_opset: the lowest default-domain opset whose QuantizeLinear/DequantizeLinear
            take these types (models are upgraded to it).
        weight_ops: op types whose constant weights the format quantizes.
        blocked: weights carry one scale per block of ``block_size`` values along the
            reduction axis (DequantizeLinear's ``block_size``) instead of one per channel.
        attention: default of ``include_attention`` (quantize attention-score products and
            the Softmax output feeding them).
    """

    name: str
    description: str
    activation_type: Optional[int]
    weight_type: int
    qmax: float
    weight_range: Tuple[float, float]
    min_opset: int
    weight_ops: Tuple[str, ...]
    blocked: bool = False
    attention: bool = False

    @property
    def weight_only(self) -> bool:
        """Activations stay float (only weights are stored quantized)."""
        return self.activation_type is None

    def to_dict(self) -> dict:
        """JSON-ready description (used in reports)."""
        from onnx import TensorProto

        return {"name": self.name, "description": self.description,
                "activation_type": None if self.activation_type is None
                else TensorProto.DataType.Name(self.activation_type),
                "weight_type": TensorProto.DataType.Name(self.weight_type), "qmax": self.qmax,
                "min_opset": self.min_opset, "blocked": self.blocked}


INT8 = Format("int8", "symmetric int8 Q/DQ, per-tensor activations, per-channel weights",
              ONNX_INT8, ONNX_INT8, 127.0, (-127.0, 127.0), 13,
              ("Conv", "ConvTranspose", "Gemm", "MatMul"))
FP8 = Format("fp8", "FP8 E4M3FN Q/DQ (zero point 0), per-tensor activations, per-channel weights",
             ONNX_FLOAT8E4M3FN, ONNX_FLOAT8E4M3FN, 448.0, (-448.0, 448.0), 19,
             ("Conv", "ConvTranspose", "Gemm", "MatMul"), attention=True)
INT4 = Format("int4", "int4 weight-only: blockwise DequantizeLinear on constant MatMul/Gemm weights",
              None, ONNX_INT4, 7.0, (-8.0, 7.0), 21, ("Gemm", "MatMul"), blocked=True)

#: Formats by ``precision`` name.
FORMATS: Mapping[str, Format] = MappingProxyType({f.name: f for f in (INT8, FP8, INT4)})
#: The ``precision`` values, default first.
PRECISIONS = tuple(FORMATS)
#: Block sizes TensorRT documents for INT4 block quantization; others are accepted with a warning.
TENSORRT_BLOCK_SIZES = (64, 128)
DEFAULT_BLOCK_SIZE = 128
#: How INT4 weights are rounded (``int4_method``): round to nearest with each block's max; AWQ's
#: activation-aware scales and clipping (`onnx_qat.formats.awq`); AWQ then GPTQ's error-compensating
#: rounding (`onnx_qat.formats.gptq`). The last two need calibration data.
INT4_METHODS = ("rtn", "awq", "gptq")
#: How FP8 weights are rounded (``fp8_method``): round to nearest on each output channel's E4M3 grid,
#: or GPTQ's error-compensating rounding on that grid (`onnx_qat.formats.gptq`, needs calibration data).
FP8_METHODS = ("rtn", "gptq")


#: The node metadata key (``NodeProto.metadata_props``) a float-parts conversion writes on every node it
#: keeps FP32 on purpose, with the reason as value (`onnx_qat.formats.float_parts`); the precision map and
#: check rule C15 read it.
KEEP_FP32_KEY = "onnx_qat.keep_fp32"


#: The model metadata key (``ModelProto.metadata_props``) saying the type of the float parts: ``fp16`` or
#: ``bf16`` (written by the float-parts conversion), ``fp32`` (written by ``quantize`` with
#: ``float_dtype="fp32"``: FP32 on purpose, for weakly typed TensorRT builds that pick FP16 themselves).
#: Check rule C15 reads it.
FLOAT_DTYPE_KEY = "onnx_qat.float_dtype"


def float_dtype_of(model) -> Optional[str]:
    """The float parts' type ``model`` (a ModelProto) records under `FLOAT_DTYPE_KEY`, or None."""
    for entry in getattr(model, "metadata_props", ()):
        if entry.key == FLOAT_DTYPE_KEY:
            return entry.value
    return None


def kept_fp32_reason(node) -> Optional[str]:
    """The reason a float-parts conversion kept ``node`` (a NodeProto) FP32, or None when it did not."""
    for entry in getattr(node, "metadata_props", ()):
        if entry.key == KEEP_FP32_KEY:
            return entry.value
    return None


def get_format(precision) -> Format:
    """The `Format` named ``precision`` (a Format passes through; None is int8)."""
    if isinstance(precision, Format):
        return precision
    if precision is None:
        return INT8
    found = FORMATS.get(precision)
    if found is None:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    return found


__all__ = ["Format", "FORMATS", "PRECISIONS", "INT8", "FP8", "INT4", "get_format", "FLOAT_DTYPE_KEY",
           "float_dtype_of",
           "DEFAULT_BLOCK_SIZE", "TENSORRT_BLOCK_SIZES", "INT4_METHODS", "KEEP_FP32_KEY",
           "kept_fp32_reason"]
