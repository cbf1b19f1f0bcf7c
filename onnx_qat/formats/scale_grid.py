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

Left as they are:

* scales FP16 cannot hold within its precision (above 65504; deep in its subnormal range, below
  2^-14, where rounding up would move them by more than 2^-10 of themselves): the conversion keeps
  their nodes FP32 by the same criterion (its ``scale`` rule), with their FP32 scales;
* ranges a user gives (a ScaleTable or its JSON file, a TensorRT calibration cache, the Keras
  round trip's trained ranges): written exactly as given;
* weight scales: a weight's codes are computed with its own scale, so an FP16 weight scale
  rescales the dequantized weight by less than 2^-11 (FP16 storage of that weight, which FP16
  float parts do anyway), and moves no activation grid (that rescaling is the whole FP16 drop of
  the orientation classifier on its 16 evaluation inputs, +0.0060, and noise: random rescalings of
  that size move its cosine by up to 0.019; docs/formats.md, "Where the orientation classifier's
  drop comes from");
* FP8 scales (``amax / 448`` of the same ranges): one ScaleTable serves every precision and the
  mixed-format search quantizes INT8 and FP8 sites from one table, so a range sits on one grid,
  INT8's; the conversion rounds FP8 scales as it rounds given ones;
* the ``ort-cpu`` form (FP32 only; its one-sided tensors keep onnxruntime's own scales);
* BF16: its 8-bit significand would move every default scale by up to 2^-8 (four times FP16's
  step) for the sake of an option; BF16 float parts keep rounding the scales when they convert
  (up, or to nearest where the measurement says so).
"""
from __future__ import annotations

from typing import Dict, Mapping

import numpy as np

#: The spacing of FP16 values just above 1 (its relative precision): a scale moves by at most this
#: much of itself, as in the FP16 conversion's ``scale`` rule.
FP16_EPS = 2.0 ** -10


def fp16_round_up(scale: float) -> float:
    """The smallest FP16 value not below ``scale`` (a float32 value >= 0), as a float; inf above
    FP16's largest value (the same rounding as `onnx_qat.formats.float_cast.LowType.round_up`)."""
    with np.errstate(over="ignore"):
        half = np.float16(scale)
        if np.float32(half) < np.float32(scale):
            half = np.nextafter(half, np.float16(np.inf))
    return float(half)


def on_fp16_grid(amax: float, qmax: float) -> float:
    """``amax`` raised to the smallest range whose scale ``float32(amax / qmax)`` is an FP16 value
    (``qmax``: the format's, 127 for INT8, 448 for FP8): ``qmax * s`` with ``s`` that scale rounded up
    to FP16, so ``float32(result / qmax) == s`` exactly (``s`` has 11 significant bits, ``qmax`` at
    most 9: the product and the quotient are exact in float64). A range whose scale FP16 cannot
    hold within its precision -- above 65504, or so deep in FP16's subnormal range (below 2^-14)
    that rounding it up would move it by more than 2^-10 of itself -- is returned unchanged: the
    FP16 conversion keeps that scale FP32 by the same criterion
    ([`scale_fits`][onnx_qat.formats.float_parts.scale_fits] with ``up=True``)."""
    amax = float(amax)
    scale = np.float32(amax / qmax)
    if float(scale) < amax / qmax:  # float32 rounded it down: the next float32 up
        scale = np.nextafter(scale, np.float32(np.inf))
    rounded = fp16_round_up(scale)
    if not (np.isfinite(rounded) and rounded > 0 and rounded - float(scale) <= FP16_EPS * float(scale)):
        return amax  # FP16 cannot hold it within its precision: the conversion keeps it FP32
    return qmax * rounded


def fp16_grid_ranges(ranges: Mapping[str, float], qmax: float) -> Dict[str, float]:
    """``{tensor: on_fp16_grid(amax, qmax)}`` of ``ranges``, in their order."""
    return {name: on_fp16_grid(amax, qmax) for name, amax in ranges.items()}
