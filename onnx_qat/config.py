"""QuantizeConfig: every placement/target option in one frozen, validated object.

Each field is also a keyword of [`onnx_qat.quantize`][onnx_qat.quantize.quantize],
[`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate] and
[`onnx_qat.place`][onnx_qat.placement.policy.place], and an option of the ``onnx-qat`` CLI.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Tuple

from .errors import ConfigError
from .formats.numeric import (DEFAULT_BLOCK_SIZE, FP8_METHODS, INT4_METHODS, PRECISIONS, TENSORRT_BLOCK_SIZES,
                      get_format)

#: Types of the float parts (see `onnx_qat.formats.float_parts`; kept here so that this module
#: stays free of onnx).
FLOAT_DTYPES = ("fp32", "fp16", "bf16")
#: Deployment forms of the same placement: see ``onnx_qat/insertion/targets.py``.
#: The deployment targets by name, the default first (``onnx_qat.insertion.targets`` holds their facts).
TARGETS = ("tensorrt", "ort-cpu")


def _as_str_tuple(value, name: str) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be a list of strings, got {type(value).__name__}") from None
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{name} must hold non-empty strings, got {item!r}")
    return items


@dataclass(frozen=True)
class QuantizeConfig:
    """Options that decide where Q/DQ goes and in which deployment form.

    Attributes:
        target: ``"tensorrt"`` (explicit-quantization Q/DQ as TensorRT wants it) or
            ``"ort-cpu"`` (the same scales in the form onnxruntime's CPU integer kernels run fast).
        exclude_nodes: regular expressions; a node whose name matches one (``re.fullmatch``)
            is left in float.
        exclude_op_types: ONNX op types left in float (e.g. ``("MatMul",)``).
        min_channels: weighted ops (Conv, ConvTranspose, Gemm, MatMul) with fewer input or
            output channels than this are left in float (0 quantizes all).
        include_attention: also quantize attention-score MatMuls (Q·Kᵀ and scores·V, so also
            the Softmax output feeding scores·V). None (the default) takes the precision's
            choice: skipped for ``int8``, quantized for ``fp8`` (TensorRT's fused FP8 attention
            wants them); ``False`` keeps them float whatever the precision.
        precision: ``"int8"`` (default), ``"fp8"`` (E4M3FN Q/DQ) or ``"int4"`` (weight-only,
            blockwise); see `onnx_qat.formats.numeric`.
        block_size: values per INT4 weight scale along the reduction axis (``precision="int4"``;
            TensorRT documents 64 and 128). A weight whose reduction dimension it does not
            divide stays float.
        int4_method: how INT4 weights are rounded (``precision="int4"``): ``"rtn"`` (round to
            nearest), ``"awq"`` (activation-aware scales and clipping, `onnx_qat.formats.awq`) or
            ``"gptq"`` (AWQ's scales, then error-compensating rounding, `onnx_qat.formats.gptq`); the
            last two need calibration data. None (the default): ``awq`` with data, ``rtn`` without.
        fp8_method: how FP8 weights of MatMul/Gemm are rounded (``precision="fp8"``): ``"rtn"``
            (round to nearest, the default when None) or ``"gptq"`` (error-compensating rounding on
            each output channel's E4M3 grid, driven by the calibration data,
            `onnx_qat.formats.gptq.apply_gptq_fp8`; needs data).
        float_dtype: the type of everything Q/DQ leaves in float: ``"fp32"`` (default), ``"fp16"``
            or ``"bf16"`` ([`onnx_qat.formats.float_parts.cast_float_parts`][]; target ``tensorrt``
            only).
    """

    target: str = "tensorrt"
    exclude_nodes: Tuple[str, ...] = ()
    exclude_op_types: Tuple[str, ...] = ()
    min_channels: int = 0
    include_attention: Optional[bool] = None
    precision: str = "int8"
    block_size: int = DEFAULT_BLOCK_SIZE
    int4_method: Optional[str] = None
    fp8_method: Optional[str] = None
    float_dtype: str = "fp32"
    _patterns: Tuple["re.Pattern", ...] = field(default=(), init=False, repr=False, compare=False)
    _attention_given: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ConfigError(f"target must be one of {', '.join(TARGETS)}; got {self.target!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.precision != "int8" and self.target != "tensorrt":
            raise ConfigError(f"precision {self.precision!r} is a TensorRT form; target {self.target!r} "
                              "takes only int8")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"block_size must be a whole number >= 2, got {self.block_size!r}")
        if self.block_size not in TENSORRT_BLOCK_SIZES and self.precision == "int4":
            import logging

            logging.getLogger(__name__).warning(
                "block_size %d: TensorRT documents INT4 block sizes %s", self.block_size,
                ", ".join(map(str, TENSORRT_BLOCK_SIZES)))
        for name, methods, precision in (("int4_method", INT4_METHODS, "int4"),
                                         ("fp8_method", FP8_METHODS, "fp8")):
            value = getattr(self, name)
            if value is None:
                continue
            if value not in methods:
                raise ConfigError(f"{name} must be one of {', '.join(methods)}; got {value!r}")
            if self.precision != precision:
                raise ConfigError(f"{name} applies to precision {precision}, not {self.precision}")
        if self.float_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"float_dtype must be one of {', '.join(FLOAT_DTYPES)}; "
                              f"got {self.float_dtype!r}")
        if self.float_dtype != "fp32" and self.target != "tensorrt":
            raise ConfigError(f"float_dtype {self.float_dtype!r} is a TensorRT form; target {self.target!r} "
                              "keeps FP32 float parts (onnxruntime's CPU kernels are FP32)")
        object.__setattr__(self, "exclude_nodes", _as_str_tuple(self.exclude_nodes, "exclude_nodes"))
        object.__setattr__(self, "exclude_op_types", _as_str_tuple(self.exclude_op_types, "exclude_op_types"))
        if (isinstance(self.min_channels, bool) or not isinstance(self.min_channels, int)
                or self.min_channels < 0):
            raise ConfigError(f"min_channels must be a whole number >= 0, got {self.min_channels!r}")
        if self.include_attention is not None and not isinstance(self.include_attention, bool):
            raise ConfigError(f"include_attention must be True or False, got {self.include_attention!r}")
        object.__setattr__(self, "_attention_given", self.include_attention is not None)
        if self.include_attention is None:  # the precision's choice
            object.__setattr__(self, "include_attention", get_format(self.precision).attention)
        patterns = []
        for pattern in self.exclude_nodes:
            try:
                patterns.append(re.compile(pattern))
            except re.error as exc:
                raise ConfigError(
                    f"exclude_nodes: {pattern!r} is not a valid regular expression ({exc})") from None
        object.__setattr__(self, "_patterns", tuple(patterns))

    def node_excluded(self, name: str) -> bool:
        """True when ``name`` fully matches one of ``exclude_nodes``."""
        return any(p.fullmatch(name or "") for p in self._patterns)

    def rounding(self, has_data: bool) -> str:
        """The INT4 rounding that runs: ``int4_method``, or its default (``awq`` with data, ``rtn``
        without)."""
        return self.int4_method or ("awq" if has_data else "rtn")

    def op_type_excluded(self, op_type: str) -> bool:
        """``op_type`` is one of ``exclude_op_types`` (nodes of that type stay float)."""
        return op_type in self.exclude_op_types

    @classmethod
    def from_options(cls, config: "QuantizeConfig | None" = None, **options) -> "QuantizeConfig":
        """Start from ``config`` (or the defaults) and apply keyword ``options``."""
        base = config or cls()
        unknown = set(options) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        values = {k: getattr(base, k) for k in _FIELDS}
        if not base._attention_given:  # the default follows the precision given now
            values["include_attention"] = None
        values.update({k: v for k, v in options.items() if v is not None})
        return cls(**values)


_FIELDS = ("target", "exclude_nodes", "exclude_op_types", "min_channels", "include_attention", "precision",
           "block_size", "int4_method", "fp8_method", "float_dtype")


def normalize_names(names: Iterable[str]) -> Tuple[str, ...]:
    """A sorted tuple without duplicates (for stable output)."""
    return tuple(sorted(set(names)))
