"""Finite state: find the weights and quantizer ranges of a Keras model that are not finite.

Used at two places. [`check_finite`][tf_bridge.finite.check_finite] stops [`tf_bridge.export_onnx`][] before
any conversion when a weight (kernel, bias, BatchNormalization statistic...) or an activation
quantizer's ``amax`` holds NaN or Inf, with one line naming the first ones; without it the
failure would surface later as an unmappable tensor that names neither the cause nor the layer.
[`tf_bridge.NonFiniteGuard`][] uses [`nonfinite_weights`][tf_bridge.finite.nonfinite_weights] to name the
layer when training diverges.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import keras
import numpy as np

from onnx_qat.errors import ExportError

_SHOWN = 3


@dataclass(frozen=True)
class NonFinite:
    """One variable holding NaN or Inf: its ``path`` (``layer/name``), the layer that owns it,
    and how many of its ``size`` entries are not finite."""

    path: str
    layer: str
    count: int
    size: int

    def __str__(self):
        return f"'{self.path}' ({self.count} of {self.size} not finite)"


def _owned_variables(model) -> List[Tuple[str, object]]:
    """``(layer name, variable)`` for every variable of ``model``, layers in model order (nested
    models entered), each variable once."""
    from .spec import iter_layers

    seen, out = set(), []
    for layer in iter_layers(model):
        if isinstance(layer, keras.Model):
            continue  # a nested model: its own layers are listed by iter_layers
        for var in layer.weights:
            if id(var) not in seen:
                seen.add(id(var))
                out.append((layer.name, var))
    for var in model.weights:  # anything not owned by a listed layer
        if id(var) not in seen:
            seen.add(id(var))
            out.append((model.name, var))
    return out


def nonfinite_weights(model) -> List[NonFinite]:
    """Every variable of ``model`` (weights, BatchNormalization statistics, quantizer ``amax``)
    that holds NaN or Inf, in model order."""
    found = []
    for layer, var in _owned_variables(model):
        value = np.asarray(var.numpy())
        if value.dtype.kind != "f":
            continue
        bad = int(value.size - np.count_nonzero(np.isfinite(value)))
        if bad:
            found.append(NonFinite(str(getattr(var, "path", var.name)), layer, bad, int(value.size)))
    return found


def describe_nonfinite(found: List[NonFinite]) -> str:
    """One line: how many variables are not finite, the first layer, and the first few variables."""
    shown = ", ".join(str(f) for f in found[:_SHOWN])
    more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    return (f"{len(found)} variable(s) hold NaN or Inf, first in layer '{found[0].layer}': "
            f"{shown}{more}")


def check_finite(q_model, where: str = "export_onnx") -> None:
    """Raise [`onnx_qat.errors.ExportError`][] (one line naming the first layer and variables)
    if any weight or quantizer range of ``q_model`` is NaN or Inf.

    Args:
        q_model: a Keras model (a QAT model from [`tf_bridge.quantize_model`][]).
        where: the caller's name, the start of the message.
    """
    found = nonfinite_weights(q_model)
    if found:
        raise ExportError(f"{where}: model '{q_model.name}' cannot be exported: {describe_nonfinite(found)}; "
                          "training diverged (see docs/qat-numerics.md): retrain from the float model "
                          "with a smaller learning rate")
