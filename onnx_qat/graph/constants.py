"""What "constant" means, once: an initializer or a ``Constant`` node's value, possibly through ops that
only move, reshape or retype values (`CONSTANT_PASS_OPS`) whose other inputs are constants too.

Placement, insertion, the accuracy tools and the checker all use this meaning: a MatMul whose weight
arrives as ``Transpose(initializer)`` (as some exporters write a Dense layer) has a constant weight
everywhere. Through ``Identity`` the value is the stored one; through the other ops it is *folded*
(computed here with NumPy): the inserter then stores the quantized folded weight and drops the chain
once nothing else reads it, and passes that edit weights in place (AWQ, GPTQ) only take stored ones.

Source: ONNX operator specifications of Identity, Transpose, Reshape, Squeeze, Unsqueeze, Cast and
Flatten (their outputs are functions of their inputs and attributes only).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
from onnx import helper

#: Ops a constant stays constant through (their other inputs constant too).
CONSTANT_PASS_OPS = frozenset({"Identity", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Cast", "Flatten"})
#: How many of them a constant is followed through.
MAX_CONSTANT_HOPS = 8


def _attr(node, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def fold(node, value: np.ndarray, others: Sequence[Optional[np.ndarray]]) -> np.ndarray:
    """The output of ``node`` (a NodeProto of `CONSTANT_PASS_OPS`) for data input ``value`` and
    its other inputs' values ``others`` (None for an absent optional input)."""
    op = node.op_type
    if op == "Identity":
        return value
    if op == "Transpose":
        perm = _attr(node, "perm")
        return np.transpose(value, None if perm is None else list(perm))
    if op == "Reshape":
        shape = [int(d) for d in np.asarray(others[0]).ravel()]
        if not int(_attr(node, "allowzero", 0) or 0):
            shape = [value.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return np.reshape(value, shape)
    if op in ("Squeeze", "Unsqueeze"):
        axes = others[0] if others and others[0] is not None else _attr(node, "axes")
        axes = None if axes is None else [int(a) for a in np.asarray(axes).ravel()]
        if op == "Squeeze":
            return np.squeeze(value, axis=None if axes is None else tuple(axes))
        out = value
        rank = value.ndim + len(axes)
        for axis in sorted(a + rank if a < 0 else a for a in axes):
            out = np.expand_dims(out, axis)
        return out
    if op == "Cast":
        return value.astype(helper.tensor_dtype_to_np_dtype(int(_attr(node, "to"))))
    if op == "Flatten":
        axis = int(_attr(node, "axis", 1))
        axis = axis + value.ndim if axis < 0 else axis
        outer = int(np.prod(value.shape[:axis], dtype=np.int64))
        return np.reshape(value, (outer, -1))
    raise ValueError(f"{op} is not an op a constant passes through")


def fold_chain(chain: Sequence, value: np.ndarray,
               value_of: Callable[[str], Optional[np.ndarray]]) -> np.ndarray:
    """``value`` (the source constant) carried through ``chain`` (NodeProtos, the one nearest the
    source *last*), each node's other inputs read with ``value_of``."""
    for node in reversed(chain):
        others = [value_of(t) if t else None for t in list(node.input)[1:]]
        value = fold(node, value, others)
    return value


__all__ = ["CONSTANT_PASS_OPS", "MAX_CONSTANT_HOPS", "fold", "fold_chain"]
