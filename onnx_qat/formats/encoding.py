"""How each numeric format stores a weight: the grid, the scale rule, the zero point, the layout.

`encode_weight` turns a float weight (and its amax: the weight's own, or a ScaleTable's) into
what the one inserter writes for every format alike: the stored initializer's bytes, the scale, the
zero point and the DequantizeLinear's ``axis`` and ``block_size``
(`onnx_qat.insertion.inserter` writes them; rule 2, and the FP8/INT4 forms of
docs/formats.md):

* ``int8``: ``q = clip(round_half_to_even(w / scale), -127, 127)``, ``scale = amax / 127`` per output
  channel (or per tensor), zero point 0 of int8, or ``q + 128`` of uint8 with zero point 128 (the same
  values: the ``ort-cpu`` form's unsigned weights);
* ``fp8``: E4M3FN values of ``w / scale`` (``scale = amax / 448``), zero point 0 of float8e4m3fn;
* ``int4``: blockwise ``scale = amax / 7`` along the reduction axis, two values per byte, zero point 0.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .numeric import INT8, ONNX_INT4, Format
from .scale_grid import fp16_weight_scales

logger = logging.getLogger(__name__)

#: Scale used for a weight channel whose amax is zero (all-zero channel): any positive
#: scale maps it to 0 exactly; this one is tiny but far from float32 underflow.
ZERO_CHANNEL_SCALE = 1e-8
TINY = float(np.finfo(np.float32).tiny)
_MAX = float(np.finfo(np.float32).max)
#: The integer range INT8 weights are clipped to (rule 2: symmetric, -128 unused).
INT8_QRANGE = (int(INT8.weight_range[0]), int(INT8.weight_range[1]))




def weight_amax(values: np.ndarray, axis: Optional[int]) -> np.ndarray:
    """max |w| per channel along ``axis`` (a one-element array when ``axis`` is None)."""
    values = values.astype(np.float32, copy=False)
    if axis is None:
        return np.array([np.abs(values).max() if values.size else 0.0], np.float32)
    if values.ndim == 1:
        return np.abs(values)
    rows = values.reshape(values.shape[0], -1) if axis == 0 else \
        np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
    if rows.shape[1] == 0:
        return np.zeros(values.shape[axis], np.float32)
    return np.maximum(rows.max(axis=1), -rows.min(axis=1))  # max |w| without an |w| copy


def quantize_weight(values: np.ndarray, axis: Optional[int], amax: Optional[Sequence[float]] = None,
                    qrange: Tuple[int, int] = INT8_QRANGE,
                    name: str = "weight", fp16_grid: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel (or per-tensor) weight quantization.

    ``scale = amax / 127`` per channel (amax from the argument, else max |w|); a channel
    whose scale would be zero or subnormal gets `ZERO_CHANNEL_SCALE` (logged).
    With ``fp16_grid`` each scale then moves to the one of its two FP16 neighbours that reconstructs
    the channel best (`onnx_qat.formats.scale_grid.fp16_weight_scales`; the TensorRT form's weights
    whose range comes from their values), and the weight is quantized with that scale.
    ``q = clip(round_half_to_even(w / scale), -127, 127)`` as int8.

    Returns ``(q int8 array, scale float32 array of one value per channel)``.
    """
    values = np.asarray(values, np.float32)
    amax_values = weight_amax(values, axis) if amax is None else np.asarray(amax, np.float32)
    scale = (amax_values.astype(np.float64) / float(qrange[1])).astype(np.float32)
    usable = usable_scales(scale)
    if not usable.all():
        bad = ~usable
        logger.info("weight %r: %d channel(s) with zero range get scale %g",
                    name, int(bad.sum()), ZERO_CHANNEL_SCALE)
        scale = np.where(bad, np.float32(ZERO_CHANNEL_SCALE), scale).astype(np.float32)
    shape = scale_shape(values.ndim, axis)
    if fp16_grid:
        scale = fp16_weight_scales(values, scale, shape, int8_dequantized(qrange))
    return to_grid(values, scale.reshape(shape), qrange), scale


def scale_shape(ndim: int, axis: Optional[int]) -> tuple:
    """How a weight's scales (one per channel along ``axis``, or one) broadcast against it."""
    if axis is None:
        return ()
    shape = [1] * ndim
    shape[axis] = -1
    return tuple(shape)


