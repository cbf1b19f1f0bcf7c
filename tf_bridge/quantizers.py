"""Keras layers that hold quantizer state and apply [`tf_bridge.fake_quant`][tf_bridge.fake_quant.fake_quant].

* [`ActivationQuantizer`][tf_bridge.quantizers.ActivationQuantizer] sits on one tensor (a layer output or a
  model input) and quantizes it per tensor for every quantized consumer of that tensor.
  Its state is a scalar ``amax`` plus an ``initialized`` flag, both saved with
  the model. It records which layer output it quantizes (``producer``) and which
  layer inputs read it (``consumers``).
* [`QuantizeWrapper`][tf_bridge.quantizers.QuantizeWrapper] wraps a weighted Keras layer (Dense, Conv*, ...)
  and quantizes its kernel(s) per output channel on every call; the wrapped layer
  itself is the unchanged Keras layer with its float weights.

Activation ranges while training (``mode``):

* ``"ema"`` (default): after calibration, every training step updates
  ``amax <- momentum * amax + (1 - momentum) * batch_max`` and quantizes with
  the updated value; inference uses the stored value.
* ``"fixed"``: the calibrated ``amax`` is never changed by training.
* ``"learnable"``: ``amax`` is a trainable weight (gradient of the LSQ form,
  see [`tf_bridge.fake_quant`][tf_bridge.fake_quant.fake_quant]), initialised by calibration.

A quantizer that has no range yet warns once. In training it takes the first
batch's max as its range; in inference it passes values through unquantized.

Degenerate ranges are re-seeded (all modes). At every training step, before the
mode's update, the quantizer measures the share of the batch's nonzero values that
lie beyond ``RESEED_RATIO`` (4) times its stored ``amax``. Above
``reseed_clip_fraction`` (default 0.25) the range is degenerate for training: it
is replaced by the batch max, exactly as if it had never been set, and the mode's
rule goes on from there (so the stored ``amax``, which export writes to the
ScaleTable, is the range training used). ``initialized`` is set to 2 so that
[`tf_bridge.NonFiniteGuard`][] can name the quantizer.

Why: ranges calibrated on an untrained network (BatchNormalization still at its
initial statistics) can be 1e2-1e6 times smaller than the same tensors in training
mode. Such a range clips almost every value: the forward signal shrinks to about
``amax`` while the straight-through gradient passes unshrunk, and the next
BatchNormalization (batch statistics) scales both back up, so the gradient grows by
roughly ``sqrt(std(x) / amax)`` per quantized layer. At the stem of EfficientNetB0
(96 px, inputs x255) it reached 5e19 (float: 3.7), overflowing Adam's second moment
(g^2 > 3.4e38) so that the weights became NaN on the second step. Measured on a
first training batch, the share of nonzero values beyond 4x the stored range was 0
for every range of a float-trained test network (``max`` and ``percentile``
calibration, 70 quantizer-batches each) and a median of 80-100% for the calibrated
ranges of untrained EfficientNetB0, MobileNetV2 and InceptionV3 (standard-normal
inputs): a wide margin on both sides, and a percentile range that clips a far tail
on purpose is kept. Re-seeding was
chosen over a floor ``amax >= batch_max / k``: a floor keeps clipping up to ``k`` and
the gain compounds over depth (first-step max gradient of a 20-layer Conv-BN-swish
network: float 0.21, floor k=4 0.20, k=16 0.44, k=64 419, re-seeding 0.21), and a
floor tight enough to be safe would override healthy percentile ranges; a re-seeded
range starts where an uncalibrated quantizer starts, which trains as the float model
does. Set ``reseed_clip_fraction=1.0`` to switch re-seeding off.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from .fake_quant import fake_quant, is_forward_only, per_channel_amax, per_channel_amax_numpy

logger = logging.getLogger(__name__)

MODES = ("ema", "fixed", "learnable")
RESEED_CLIP_FRACTION = 0.25
RESEED_RATIO = 4.0
# ``initialized`` values: no range yet, range set (calibration, set_amax, training), range re-seeded by
# training because it was degenerate (see the module docstring).
UNSET, SET, RESEEDED = 0.0, 1.0, 2.0


class UncalibratedQuantizerWarning(UserWarning):
    """An activation quantizer was used before it had a range (call
    [`tf_bridge.calibrate`][tf_bridge.calibrate.calibrate])."""


def _global_max(value: tf.Tensor) -> tf.Tensor:
    """Max of a scalar over all replicas in sync (identity outside ``tf.distribute``)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return value
    gathered = ctx.all_gather(tf.reshape(value, [1]), axis=0)
    return tf.reduce_max(gathered)


