"""QuantizationSpec: which layers to quantize, and how (names users know from
NVIDIA's ``tensorflow_quantization``).

A spec is a list of entries, each naming a layer (``layer.name``) or a Keras
layer class (``type(layer).__name__`` with ``is_keras_class=True``), and saying
whether to quantize the layer's inputs, its weights, and which inputs
(``quantization_index``: positions among the layer's input tensors, e.g. ``[1]``
for the second input of an ``Add``; ``None`` means all inputs).

`resolve_plan` turns the default policy, the cases' specs and the user's
spec into one `LayerDecision` per layer, with this precedence (first wins):
user name entry, case name entry, user class entry, case class entry, default
policy (``"full"`` mode only). Among entries of one spec, the last added wins.
"""
from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import keras

from onnx_qat.errors import ConfigError

from .custom_layers import registered_quantization
from .quantizers import weight_rules_for

logger = logging.getLogger(__name__)

# TensorRT policy: quantize inputs and weights of weighted layers; inputs of
# non-commuting pooling layers. Everything else is off unless a spec asks.
DEFAULT_INPUT_AND_WEIGHT = (
    "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D",
    "SeparableConv2D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose", "Dense",
)
DEFAULT_INPUT_ONLY = (
    "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
)
MODES = ("full", "partial")


@dataclass(frozen=True)
class SpecEntry:
    """One entry of a [`QuantizationSpec`][tf_bridge.spec.QuantizationSpec]."""

    name: str
    is_keras_class: bool = False
    quantize_input: bool = True
    quantize_weight: bool = True
    quantization_index: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if isinstance(self.quantization_index, list):  # entries built by hand (LayerConfig(...))
            object.__setattr__(self, "quantization_index", tuple(self.quantization_index))


@dataclass(frozen=True)
class LayerDecision:
    """What happens to one layer: ``inputs`` None = all inputs, () = none; ``reason`` for logs."""

    inputs: Optional[Tuple[int, ...]]
    weights: bool
    reason: str

    @property
    def quantizes_inputs(self) -> bool:
        """True if at least one input is quantized."""
        return self.inputs is None or len(self.inputs) > 0


def _as_list(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"QuantizationSpec.add: {what} has {len(value)} items but name has {n}")
        return list(value)
    return [value] * n


def _index_tuple(value, what: str) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    if isinstance(items, bool) or not isinstance(items, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ConfigError(f"QuantizationSpec.add: {what} must be None, an int >= 0 or a list of them,"
                          f" got {value!r}")
    return tuple(items)


def _check_bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"QuantizationSpec.add: {what} must be True or False, got {value!r}")
    return value


class QuantizationSpec:
    """An ordered list of per-layer or per-class quantization entries.

    Build it with [`add`][tf_bridge.spec.QuantizationSpec.add]; pass it to [`tf_bridge.quantize_model`][],
    which copies it (the caller's spec is never modified).
    """

    def __init__(self):
        self._entries: List[SpecEntry] = []

    def add(self, name, is_keras_class=False, quantize_input=True, quantize_weight=True,
            quantization_index=None) -> "QuantizationSpec":
        """Add entries; ``name`` is a string or a list, the other arguments scalars or
        lists of the same length. With a list of names, ``quantization_index`` is
        one item (None, int or list of ints) per name. Returns ``self``."""
        names = [name] if isinstance(name, str) else name
        if not isinstance(names, (list, tuple)) or not names or not all(
                isinstance(n, str) and n for n in names):
            raise ConfigError("QuantizationSpec.add: name must be a non-empty string or list of strings,"
                              f" got {name!r}")
        n = len(names)
        classes = _as_list(is_keras_class, n, "is_keras_class")
        inputs = _as_list(quantize_input, n, "quantize_input")
        weights = _as_list(quantize_weight, n, "quantize_weight")
        if isinstance(name, str):
            indices = [quantization_index]
        else:
            indices = ([None] * n if quantization_index is None
                       else _as_list(quantization_index, n, "quantization_index"))
        for i, nm in enumerate(names):
            self._entries.append(SpecEntry(
                name=nm, is_keras_class=_check_bool(classes[i], "is_keras_class"),
                quantize_input=_check_bool(inputs[i], "quantize_input"),
                quantize_weight=_check_bool(weights[i], "quantize_weight"),
                quantization_index=_index_tuple(indices[i], "quantization_index")))
        return self

    @property
    def entries(self) -> Tuple[SpecEntry, ...]:
        """The entries in the order they were added."""
        return tuple(self._entries)

    @property
    def layers(self) -> List[SpecEntry]:
        """The entries as the mutable list NVIDIA's toolkit names ``layers`` (the list
        [`entries`][tf_bridge.spec.QuantizationSpec.entries] reads), so a case written for the toolkit can
        ``spec.layers.extend(other.layers)``; the names of entries put in by hand are checked when the spec is
        used, as [`add`][tf_bridge.spec.QuantizationSpec.add]'s are."""
        return self._entries

    def copy(self) -> "QuantizationSpec":
        """An independent copy."""
        new = QuantizationSpec()
        new._entries = list(self._entries)
        return new

    def __len__(self):
        return len(self._entries)

    def __iter__(self) -> Iterator[SpecEntry]:
        return iter(tuple(self._entries))

    def __repr__(self):
        return f"QuantizationSpec({list(self._entries)!r})"


