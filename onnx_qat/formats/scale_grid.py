"""Calibrated activation ranges whose Q/DQ scales are FP16 values already in the FP32 model.

A Q/DQ model with FP16 float parts stores every activation scale in FP16 (a QuantizeLinear's input
and scale share one type in opsets 19-22: `onnx_qat.formats.float_parts`). An FP32 scale that is
not an FP16 value moves when it is converted, by less than one FP16 step (2^-10 relative), and
with it the INT8 grid of that activation: on the PP-OCR models that move alone changed the output
cosine by up to 0.003, in a direction only a measurement tells (docs/formats.md, "Where the angle
classifier's drop came from"), while FP16 storage and arithmetic together cost 0.0003.

So the ranges calibration computes for the TensorRT form (`onnx_qat.calibration.runner.collect`) are
raised, each to the smallest range whose INT8 scale ``float32(amax / 127)`` is an FP16 value
(`on_fp16_grid`): the FP32 model
holds exactly the scales its FP16 form will hold, converting it moves no grid, and everything that
judges the FP32 table (``auto``'s choice, ``--min-cosine``, ``--optimize accuracy``) judges the grid
that is written. Raised, not rounded to nearest: no range shrinks below the calibrated one, so
nothing calibration saw is clipped (as the conversion rounds scales; TensorRT requires them > 0).
Each scale moves by at most 2^-10 of itself (less than one FP16 step in FP16's normal range), the
range with it.

Weight scales likewise (`fp16_weight_scales`): the TensorRT form's weights quantized from their own
values (``amax = max |w|`` per channel or per INT4 block; the target's ``weight_scale_grid``) take, for
each scale, the one of its two FP16 neighbours whose quantize-dequantize reconstructs the channel's
values with the smaller squared error, and are quantized with exactly that scale (so the codes are
the round to nearest of the written scale, as before). A weight scale of the FP32 form not an FP16
value was rounded to nearest by the conversion with its codes fixed, rescaling each output channel by
up to 2^-11: on the document orientation classifier that rescaling was the whole of FP16's drop on its
16 evaluation inputs, +0.0060 (docs/formats.md, "Where the orientation classifier's drop comes
from"). Either neighbour: a weight's range is its own maximum, so one step down clips nothing (its
largest value lands at most 127.13 codes out, rounded to 127), and which neighbour fits a channel
better is a property of its values.

Left as they are:

* scales FP16 cannot hold within its precision (above 65504; deep in its subnormal range, below
  2^-14, where rounding up would move them by more than 2^-10 of themselves): the conversion keeps
  their nodes FP32 by the same criterion (its ``scale`` rule), with their FP32 scales;
* ranges a user gives (a ScaleTable or its JSON file, a TensorRT calibration cache, the Keras
  round trip's trained ranges): written exactly as given;
* weight scales: they are put on the grid where they are made, by the inserter (`fp16_weight_scales`
  below: the weights of the TensorRT form quantized from their own values, INT8, FP8 and INT4);
* FP8 scales (``amax / 448`` of the same ranges): one ScaleTable serves every precision and the
  mixed-format search quantizes INT8 and FP8 sites from one table, so a range sits on one grid,
  INT8's; the conversion rounds FP8 scales as it rounds given ones;
* the ``ort-cpu`` form (FP32 only; its one-sided tensors keep onnxruntime's own scales);
* BF16: its 8-bit significand would move every default scale by up to 2^-8 (four times FP16's
  step) for the sake of an option; BF16 float parts keep rounding the scales when they convert
  (up, or to nearest where the measurement says so).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

#: The spacing of FP16 values just above 1 (its relative precision): a scale moves by at most this
#: much of itself, as in the FP16 conversion's ``scale`` rule.
FP16_EPS = 2.0 ** -10


def on_fp16_grid(amax: float, qmax: float) -> float:
    """``amax`` raised to the smallest range whose scale ``float32(amax / qmax)`` is an FP16 value
    (``qmax``: the format's, 127 for INT8, 448 for FP8): ``qmax * s`` with ``s`` that scale rounded up
    to FP16, so ``float32(result / qmax) == s`` exactly (``s`` has 11 significant bits, ``qmax`` at
    most 9: the product and the quotient are exact in float64). A range whose scale FP16 cannot
    hold within its precision -- above 65504, or so deep in FP16's subnormal range (below 2^-14)
    that rounding it up would move it by more than 2^-10 of itself -- is returned unchanged: the
    FP16 conversion keeps that scale FP32 by the same criterion
    ([`scale_fits`][onnx_qat.formats.float_parts.scale_fits] with ``up=True``). One value of
    `fp16_grid_values`."""
    return fp16_grid_values([amax], qmax)[0]


def fp16_grid_values(values: Sequence[float], qmax: float) -> list:
    """[`on_fp16_grid`][onnx_qat.formats.scale_grid.on_fp16_grid] of each of ``values`` (floats
    >= 0), computed for all of them in a few NumPy calls, each value on its own: the scale rounded
    up to float32, then up to FP16 as the conversion rounds scales up
    ([`LowType.round_up`][onnx_qat.formats.float_cast.LowType.round_up]). ``collect`` puts about six
    ranges per tensor on the grid (each candidate of ``auto``), 150,000 on a 50,000-node graph."""
    amax = np.asarray(values, dtype=np.float64)
    if amax.size == 0:
        return []
    wanted = amax / qmax
    with np.errstate(over="ignore"):
        scale = wanted.astype(np.float32)
    below = scale.astype(np.float64) < wanted  # float32 rounded it down: the next float32 up
    scale = np.where(below, np.nextafter(scale, np.float32(np.inf)), scale)
    rounded = fp16_round_up(scale).astype(np.float64)
    wide = scale.astype(np.float64)
    with np.errstate(invalid="ignore"):
        fits = np.isfinite(rounded) & (rounded > 0) & (rounded - wide <= FP16_EPS * wide)
    return np.where(fits, qmax * rounded, amax).tolist()


# --------------------------------------------------------------------------- weight scales
#: FP16's smallest positive (subnormal) value: the conversion stores no weight scale below it
#: (`onnx_qat.formats.float_parts.low_scale`).
FP16_TINY = 2.0 ** -24


def fp16_neighbours(scale: np.ndarray) -> tuple:
    """``(below, above)``: for each float32 ``scale`` (>= 0), the largest FP16 value not above it and
    the smallest not below it, as float32 (equal where ``scale`` is an FP16 value); ``below`` is 0
    under FP16's smallest positive value, ``above`` inf over its largest."""
    scale = np.asarray(scale, np.float32)
    with np.errstate(over="ignore"):
        half = scale.astype(np.float16)
        down = np.where(half.astype(np.float32) > scale, np.nextafter(half, np.float16(0)), half)
    return down.astype(np.float32), fp16_round_up(scale)


def fp16_scale_candidates(scale: np.ndarray) -> tuple:
    """``(down, up)``: the two FP16 neighbours of each weight scale (`fp16_neighbours`) a weight may take,
    as float32, neither below FP16's smallest subnormal (`FP16_TINY`: a scale must stay > 0)."""
    down, up = fp16_neighbours(scale)
    down = np.where(down > 0, down, np.float32(FP16_TINY)).astype(np.float32)
    return down, np.maximum(up, np.float32(FP16_TINY)).astype(np.float32)


def fp16_round_up(scale: np.ndarray) -> np.ndarray:
    """For each float32 ``scale`` (>= 0), the smallest FP16 value not below it, as float32; inf above
    FP16's largest value. The one FP16 round-up: the FP16 conversion rounds scales up with it too
    ([`LowType.round_up`][onnx_qat.formats.float_cast.LowType.round_up] of ``FP16``), so the grid and
    the conversion cannot disagree."""
    scale = np.asarray(scale, np.float32)
    with np.errstate(over="ignore"):
        half = scale.astype(np.float16)
        return np.where(half.astype(np.float32) < scale, np.nextafter(half, np.float16(np.inf)),
                        half).astype(np.float32)


def fp16_weight_scales(values: np.ndarray, scale: np.ndarray, shape, dequantized, *,
                       batched: bool = False) -> np.ndarray:
    """Weight scales ``scale`` (float32, each > 0; ``shape``: how they broadcast against ``values``)
    moved onto the FP16 grid, each to whichever of its two FP16 neighbours (`fp16_neighbours`)
    reconstructs its values best: the smaller sum of squared errors of ``dequantized(values,
    candidate scales broadcast)`` (the format's quantize-dequantize, e.g. INT8's ``clip(round(w / s),
    -127, 127) * s``) against ``values`` over the values that scale covers; the upper one on a tie.
    The caller quantizes the weight with the scales returned, so the FP32 form holds FP16 values as
    weight scales and the FP16 conversion stores them unchanged (docs/formats.md, "Float parts in FP16
    or BF16").

    Returned unchanged (float32, as given) where FP16 cannot hold the scales within its precision,
    by the conversion's own criterion (`onnx_qat.formats.float_parts.scale_fits`: rounded to the
    nearest FP16 value, no scale moves by more than 2^-10 of the largest; else the conversion keeps
    the weight's DequantizeLinear FP32 with its FP32 scales): a weight whose scales all lie in
    FP16's subnormal range, or beyond its largest value. A scale below FP16's smallest positive
    value (a channel of zeros, or of values that small beside the tensor's largest) takes that
    value (`FP16_TINY`), as the conversion would store it. ``batched``: axis 0 of ``values`` and
    ``scale`` holds separate weights of one shape (the inserter's batches of small weights), each
    judged by that criterion on its own."""
    scale = np.asarray(scale, np.float32)
    if not scale.size:
        return scale
    with np.errstate(over="ignore"):
        nearest = np.maximum(scale.astype(np.float16).astype(np.float32), np.float32(FP16_TINY))
    items = scale.reshape(scale.shape[0] if batched else 1, -1)
    with np.errstate(invalid="ignore"):
        fits = np.all(np.isfinite(nearest.reshape(items.shape)), axis=1) & (
            np.max(np.abs(nearest.reshape(items.shape) - items), axis=1) <= FP16_EPS * np.max(items, axis=1))
    if not fits.any():
        return scale
    down, up = fp16_scale_candidates(scale)
    moved = down != up
    if not np.any(moved):
        chosen = up
    else:
        axes = tuple(i for i, n in enumerate(shape) if n == 1 and values.shape[i] != 1) if len(shape) else \
            tuple(range(values.ndim))
        errors = []
        for candidate in (down, up):
            broadcast = np.where(np.isfinite(candidate), candidate, np.float32(1.0)).reshape(shape)
            errors.append(_squared_errors(values, broadcast, dequantized, axes).reshape(scale.shape))
        chosen = np.where(moved & (errors[0] < errors[1]), down, up).astype(np.float32)
    keep = np.broadcast_to(fits.reshape((-1,) + (1,) * (scale.ndim - 1)) if batched else fits[0], scale.shape)
    return np.where(keep, chosen, scale).astype(np.float32)


#: Values of a weight `fp16_weight_scales` quantizes and dequantizes at once (2^22: 16 MiB of float32);
#: a larger weight is judged a slice of its first axis at a time, so the temporaries (the quotient, the
#: reconstruction, the difference and its float64 square, about 24 bytes per value) stay near 100 MB
#: instead of growing with it: 2.8 GB for one 117-million-value weight of a model over 2 GB.
ERROR_CHUNK = 1 << 22


def _squared_errors(values: np.ndarray, broadcast: np.ndarray, dequantized, axes: tuple) -> np.ndarray:
    """``sum((dequantized(values, broadcast) - values) ** 2)`` over ``axes`` in float64 (the reduced axes
    kept as 1), over slices of ``values``' first axis of at most `ERROR_CHUNK` values each; a weight
    of at most `ERROR_CHUNK` values is one slice, summed as before."""
    rows = values.shape[0] if values.ndim else 1
    step = rows if values.size <= ERROR_CHUNK else max(1, ERROR_CHUNK // max(1, values.size // rows))
    if step >= rows:
        diff = dequantized(values, broadcast) - values
        return np.sum(np.square(diff, dtype=np.float64), axis=axes, keepdims=True)
    sliced = broadcast.ndim > 0 and broadcast.shape[0] != 1  # one scale per row: slice them too
    parts = []
    for start in range(0, rows, step):
        part = values[start:start + step]
        diff = dequantized(part, broadcast[start:start + step] if sliced else broadcast) - part
        parts.append(np.sum(np.square(diff, dtype=np.float64), axis=axes, keepdims=True))
    if 0 in axes:  # the first axis is summed over: add the slices' sums
        return np.sum(np.concatenate(parts, axis=0), axis=0, keepdims=True)
    return np.concatenate(parts, axis=0)