def int8_dequantized(qrange: Tuple[int, int] = INT8_QRANGE):
    """INT8 quantize-dequantize ``(values, scale) -> clip(round(values / scale), qrange) * scale`` (float32),
    what `onnx_qat.formats.scale_grid.fp16_weight_scales` compares candidate scales with."""
    def dequantized(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
        return to_grid(values, scale, qrange).astype(np.float32) * scale
    return dequantized


def to_grid(values: np.ndarray, scale: np.ndarray, qrange: Tuple[int, int]) -> np.ndarray:
    """``clip(round_half_to_even(values / scale), qrange)`` as int8 (``scale`` broadcasts)."""
    q = np.divide(values, scale)
    np.rint(q, out=q)
    np.clip(q, qrange[0], qrange[1], out=q)
    return q.astype(np.int8)


def usable_scales(scale: np.ndarray) -> np.ndarray:
    """True where a float32 scale is usable: False for zero, subnormal, inf and NaN."""
    return (scale >= TINY) & (scale <= _MAX)


def zero_point(fmt: Format, shape: Tuple[int, ...], *, unsigned: bool = False) -> tuple:
    """``(type, raw bytes, shape)`` of a weight zero point of ``fmt``: 0 (all zero bits: int8, FP8,
    packed INT4), or 128 of uint8 for an ``unsigned`` int8 weight; ``type`` is a NumPy dtype or an
    ONNX element type number, as `onnx_qat.graph.edit.GraphEdit.add_raw_initializer` takes."""
    if fmt is INT8:
        zero = np.full(shape, 128 if unsigned else 0, np.uint8 if unsigned else np.int8)
        return zero.dtype, zero.tobytes(), tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    size = (count + 1) // 2 if fmt.weight_type == ONNX_INT4 else count
    return fmt.weight_type, bytes(size), tuple(shape)


class EncodedWeight(NamedTuple):
    """A weight as one format stores it (what the inserter writes for it)."""

    data: tuple  #: ``(type, raw little-endian bytes, shape)`` of the stored initializer
    scale: np.ndarray  #: float32: ``()`` per tensor, one value per channel, or the block grid
    zero: tuple  #: the zero point, as `zero_point` gives it
    axis: Optional[int]  #: DequantizeLinear's ``axis`` (None: per tensor)
    block_size: Optional[int]  #: DequantizeLinear's ``block_size`` (INT4), else None
    amax: np.ndarray  #: the amax per channel or block (zero channels are reported)


def encode_int8(q: np.ndarray, scale: np.ndarray, amax: np.ndarray, axis: Optional[int], *,
                unsigned: bool = False) -> EncodedWeight:
    """An INT8 weight already on its grid (``q`` int8, ``scale`` one float32 per channel) as stored:
    uint8 ``q + 128`` with zero point 128 when ``unsigned`` (the same dequantized values)."""
    if unsigned:
        q = (q.astype(np.int16) + 128).astype(np.uint8)
    per_channel = axis is not None
    zero = zero_point(INT8, scale.shape if per_channel else (), unsigned=unsigned)
    q = q.astype(q.dtype.newbyteorder("<"), copy=False)
    return EncodedWeight((q.dtype, q.tobytes(), q.shape), scale if per_channel else scale.reshape(()), zero,
                         axis, None, amax)


def encode_weight(fmt: Format, values: np.ndarray, axis: Optional[int], amax=None, *,
                  block_size: Optional[int] = None, unsigned: bool = False, name: str = "weight",
                  qrange: Tuple[int, int] = INT8_QRANGE, fp16_grid: bool = False) -> EncodedWeight:
    """``values`` (float32) stored in ``fmt`` along ``axis``: per channel (``axis``), per tensor (None)
    or, for a blocked format, in blocks of ``block_size`` along ``axis``.

    ``amax``: the range per channel (or per block, as the block grid) from a ScaleTable, or None to
    take it from the values. ``unsigned`` and ``qrange`` apply to int8 only. ``fp16_grid``: every
    scale moved to the FP16 neighbour that reconstructs its values best, the weight quantized with it
    (`onnx_qat.formats.scale_grid.fp16_weight_scales`: FP16 float parts then store the scales
    unchanged), for every format alike.
    """
    values = np.asarray(values, np.float32)
    if fmt is INT8:
        own = weight_amax(values, axis) if amax is None else np.asarray(amax, np.float32)
        q, scale = quantize_weight(values, axis, own, qrange, name=name, fp16_grid=fp16_grid)
        return encode_int8(q, scale, own if amax is None else weight_amax(values, axis), axis,
                           unsigned=unsigned)
    from .blockwise import fp8_dequantized, pack_int4, quantize_blocks, to_fp8

    if fmt.blocked:
        q, scale = quantize_blocks(values, axis, block_size, amax, fp16_grid=fp16_grid)
        return EncodedWeight((fmt.weight_type, pack_int4(q), values.shape), scale,
                             zero_point(fmt, scale.shape), axis, block_size, scale * np.float32(fmt.qmax))
    own = weight_amax(values, axis) if amax is None else np.asarray(amax, np.float32)
    scale = (own.astype(np.float64) / fmt.qmax).astype(np.float32)
    scale = np.where(usable_scales(scale), scale, np.float32(ZERO_CHANNEL_SCALE)).astype(np.float32)
    shape = scale_shape(values.ndim, axis)
    if fp16_grid:
        scale = fp16_weight_scales(values, scale, shape, fp8_dequantized)
    if axis is None:
        scale = scale.reshape(())
    stored = to_fp8(values, scale.reshape(shape)).tobytes()
    return EncodedWeight((fmt.weight_type, stored, values.shape), scale, zero_point(fmt, scale.shape), axis,
                         None, own)
