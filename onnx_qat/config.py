"""QuantizeConfig: every placement/target option in one frozen, validated object.

Each field is also a keyword of :func:`onnx_qat.quantize`, :func:`onnx_qat.calibrate`
and :func:`onnx_qat.place`, and an option of the ``onnx-qat`` CLI.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Tuple

from .errors import ConfigError

#: Deployment forms of the same placement: see ``onnx_qat/targets.py``.
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
        include_attention: also quantize attention-score MatMuls (Q·Kᵀ and scores·V),
            which are skipped by default.
    """

    target: str = "tensorrt"
    exclude_nodes: Tuple[str, ...] = ()
    exclude_op_types: Tuple[str, ...] = ()
    min_channels: int = 0
    include_attention: bool = False
    _patterns: Tuple["re.Pattern", ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ConfigError(f"target must be one of {', '.join(TARGETS)}; got {self.target!r}")
        object.__setattr__(self, "exclude_nodes", _as_str_tuple(self.exclude_nodes, "exclude_nodes"))
        object.__setattr__(self, "exclude_op_types", _as_str_tuple(self.exclude_op_types, "exclude_op_types"))
        if (isinstance(self.min_channels, bool) or not isinstance(self.min_channels, int)
                or self.min_channels < 0):
            raise ConfigError(f"min_channels must be a whole number >= 0, got {self.min_channels!r}")
        if not isinstance(self.include_attention, bool):
            raise ConfigError(f"include_attention must be True or False, got {self.include_attention!r}")
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

    def op_type_excluded(self, op_type: str) -> bool:
        """``op_type`` is one of ``exclude_op_types`` (nodes of that type stay float)."""
        return op_type in self.exclude_op_types

    @classmethod
    def from_options(cls, config: "QuantizeConfig | None" = None, **options) -> "QuantizeConfig":
        """Start from ``config`` (or the defaults) and apply keyword ``options``."""
        base = config or cls()
        unknown = set(options) - {"target", "exclude_nodes", "exclude_op_types", "min_channels",
                                  "include_attention"}
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        values = {k: getattr(base, k) for k in ("target", "exclude_nodes", "exclude_op_types",
                                               "min_channels", "include_attention")}
        values.update({k: v for k, v in options.items() if v is not None})
        return cls(**values)


def normalize_names(names: Iterable[str]) -> Tuple[str, ...]:
    """A sorted tuple without duplicates (for stable output)."""
    return tuple(sorted(set(names)))
