"""Numerics of the non-int8 formats: FP8 E4M3FN casts, INT4 block scales and INT4 packing.

* `to_fp8` — ``castToFp8(clip(x / s, -448, 448))`` (round to nearest, ties to even), as
  the raw E4M3FN bytes ONNX stores.
* `block_amax`, `quantize_blocks` — symmetric INT4 per-block quantization along
  one axis: ``scale = amax_block / 7``, ``q = clip(round_half_to_even(w / scale), -8, 7)``.
* `pack_int4`, `unpack_int4` — two 4-bit values per byte, the first in the low
  nibble (ONNX's INT4 layout; an odd count leaves the last high nibble zero).

Source: TensorRT Developer Guide, "Quantization Schemes"; ONNX IR "4-bit integer types".
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

#: Largest finite E4M3FN magnitude.
FP8_MAX = 448.0
#: INT4 range (symmetric scale maps amax to 7; -8 is representable but not used by rounding).
INT4_MIN, INT4_MAX = -8, 7


def to_fp8(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``clip(values / scale, -448, 448)`` cast to E4M3FN, returned as a ``uint8`` array of the raw
    bytes (``scale`` broadcasts against ``values``)."""
    import ml_dtypes

    q = np.clip(np.divide(np.asarray(values, np.float32), scale, dtype=np.float32), -FP8_MAX, FP8_MAX)
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def from_fp8(raw: np.ndarray) -> np.ndarray:
    """The float32 values of raw E4M3FN bytes (a ``uint8`` array)."""
    import ml_dtypes

    return np.asarray(raw, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def block_amax(values: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """max |w| of each block of ``block_size`` values along ``axis``: the weight's shape with
    ``shape[axis]`` divided by ``block_size`` (which must divide it)."""
    values = np.asarray(values, np.float32)
    length = values.shape[axis]
    if length % block_size:
        raise ValueError(f"block_size {block_size} does not divide dimension {length} (axis {axis})")
    moved = np.moveaxis(values, axis, 0)
    blocks = np.abs(moved.reshape((length // block_size, block_size) + moved.shape[1:])).max(axis=1)
    return np.moveaxis(blocks, 0, axis)


def expand_blocks(scale: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """Each block scale repeated ``block_size`` times along ``axis`` (the weight's shape)."""
    return np.repeat(scale, block_size, axis=axis)


def block_scale(amax: np.ndarray) -> np.ndarray:
    """The float32 INT4 scale of block ranges ``amax``: ``amax / 7``, 1 where that is zero or below
    float32's normal range (any positive scale represents a block of zeros exactly)."""
    scale = (np.asarray(amax, np.float32).astype(np.float64) / INT4_MAX).astype(np.float32)
    return np.where(scale >= np.finfo(np.float32).tiny, scale, np.float32(1.0)).astype(np.float32)


def quantize_blocks(values: np.ndarray, axis: int, block_size: int,
                    amax: np.ndarray = None, fp16_grid: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4 block quantization: ``(q int8 array in [-8, 7], scale float32)``; the scale has
    the weight's shape with ``shape[axis] // block_size`` on ``axis``. A block of zeros gets scale 1
    (any positive scale represents it exactly). ``fp16_grid``: each block scale moved to the FP16
    neighbour that reconstructs its block best (`onnx_qat.formats.scale_grid.fp16_weight_scales`)."""
    values = np.asarray(values, np.float32)
    amax = block_amax(values, axis, block_size) if amax is None else np.asarray(amax, np.float32)
    scale = block_scale(amax)
    if fp16_grid:
        scale = _fp16_block_scales(values, scale, axis, block_size)
    q = np.rint(values / expand_blocks(scale, axis, block_size))
    return np.clip(q, INT4_MIN, INT4_MAX).astype(np.int8), scale


def _fp16_block_scales(values: np.ndarray, scale: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """`fp16_weight_scales` of INT4 block scales: the values seen as ``[..., blocks, block_size, ...]``
    along ``axis``, so that each block scale broadcasts over its block."""
    from .scale_grid import fp16_weight_scales

    shape = list(values.shape)
    blocked = values.reshape(shape[:axis] + [shape[axis] // block_size, block_size] + shape[axis + 1:])
    broadcast = list(scale.shape)
    broadcast.insert(axis + 1, 1)

    def dequantized(v, s):
        return np.clip(np.rint(v / s), INT4_MIN, INT4_MAX) * s

    return fp16_weight_scales(blocked, scale, tuple(broadcast), dequantized)


def fp16_block_amax(values: np.ndarray, amax: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """Block ranges ``amax`` (float32, of ``values`` along ``axis``) moved so that their INT4 scales
    ``amax / 7`` are FP16 values, each the neighbour that reconstructs its block best
    (`_fp16_block_scales`): ``7 x scale``, exact in float32, from which `block_scale` gives the scale
    back exactly. Zero ranges stay zero. For ranges a search chose (AWQ's clipping, GPTQ's blocks),
    which the inserter then writes as given."""
    amax = np.asarray(amax, np.float32)
    scale = _fp16_block_scales(np.asarray(values, np.float32), block_scale(amax), axis, block_size)
    return np.where(amax > 0, scale * np.float32(INT4_MAX), amax).astype(np.float32)


def fp8_dequantized(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP8 E4M3 quantize-dequantize ``from_fp8(to_fp8(values, scale)) * scale`` (float32), what
    `onnx_qat.formats.scale_grid.fp16_weight_scales` compares candidate FP8 scales with."""
    return from_fp8(to_fp8(values, scale)) * scale


def fp16_fp8_amax(matrix: np.ndarray, amax: np.ndarray, axis: int) -> np.ndarray:
    """Per-channel FP8 ranges ``amax`` (float32, of ``matrix`` along ``axis``) moved so that their scales
    ``amax / 448`` are FP16 values, each the neighbour whose E4M3 rounding reconstructs its channel
    best (`onnx_qat.formats.scale_grid.fp16_weight_scales`): ``448 x scale``, exact in float32. Zero
    ranges stay zero."""
    from .scale_grid import fp16_weight_scales

    amax = np.asarray(amax, np.float32)
    scale = (amax.astype(np.float64) / FP8_MAX).astype(np.float32)
    usable = np.isfinite(scale) & (scale > 0)
    shape = [1] * np.ndim(matrix)
    shape[axis] = -1
    moved = fp16_weight_scales(np.asarray(matrix, np.float32), np.where(usable, scale, np.float32(1.0)),
                               tuple(shape), fp8_dequantized)
    return np.where(usable, moved * np.float32(FP8_MAX), amax).astype(np.float32)


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """``q * scale`` with each block scale spread over its block (what DequantizeLinear computes)."""
    return q.astype(np.float32) * expand_blocks(scale, axis, block_size)


def pack_int4(q: np.ndarray) -> bytes:
    """ONNX INT4 raw data of the values ``q`` (in [-8, 7]), flattened in C order: value ``2i`` in the
    low nibble of byte ``i``, value ``2i + 1`` in its high nibble."""
    flat = np.asarray(q).reshape(-1).astype(np.int16)
    if flat.size and (flat.min() < INT4_MIN or flat.max() > INT4_MAX):
        raise ValueError("int4 values must lie in [-8, 7]")
    nibbles = (flat & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_int4(raw: bytes, shape: Tuple[int, ...]) -> np.ndarray:
    """The int8 values of ONNX INT4 raw data holding ``prod(shape)`` values (sign-extended)."""
    count = int(np.prod(shape, dtype=np.int64))
    data = np.frombuffer(raw, np.uint8)
    if data.size != (count + 1) // 2:
        raise ValueError(f"{data.size} bytes cannot hold {count} int4 values")
    nibbles = np.empty(data.size * 2, np.uint8)
    nibbles[0::2] = data & 0x0F
    nibbles[1::2] = data >> 4
    values = nibbles[:count].astype(np.int8)
    values[values > 7] -= 16
    return values.reshape(shape)


__all__ = ["to_fp8", "from_fp8", "block_amax", "block_scale", "expand_blocks", "quantize_blocks",
           "dequantize_blocks", "fp16_block_amax", "fp16_fp8_amax", "fp8_dequantized", "pack_int4",
           "unpack_int4", "FP8_MAX", "INT4_MIN", "INT4_MAX"]
