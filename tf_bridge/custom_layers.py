"""New layer support: declare how a Keras layer class of your own is quantized.

tf_bridge knows the weighted Keras layers (Conv*, DepthwiseConv*, SeparableConv*,
Conv*Transpose, Dense) and the pooling layers. A layer class of your own is declared once,
either with [`register_layer_quantization`][tf_bridge.custom_layers.register_layer_quantization] or, in the
shape users of NVIDIA's ``tensorflow_quantization`` know, by subclassing
[`BaseQuantizeWrapper`][tf_bridge.custom_layers.BaseQuantizeWrapper]::

    class MyDenseQuantizeWrapper(BaseQuantizeWrapper):
        layer_class = MyDense            # or the name "<LayerClass>QuantizeWrapper" alone
        weights = {"w": -1}              # layer attribute -> output-channel axis
        input_indices = None             # None: every input; [0]: the first only
        quantize_by_default = True       # quantized by quantization_mode="full"

The declaration is honoured everywhere a built-in class is:

* [`tf_bridge.quantize_model`][] quantizes the layer's inputs (an
  [`ActivationQuantizer`][tf_bridge.ActivationQuantizer] each) and wraps it in
  [`QuantizeWrapper`][tf_bridge.QuantizeWrapper], which fake-quantizes the declared weights per output
  channel (narrow int8 range) on every call;
* [`tf_bridge.calibrate`][tf_bridge.calibrate.calibrate] sets its input ranges like any other;
* [`tf_bridge.describe`][tf_bridge.describe.describe] / [`tf_bridge.quantizer_records`][] list its weights
  with their channel axes;
* [`tf_bridge.export_onnx`][] maps them onto the ONNX graph: the first declared weight is
  the one whose ONNX node (Conv, MatMul, Gemm) reads the quantized input; each weight is
  matched by its values once its output-channel axis is moved last (the Dense/Conv kernel
  layout), so a weight used transposed by the layer maps too.

The registry is process-wide, like Keras's serialization registry: declare the class before
quantizing or loading a model that uses it. The layer class must be Keras-serializable
(``get_config``) and built from Keras ops so tf2onnx can convert it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

from onnx_qat.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerQuantization:
    """How one layer class is quantized.

    Attributes:
        class_name: the layer class name (``type(layer).__name__``).
        layer_class: the class itself, or None when declared by name only.
        weights: ``((attribute, output-channel axes), ...)``; the first one's ONNX node reads
            the quantized input.
        inputs: input positions quantized by default (None: all of them).
        default: quantized by ``quantization_mode="full"`` without a spec entry.
    """

    class_name: str
    layer_class: Optional[type]
    weights: Tuple[Tuple[str, Tuple[int, ...]], ...]
    inputs: Optional[Tuple[int, ...]]
    default: bool

    @property
    def input_weight(self) -> Optional[str]:
        """The attribute of the weight whose ONNX node reads the quantized input."""
        return self.weights[0][0] if self.weights else None


_REGISTRY: Dict[str, LayerQuantization] = {}


def _axes(attr: str, axis) -> Tuple[int, ...]:
    items = (axis,) if isinstance(axis, int) else tuple(axis) if isinstance(axis, (list, tuple)) else None
    if not items or not all(isinstance(a, int) and not isinstance(a, bool) for a in items):
        raise ConfigError(f"register_layer_quantization: weight '{attr}' needs an int axis (or a list of "
                          f"them) naming its output channels, got {axis!r}")
    return items


def register_layer_quantization(layer_class: Union[type, str], *,
                                weights: Optional[Mapping[str, Union[int, Sequence[int]]]] = None,
                                inputs: Optional[Sequence[int]] = None,
                                default: bool = True) -> LayerQuantization:
    """Declare how instances of ``layer_class`` are quantized (replaces an earlier declaration).

    Args:
        layer_class: the Keras layer class, or its class name.
        weights: ``{attribute: output-channel axis}`` of the weights to quantize per channel
            (the attribute holds the ``keras.Variable`` the layer's ``call`` reads, e.g.
            ``{"kernel": -1}``); empty or None for a layer whose inputs only are quantized.
            The first one is the weight whose ONNX node reads the quantized input.
        inputs: positions of the input tensors quantized by default; None quantizes all.
        default: quantize the class in ``quantization_mode="full"`` without a spec entry
            (False: only layers named by a spec entry or a case).

    Returns:
        The [`LayerQuantization`][tf_bridge.custom_layers.LayerQuantization] recorded.

    Raises:
        ConfigError: a bad class, weight axis, input index or flag.
    """
    if isinstance(layer_class, str) and layer_class:
        name, cls = layer_class, None
    elif isinstance(layer_class, type):
        name, cls = layer_class.__name__, layer_class
    else:
        raise ConfigError(f"register_layer_quantization: layer_class must be a class or a class name, "
                          f"got {layer_class!r}")
    weights = dict(weights or {})
    if not all(isinstance(a, str) and a for a in weights):
        raise ConfigError("register_layer_quantization: weight attributes must be names, "
                          f"got {list(weights)!r}")
    if inputs is not None:
        inputs = tuple(inputs)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in inputs):
            raise ConfigError(f"register_layer_quantization: inputs must be None or ints >= 0, "
                              f"got {inputs!r}")
    if not isinstance(default, bool):
        raise ConfigError(f"register_layer_quantization: default must be True or False, got {default!r}")
    rules = tuple((a, _axes(a, ax)) for a, ax in weights.items())
    entry = LayerQuantization(name, cls, rules, inputs, default)
    if name in _REGISTRY and _REGISTRY[name] != entry:
        logger.info("tf_bridge: the quantization of layer class %s is declared again", name)
    _REGISTRY[name] = entry
    return entry


def unregister_layer_quantization(layer_class: Union[type, str]) -> None:
    """Forget the declaration of ``layer_class`` (a class or a class name); no error if none."""
    name = layer_class if isinstance(layer_class, str) else getattr(layer_class, "__name__", "")
    _REGISTRY.pop(name, None)


def registered_quantization(layer) -> Optional[LayerQuantization]:
    """The declaration that applies to ``layer`` (its exact class, by class or by name), or None."""
    entry = _REGISTRY.get(type(layer).__name__)
    if entry is None or (entry.layer_class is not None and type(layer) is not entry.layer_class):
        return None
    return entry


def registered_layer_classes() -> Tuple[str, ...]:
    """The class names declared so far."""
    return tuple(sorted(_REGISTRY))


class BaseQuantizeWrapper:
    """New layer support in the shape of ``tensorflow_quantization.BaseQuantizeWrapper``.

    Subclassing registers the declaration
    ([`register_layer_quantization`][tf_bridge.custom_layers.register_layer_quantization]); nothing else is
    needed, and no ``call`` is written: tf_bridge's own [`QuantizeWrapper`][tf_bridge.QuantizeWrapper] and
    [`ActivationQuantizer`][tf_bridge.ActivationQuantizer] apply it.

    Class attributes:
        layer_class: the layer class; when None, a subclass named
            ``"<LayerClass>QuantizeWrapper"`` (the toolkit's convention) declares the class of
            that name, and a subclass named otherwise declares nothing (an intermediate base
            class sharing attributes with its subclasses).
        weights: ``{attribute: output-channel axis}`` (see
            [`register_layer_quantization`][tf_bridge.custom_layers.register_layer_quantization]).
        input_indices: input positions quantized by default (None: all).
        quantize_by_default: quantized by ``quantization_mode="full"``.
    """

    layer_class: Optional[type] = None
    weights: Mapping[str, Union[int, Sequence[int]]] = {}
    input_indices: Optional[Sequence[int]] = None
    quantize_by_default: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        target = cls.layer_class
        suffix = "QuantizeWrapper"
        if target is None:
            if not cls.__name__.endswith(suffix) or cls.__name__ == suffix:
                logger.debug("tf_bridge: %s declares no layer class (a shared base class)", cls.__name__)
                return
            target = cls.__name__[:-len(suffix)]
        cls.declaration = register_layer_quantization(
            target, weights=cls.weights, inputs=cls.input_indices, default=cls.quantize_by_default)

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a declaration, not a layer: tf_bridge.quantize_model "
                        "applies it; pass the float model to quantize_model")