def iter_layers(model) -> Iterator[keras.layers.Layer]:
    """Every layer of ``model``, depth first, including layers of nested models (and the nested models)."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from iter_layers(layer)


def _entry_decision(entry: SpecEntry, layer, source: str) -> LayerDecision:
    inputs = (entry.quantization_index if entry.quantization_index is not None else None) \
        if entry.quantize_input else ()
    weights = entry.quantize_weight and bool(weight_rules_for(layer))
    unsupported = entry.quantize_weight and not weights and layer.trainable_weights
    if unsupported and not isinstance(layer, keras.Model):
        logger.warning("tf_bridge: layer '%s' (%s) has weights tf_bridge cannot quantize; "
                       "only its inputs follow the spec", layer.name, type(layer).__name__)
    kind = "class" if entry.is_keras_class else "name"
    return LayerDecision(inputs=inputs, weights=weights, reason=f"{source} {kind} entry '{entry.name}'")


def default_decision(layer) -> Optional[LayerDecision]:
    """The default (``"full"`` mode) decision for ``layer``, or None if it is left alone."""
    cls = type(layer).__name__
    declared = registered_quantization(layer)
    if declared is not None:
        return LayerDecision(inputs=declared.inputs, weights=bool(declared.weights),
                             reason=f"declared layer class {cls}") if declared.default else None
    if cls in DEFAULT_INPUT_AND_WEIGHT and weight_rules_for(layer):
        return LayerDecision(inputs=None, weights=True, reason=f"default policy: {cls} input and weights")
    if cls in DEFAULT_INPUT_ONLY:
        return LayerDecision(inputs=None, weights=False, reason=f"default policy: {cls} input")
    return None


def _validate_names(spec: QuantizationSpec, layers: Sequence, source: str) -> None:
    names = {layer.name for layer in layers}
    classes = {type(layer).__name__ for layer in layers}
    for entry in spec:
        if entry.is_keras_class:
            if entry.name in classes or hasattr(keras.layers, entry.name):
                continue
            known = sorted(classes | set(DEFAULT_INPUT_AND_WEIGHT))
            close = difflib.get_close_matches(entry.name, known, n=3)
            raise ConfigError(f"{source}: no Keras layer class '{entry.name}' in the model or keras.layers;"
                              f" closest: {', '.join(close) or 'none'}")
        elif entry.name not in names:
            close = difflib.get_close_matches(entry.name, sorted(names), n=3, cutoff=0.4)
            raise ConfigError(f"{source}: no layer named '{entry.name}' in the model;"
                              f" closest: {', '.join(close) or 'none'}")


def _index(spec: QuantizationSpec) -> Tuple[Dict[str, SpecEntry], Dict[str, SpecEntry]]:
    by_name: Dict[str, SpecEntry] = {}
    by_class: Dict[str, SpecEntry] = {}
    for entry in spec:  # last one wins
        (by_class if entry.is_keras_class else by_name)[entry.name] = entry
    return by_name, by_class


def resolve_plan(model, mode: str, user_spec: QuantizationSpec,
                 case_specs: Iterable[QuantizationSpec] = ()) -> Dict[int, LayerDecision]:
    """Map ``id(layer)`` of every layer to quantize (nested models included) to its decision."""
    if mode not in MODES:
        raise ConfigError(f"quantization_mode must be one of {', '.join(MODES)}, got {mode!r}")
    layers = list(iter_layers(model))
    _validate_names(user_spec, layers, "quantization_spec")
    case_spec = QuantizationSpec()
    for spec in case_specs:
        case_spec._entries.extend(spec.entries)
    _validate_names(case_spec, layers, "custom_qdq_cases")
    user_name, user_class = _index(user_spec)
    case_name, case_class = _index(case_spec)
    plan: Dict[int, LayerDecision] = {}
    for layer in layers:
        cls = type(layer).__name__
        decision = None
        for table, key, source in ((user_name, layer.name, "spec"), (case_name, layer.name, "case"),
                                   (user_class, cls, "spec"), (case_class, cls, "case")):
            if key in table:
                decision = _entry_decision(table[key], layer, source)
                break
        if decision is None and mode == "full" and not isinstance(layer, keras.Model):
            decision = default_decision(layer)
        if decision is not None and (decision.quantizes_inputs or decision.weights):
            logger.debug("tf_bridge: %s: inputs=%s weights=%s (%s)", layer.name,
                         "all" if decision.inputs is None else list(decision.inputs),
                         decision.weights, decision.reason)
            plan[id(layer)] = decision
    return plan