def _global_sum(value: tf.Tensor) -> tf.Tensor:
    """Sum of a scalar over all replicas in sync (identity outside ``tf.distribute``)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return value
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)


def clipped_fraction(x: tf.Tensor, amax: tf.Tensor) -> tf.Tensor:
    """Share of the nonzero entries of ``x`` with ``|x| > amax`` (0 when ``x`` is all zeros),
    summed over all replicas."""
    a = tf.abs(tf.cast(x, tf.float32))
    clipped = _global_sum(tf.reduce_sum(tf.cast(a > amax, tf.float32)))
    nonzero = _global_sum(tf.reduce_sum(tf.cast(a > 0, tf.float32)))
    return clipped / tf.maximum(nonzero, 1.0)


@keras.saving.register_keras_serializable(package="tf_bridge")
class ActivationQuantizer(keras.layers.Layer):
    """Per-tensor symmetric INT8 fake quantization of one activation tensor.

    Args:
        mode: ``"ema"``, ``"fixed"`` or ``"learnable"`` (see the module docstring).
        momentum: EMA momentum in [0, 1) for ``mode="ema"``.
        producer: name of the layer (or model input) whose output is quantized.
        producer_index: which output of ``producer``.
        consumers: ``[layer_name, input_index]`` pairs that read the quantized tensor.
        covers_inputs_of: name of a Concatenate whose output this quantizer sits on and
            whose inputs all share its scale (TensorRT rule 7); empty otherwise.
        reseed_clip_fraction: in (0, 1]; a training batch with a larger share of its nonzero
            values beyond ``RESEED_RATIO`` times the stored range re-seeds the range from that
            batch's max (see the module docstring). 1.0 switches re-seeding off.
    """

    def __init__(self, mode: str = "ema", momentum: float = 0.99, producer: str = "",
                 producer_index: int = 0, consumers: Sequence[Sequence] = (), covers_inputs_of: str = "",
                 reseed_clip_fraction: float = RESEED_CLIP_FRACTION, **kwargs):
        super().__init__(**kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not 0.0 < float(reseed_clip_fraction) <= 1.0:
            raise ValueError(f"reseed_clip_fraction must be in (0, 1], got {reseed_clip_fraction!r}")
        self.reseed_clip_fraction = float(reseed_clip_fraction)
        self.mode = mode
        self.momentum = float(momentum)
        self.producer = str(producer)
        self.producer_index = int(producer_index)
        self.consumers = [[str(n), int(i)] for n, i in consumers]
        self.covers_inputs_of = str(covers_inputs_of)
        self.supports_masking = True
        self._collector = None
        self._warned = False
        #: the wrapped layer whose internal tensor this quantizer sits on (a SeparableConv's
        #: depthwise output, see [`QuantizeWrapper`][tf_bridge.quantizers.QuantizeWrapper]); "" for a
        #: quantizer between layers.
        self.inside = ""

    def build(self, input_shape=None):
        """Create ``amax`` (trainable in ``learnable`` mode) and the ``initialized`` flag."""
        trainable = self.mode == "learnable"
        self.amax = self.add_weight(
            shape=(), initializer="zeros", trainable=trainable, name="amax",
            aggregation="mean" if trainable else "only_first_replica")
        self.initialized = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="initialized",
            aggregation="only_first_replica")

    def call(self, inputs, training=None):
        """Fake-quantize ``inputs`` with ``amax`` (pass them through while calibrating or before the
        range is known); in training, first update ``amax`` as the mode says."""
        x = tf.convert_to_tensor(inputs)
        if self._collector is not None and tf.executing_eagerly():
            self._collector.update(x)
            return x
        self._warn_if_uncalibrated(bool(training))
        if training:
            return self._train_call(x)
        if is_forward_only():  # a graph evaluated with these ranges only (see forward_only)
            with tf.init_scope():
                ready = float(self.initialized.numpy()) > 0
            return fake_quant(x, self.amax, narrow_range=False) if ready else x
        ready = self.initialized > 0
        y = fake_quant(x, self.amax, narrow_range=False)
        return tf.where(ready, y, x)

    def _train_call(self, x):
        batch_max = tf.stop_gradient(_global_max(tf.reduce_max(tf.abs(tf.cast(x, tf.float32)))))
        state = tf.convert_to_tensor(self.initialized)
        ready = state > UNSET
        amax = tf.convert_to_tensor(self.amax)
        if self.reseed_clip_fraction < 1.0:
            degenerate = tf.logical_and(
                ready, tf.stop_gradient(clipped_fraction(x, RESEED_RATIO * amax)) > self.reseed_clip_fraction)
            ready = tf.logical_and(ready, tf.logical_not(degenerate))
            state = tf.where(degenerate, RESEEDED, tf.maximum(state, SET))
        else:
            state = tf.maximum(state, SET)
        if self.mode == "ema":
            m = self.momentum
            new = tf.stop_gradient(tf.where(ready, m * amax + (1.0 - m) * batch_max, batch_max))
            self.amax.assign(new)
            used = new
        else:
            used = tf.where(ready, amax, batch_max)
            if self.mode == "fixed":
                used = tf.stop_gradient(used)
            self.amax.assign(tf.stop_gradient(used))
        self.initialized.assign(state)
        return fake_quant(x, used, narrow_range=False)

    def _warn_if_uncalibrated(self, training: bool) -> None:
        if self._warned:
            return
        try:
            with tf.init_scope():
                ready = float(self.initialized.numpy()) > 0
        except Exception:  # pragma: no cover - reading state is best effort
            return
        if ready:
            return
        self._warned = True
        what = ("their ranges are taken from the first training batch" if training
                else "their inputs pass through unquantized")
        logger.debug("tf_bridge: activation quantizer '%s' has no range yet", self.name)
        # One message text per situation, so Python shows it once, not once per quantizer.
        warnings.warn(f"tf_bridge: activation quantizers without a range (see tf_bridge.describe) are in "
                      f"use, so {what}; call tf_bridge.calibrate(q_model, data) first",
                      UncalibratedQuantizerWarning, stacklevel=2)

    def compute_output_shape(self, input_shape):
        """The input shape (fake quantization keeps it)."""
        return input_shape

    def compute_mask(self, inputs, mask=None):
        """The input mask, passed on unchanged."""
        return mask

    @property
    def calibrated(self) -> bool:
        """True once a range is set (by calibration,
        [`set_amax`][tf_bridge.quantizers.ActivationQuantizer.set_amax] or training)."""
        return float(self.initialized.numpy()) > 0

    def amax_value(self) -> Optional[np.ndarray]:
        """The current per-tensor amax as a float32 NumPy scalar array, or None if unset."""
        if not self.built or not self.calibrated:
            return None
        return np.asarray(self.amax.numpy(), dtype=np.float32)

    def set_amax(self, value: float) -> None:
        """Set the range (finite, > 0) and mark the quantizer initialised."""
        value = float(value)
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"amax for '{self.name}' must be finite and > 0, got {value}")
        self.amax.assign(value)
        self.initialized.assign(1.0)
        self._warned = False

    def add_consumer(self, layer_name: str, input_index: int) -> None:
        """Record that input ``input_index`` of ``layer_name`` reads this quantizer."""
        self.consumers.append([str(layer_name), int(input_index)])

    def get_config(self):
        config = super().get_config()
        config.update(mode=self.mode, momentum=self.momentum, producer=self.producer,
                      producer_index=self.producer_index,
                      consumers=[list(c) for c in self.consumers], covers_inputs_of=self.covers_inputs_of,
                      reseed_clip_fraction=self.reseed_clip_fraction)
        return config


@dataclass(frozen=True)
class WeightRule:
    """Where a layer keeps a quantizable weight and which axes are its output channels.

    ``attr`` is the layer attribute holding the variable; ``channel_axes`` are the
    (negative) axes that index output channels, all other axes are reduced for amax.
    """

    attr: str
    channel_axes: Tuple[int, ...]


_KERNEL_LAST = (WeightRule("kernel", (-1,)),)
_KERNEL_TRANSPOSE = (WeightRule("kernel", (-2,)),)  # [..., out, in]
_KERNEL_DEPTHWISE = (WeightRule("kernel", (-2, -1)),)  # [..., in, multiplier]
_KERNEL_SEPARABLE = (WeightRule("depthwise_kernel", (-2, -1)), WeightRule("pointwise_kernel", (-1,)))

# Most specific first: the first isinstance match wins.
WEIGHT_RULES: Tuple[Tuple[tuple, Tuple[WeightRule, ...]], ...] = (
    ((keras.layers.SeparableConv1D, keras.layers.SeparableConv2D), _KERNEL_SEPARABLE),
    ((keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D), _KERNEL_DEPTHWISE),
    ((keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose),
     _KERNEL_TRANSPOSE),
    ((keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D), _KERNEL_LAST),
    ((keras.layers.Dense,), _KERNEL_LAST),
)


def weight_rules_for(layer) -> Tuple[WeightRule, ...]:
    """The weight rules of ``layer`` (empty if tf_bridge cannot quantize its weights); a class
    declared with [`tf_bridge.custom_layers.register_layer_quantization`][] uses its declaration."""
    from .custom_layers import registered_quantization

    declared = registered_quantization(layer)
    if declared is not None:
        return tuple(WeightRule(attr, axes) for attr, axes in declared.weights)
    for classes, rules in WEIGHT_RULES:
        if isinstance(layer, classes):
            return rules
    return ()


@keras.saving.register_keras_serializable(package="tf_bridge")
class QuantizeWrapper(keras.layers.Wrapper):
    """Wraps a weighted layer; quantizes its kernel(s) per output channel at every call.

    ``amax`` of every kernel is ``max |w|`` per output channel, recomputed from the
    current weights on every call (no state to calibrate). The wrapped layer runs
    unchanged with the fake-quantized kernel substituted via ``keras.StatelessScope``,
    so gradients reach the float kernel straight through.
    """

    def __init__(self, layer, mode: str = "ema", momentum: float = 0.99, **kwargs):
        super().__init__(layer, **kwargs)
        self.rules = weight_rules_for(layer)
        if not self.rules:
            raise ValueError(f"layer '{layer.name}' ({type(layer).__name__}) has no quantizable weights")
        if getattr(layer, "lora_enabled", False):
            raise ValueError(f"layer '{layer.name}' uses LoRA; merge it before quantization")
        self.mode = mode
        self.momentum = float(momentum)
        #: SeparableConv: the quantizer of the depthwise output, the pointwise convolution's input
        #: (both convolutions then run in INT8 in TensorRT); None for other layers.
        self.intermediate = None
        if isinstance(layer, (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)):
            self.intermediate = ActivationQuantizer(mode=mode, momentum=momentum, producer=layer.name,
                                                    name=f"{layer.name}_depthwise_quant")
            self.intermediate.inside = layer.name

    def build(self, input_shape=None):
        """Build the wrapped layer (its weights stay the float master copies) and, for a
        SeparableConv, the quantizer of its depthwise output."""
        if not self.layer.built:
            self.layer.build(input_shape)
        if self.intermediate is not None and not self.intermediate.built:
            self.intermediate.build(None)

    def call(self, inputs, *args, training=None, **kwargs):
        """Run the wrapped layer with each quantized weight replaced by its fake-quantized value
        (per-channel amax from the current weight, narrow int8 range); gradients reach the float
        weight straight through. A SeparableConv runs as its two convolutions with the depthwise
        output fake-quantized in between (`intermediate`)."""
        mapping = []
        for rule in self.rules:
            var = getattr(self.layer, rule.attr)
            w = tf.convert_to_tensor(var)
            amax = tf.stop_gradient(per_channel_amax(w, rule.channel_axes))
            mapping.append((var, fake_quant(w, amax, narrow_range=True)))
        if self.intermediate is not None:
            weights = [w for _, w in mapping]
            return self._separable(inputs, weights[0], weights[1], training)
        if training is not None and getattr(self.layer, "_call_has_training_arg", False):
            kwargs["training"] = training
        with keras.StatelessScope(state_mapping=mapping):
            return self.layer(inputs, *args, **kwargs)

    def _separable(self, inputs, depthwise, pointwise, training):
        """What ``SeparableConvND.call`` computes, with the depthwise output quantized: depthwise
        convolution, fake quantization, 1x1 convolution, bias, activation."""
        layer = self.layer
        x = keras.ops.depthwise_conv(inputs, depthwise, strides=layer.strides, padding=layer.padding,
                                     data_format=layer.data_format, dilation_rate=layer.dilation_rate)
        x = self.intermediate(x, training=training)
        x = keras.ops.conv(x, pointwise, strides=1, padding="valid", data_format=layer.data_format)
        if layer.use_bias:
            shape = ((1,) * (layer.rank + 1) + (layer.filters,) if layer.data_format == "channels_last"
                     else (1, layer.filters) + (1,) * layer.rank)
            x = keras.ops.add(x, keras.ops.reshape(layer.bias, shape))
        return layer.activation(x) if layer.activation is not None else x

    def get_config(self):
        config = super().get_config()
        config.update(mode=self.mode, momentum=self.momentum)
        return config

    def compute_output_shape(self, input_shape):
        """The wrapped layer's output shape (traced when the layer does not implement it)."""
        try:
            return self.layer.compute_output_shape(input_shape)
        except NotImplementedError:
            specs = keras.tree.map_shape_structure(lambda s: keras.KerasTensor(s), input_shape)
            return keras.tree.map_structure(lambda t: t.shape, self.layer.compute_output_spec(specs))

    def quantized_weights(self):
        """``(attr, variable, channel_axes)`` for each quantized kernel, in rule order."""
        return tuple((r.attr, getattr(self.layer, r.attr), r.channel_axes) for r in self.rules)

    def weight_amax(self) -> dict:
        """``{attr: amax}``: float32 NumPy arrays, one value per output channel (see
        `tf_bridge.fake_quant.per_channel_amax_numpy` for the channel order)."""
        return {attr: per_channel_amax_numpy(var.numpy(), axes)
                for attr, var, axes in self.quantized_weights()}


def own_objects():
    """tf_bridge's Keras classes by their registered and their plain names (for loading and rebuilding)."""
    objects = {}
    for cls in (ActivationQuantizer, QuantizeWrapper):
        objects[keras.saving.get_registered_name(cls)] = cls
        objects[cls.__name__] = cls
    return objects
