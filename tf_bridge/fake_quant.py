"""The numerics contract: symmetric INT8 fake quantization.

This module is the single definition of what a quantized tensor is. The ONNX
export must reproduce it exactly (QuantizeLinear/DequantizeLinear compute the
same thing), so every detail is fixed here:

* symmetric, zero point 0, ``scale = amax / 127`` (float32);
* ``q = clip(round_half_to_even(x / scale), qmin, 127)``, ``y = q * scale``;
* activations are per tensor with ``qmin = -128``; weights are per channel
  with ``qmin = -127`` (``narrow_range=True``);
* an ``amax`` that is not finite or not > 0 is replaced by 1.0 (see
  `safe_amax`): an all-zero weight channel then stays exactly zero;
* gradient (straight-through estimator): ``dy/dx = 1`` where
  ``qmin <= x / scale <= 127`` and 0 outside; ``dy/damax`` is the LSQ form
  ``(q - x/scale) / 127`` inside and ``q / 127`` outside, summed over the
  axes ``amax`` was broadcast along (used only by learnable ranges).

Written with plain TensorFlow ops and `tf.custom_gradient`; it does not
use ``tf.quantization.quantize_and_dequantize_v2``, whose per-axis form fails on
TensorFlow 2.16-2.21. [`fake_quant_reference`][tf_bridge.fake_quant.fake_quant_reference] is the same formula
in NumPy.

Inside ``with numerics("fp8"):`` the same calls compute FP8 E4M3 fake quantization with the same
amax (`fake_quant_fp8`: ``scale = amax / 448``, ``castToFp8(clip(x / scale, -448, 448))``),
the reference ``tf_bridge.export_onnx(..., precision="fp8")`` measures its FP8 model against.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import numpy as np
import tensorflow as tf

QMAX = 127.0
QMIN_ACTIVATION = -128.0
QMIN_WEIGHT = -127.0


def _qmin(narrow_range: bool) -> float:
    return QMIN_WEIGHT if narrow_range else QMIN_ACTIVATION


def safe_amax(amax: tf.Tensor) -> tf.Tensor:
    """Return ``amax`` with every non-finite or non-positive entry replaced by 1.0."""
    amax = tf.convert_to_tensor(amax)
    ok = tf.logical_and(tf.math.is_finite(amax), amax > 0)
    return tf.where(ok, amax, tf.ones_like(amax))


def _sum_to_shape(grad: tf.Tensor, shape: tf.Tensor) -> tf.Tensor:
    """Sum ``grad`` over the axes along which a tensor of ``shape`` was broadcast."""
    axes, _ = tf.raw_ops.BroadcastGradientArgs(s0=shape, s1=tf.shape(grad))
    return tf.reshape(tf.reduce_sum(grad, axis=axes), shape)


def fake_quant(x: tf.Tensor, amax: tf.Tensor, narrow_range: bool = False) -> tf.Tensor:
    """Quantize and dequantize ``x`` with ``scale = amax / 127`` (symmetric INT8).

    Args:
        x: float tensor.
        amax: scalar (per tensor) or a tensor broadcastable to ``x`` (per channel,
            e.g. with ``keepdims=True`` shape). Entries that are not finite or
            not > 0 are replaced by 1.0.
        narrow_range: ``True`` for weights (clip to [-127, 127]), ``False`` for
            activations (clip to [-128, 127]).

    Returns:
        A tensor like ``x`` holding ``clip(round(x / scale), qmin, 127) * scale``,
        whose gradient is straight-through inside the range and zero outside.
    """
    x = tf.convert_to_tensor(x)
    amax = tf.cast(safe_amax(tf.cast(amax, tf.float32)), x.dtype)
    if _PRECISION.get() == "fp8":
        return fake_quant_fp8(x, amax)
    return _fake_quant(x, amax, _qmin(narrow_range))


#: The numerics [`fake_quant`][tf_bridge.fake_quant.fake_quant] computes (see `numerics`).
_PRECISION: contextvars.ContextVar = contextvars.ContextVar("tf_bridge_fake_quant_precision", default="int8")
#: Largest finite FP8 E4M3 magnitude.
FP8_MAX = 448.0


@contextlib.contextmanager
def numerics(precision: str):
    """Within the block, [`fake_quant`][tf_bridge.fake_quant.fake_quant] computes ``precision``'s numerics:
    ``"int8"`` (the default) or ``"fp8"`` (`fake_quant_fp8` with the same amax). Applies to eager calls and to
    functions traced inside the block."""
    if precision not in ("int8", "fp8"):
        raise ValueError(f"precision must be 'int8' or 'fp8', got {precision!r}")
    token = _PRECISION.set(precision)
    try:
        yield
    finally:
        _PRECISION.reset(token)


def fake_quant_fp8(x: tf.Tensor, amax: tf.Tensor) -> tf.Tensor:
    """FP8 E4M3 fake quantization: ``castToFp8(clip(x / s, -448, 448)) * s`` with ``s = amax / 448``
    (round to nearest, ties to even), straight-through gradient inside the range.

    Source: TensorRT Developer Guide, "Quantization Schemes" (FP8).
    """
    import ml_dtypes

    x = tf.convert_to_tensor(x)
    scale = tf.cast(safe_amax(tf.cast(amax, tf.float32)), x.dtype) / FP8_MAX
    xs = tf.clip_by_value(x / scale, -FP8_MAX, FP8_MAX)
    y = tf.cast(tf.cast(xs, tf.dtypes.as_dtype(ml_dtypes.float8_e4m3fn)), x.dtype) * scale
    return xs * scale + tf.stop_gradient(y - xs * scale)


#: Inside ``with forward_only():`` (see there) fake quantization is built without its gradient.
_FORWARD_ONLY: contextvars.ContextVar = contextvars.ContextVar("tf_bridge_fake_quant_forward_only",
                                                               default=False)


@contextlib.contextmanager
def forward_only():
    """Within the block, [`fake_quant`][tf_bridge.fake_quant.fake_quant] builds only its forward ops (the same
    ops, the same numbers) without the custom-gradient wrapper, and an activation quantizer called in
    inference
    reads whether it has a range once instead of selecting at run time: for a graph that is only
    evaluated with fixed ranges (``export_onnx`` runs the Keras QAT graph in onnxruntime). In
    TensorFlow graphs the wrapper is an ``IdentityN`` over every input and output, which keeps
    a weight's fake quantization from being folded into a constant; the select is a ``Where``
    per quantizer. Applies to functions traced inside the block."""
    token = _FORWARD_ONLY.set(True)
    try:
        yield
    finally:
        _FORWARD_ONLY.reset(token)


def is_forward_only() -> bool:
    """True inside `forward_only`."""
    return _FORWARD_ONLY.get()


def _forward(x, amax, qmin):
    scale = amax / QMAX
    xs = x / scale
    q = tf.clip_by_value(tf.round(xs), qmin, QMAX)
    return q * scale, xs, q


def _fake_quant(x, amax, qmin):
    if _FORWARD_ONLY.get():
        return _forward(x, amax, qmin)[0]

    @tf.custom_gradient
    def _fq(x, amax):
        y, xs, q = _forward(x, amax, qmin)

        def grad(dy):
            inside = tf.logical_and(xs >= qmin, xs <= QMAX)
            zeros = tf.zeros_like(dy)
            dx = tf.where(inside, dy, zeros)
            dy_dscale = tf.where(inside, q - xs, q)
            damax = _sum_to_shape(dy * dy_dscale / QMAX, tf.shape(amax))
            return dx, damax

        return y, grad

    return _fq(x, amax)


def per_channel_amax(w: tf.Tensor, channel_axes: Sequence[int]) -> tf.Tensor:
    """Max ``|w|`` over every axis not in ``channel_axes``, keeping dims (broadcastable to ``w``)."""
    rank = len(w.shape)
    keep = {a % rank for a in channel_axes}
    reduce_axes = [a for a in range(rank) if a not in keep]
    return tf.reduce_max(tf.abs(w), axis=reduce_axes, keepdims=True)


def per_channel_amax_numpy(w: np.ndarray, channel_axes: Sequence[int]) -> np.ndarray:
    """NumPy twin of `per_channel_amax`, flattened to one value per output channel.

    The flattening is row-major over ``channel_axes``; for a DepthwiseConv2D
    kernel ``[kh, kw, in, multiplier]`` this is output channel ``c * multiplier + m``,
    the channel order Keras and ONNX use. Unsafe entries are replaced by 1.0.
    """
    w = np.asarray(w, dtype=np.float32)
    keep = {a % w.ndim for a in channel_axes}
    reduce_axes = tuple(a for a in range(w.ndim) if a not in keep)
    amax = np.max(np.abs(w), axis=reduce_axes).reshape(-1)
    return np.where(np.isfinite(amax) & (amax > 0), amax, np.float32(1.0)).astype(np.float32)


def fake_quant_reference(x: np.ndarray, amax, narrow_range: bool = False) -> np.ndarray:
    """The contract in NumPy float32 (``amax`` broadcastable to ``x``); used by tests and parity checks."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.asarray(amax, dtype=np.float32)
    amax = np.where(np.isfinite(amax) & (amax > 0), amax, np.float32(1.0)).astype(np.float32)
    scale = (amax / np.float32(QMAX)).astype(np.float32)
    q = np.clip(np.round(x / scale), _qmin(narrow_range), QMAX).astype(np.float32)
    return (q * scale).astype(np.float32)
