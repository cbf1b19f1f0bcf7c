"""``quantize_model``, ``QuantizationSpec`` and ``LayerConfig`` as ``tensorflow_quantization.quantize``
has them.

* [`QuantizationSpec`][tf_bridge.spec.QuantizationSpec] is tf_bridge's spec, which has the toolkit's
  ``.layers``: the mutable list of entries (the same list as ``.entries`` reads), so cases written for the
  toolkit that do ``spec.layers.extend(other.layers)`` keep working.
* `LayerConfig` is tf_bridge's `SpecEntry` (same fields:
  ``name``, ``is_keras_class``, ``quantize_input``, ``quantize_weight``, ``quantization_index``).
* [`quantize_model`][tf_bridge.compat.quantize.quantize_model] behaves as the toolkit's where a spec entry
  names no layer of the
  model: it warns and goes on (``unknown_names="warn"``, the default here); ``"raise"`` gives
  tf_bridge's own behaviour ([`tf_bridge.quantize_model`][] raises a ``ConfigError`` naming
  the closest layer names).
"""
from __future__ import annotations

import difflib
import logging
import warnings
from typing import Optional, Sequence

from onnx_qat.errors import ConfigError

from .. import spec as _spec
from ..case_base import CustomQDQInsertionCase
from ..wrap import quantize_model as _quantize_model

logger = logging.getLogger(__name__)

LayerConfig = _spec.SpecEntry
QuantizationSpec = _spec.QuantizationSpec
UNKNOWN_NAMES = ("warn", "raise")

__all__ = ["quantize_model", "QuantizationSpec", "LayerConfig", "UnknownLayerNameWarning"]


class UnknownLayerNameWarning(UserWarning):
    """A QuantizationSpec entry names no layer of the model; the entry is ignored."""


def _without_unknown_names(model, spec: _spec.QuantizationSpec) -> _spec.QuantizationSpec:
    names = sorted({layer.name for layer in _spec.iter_layers(model)})
    kept = QuantizationSpec()
    for entry in spec.entries:
        if entry.is_keras_class or entry.name in names:
            kept._entries.append(entry)
            continue
        close = difflib.get_close_matches(entry.name, names, n=3, cutoff=0.4)
        warnings.warn(f"tf_bridge.compat.quantize_model: no layer named '{entry.name}' in model "
                      f"'{model.name}'; the entry is ignored (closest: {', '.join(close) or 'none'})",
                      UnknownLayerNameWarning, stacklevel=3)
    return kept


def quantize_model(model, quantization_mode: str = "full",
                   quantization_spec: Optional[_spec.QuantizationSpec] = None,
                   custom_qdq_cases: Optional[Sequence[CustomQDQInsertionCase]] = None,
                   *, unknown_names: str = "warn", activation_range: str = "ema", ema_momentum: float = 0.99):
    """[`tf_bridge.quantize_model`][] with the toolkit's handling of unknown layer names.

    Args:
        model: a built Functional or Sequential Keras model (not modified).
        quantization_mode: ``"full"`` or ``"partial"``.
        quantization_spec: a [`QuantizationSpec`][tf_bridge.spec.QuantizationSpec]; copied, never modified.
        custom_qdq_cases: a list of [`CustomQDQInsertionCase`][tf_bridge.CustomQDQInsertionCase].
        unknown_names: ``"warn"`` (the toolkit's behaviour: a spec entry naming no layer is
            ignored with an [`UnknownLayerNameWarning`][tf_bridge.compat.quantize.UnknownLayerNameWarning]) or
            ``"raise"`` (tf_bridge's: a ``ConfigError`` naming the closest layer names).
        activation_range: as for [`tf_bridge.quantize_model`][].
        ema_momentum: as for [`tf_bridge.quantize_model`][].

    Returns:
        The QAT model (see [`tf_bridge.quantize_model`][]). Layer names are kept (the
        toolkit's ``quant_<name>`` renaming is not done).

    Raises:
        ConfigError: a bad argument; ``"partial"`` mode without a spec or cases.
        ModelError: see [`tf_bridge.quantize_model`][].
    """
    if unknown_names not in UNKNOWN_NAMES:
        raise ConfigError(f"unknown_names must be one of {', '.join(UNKNOWN_NAMES)}, got {unknown_names!r}")
    if quantization_mode == "partial" and quantization_spec is None and not custom_qdq_cases:
        raise ConfigError("quantization_mode='partial' quantizes only the layers a QuantizationSpec or a "
                          "custom case names: give quantization_spec")
    spec = quantization_spec
    if spec is not None and unknown_names == "warn" and isinstance(spec, _spec.QuantizationSpec):
        spec = _without_unknown_names(model, spec)
    return _quantize_model(model, quantization_mode, spec, custom_qdq_cases,
                           activation_range=activation_range, ema_momentum=ema_momentum)
