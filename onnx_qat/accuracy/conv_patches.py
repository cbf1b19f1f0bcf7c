"""The input patches of a 2-D Conv as rows of a matrix product (im2col), for the passes that fit a Conv's
weights to its inputs (`onnx_qat.accuracy.reconstruct`).

A 2-D Conv with weight ``[C_out, C_in / group, kh, kw]`` computes, at each output position, the product
of the input patch under its kernel window (``C_in / group · kh · kw`` values per group) with the
weight's matrix ``[C_in / group · kh · kw, C_out / group]`` of that group. `conv_rows` gathers those
patches at chosen output positions, so a Conv's output there is ``rows @ matrix`` per group; the
layout of a row (channel-major, then kernel position) is the one ``weight.reshape(group, C_out / group,
-1)`` gives each output channel's weights. The Conv's ``strides``, ``dilations`` and explicit ``pads``
are honoured; ``auto_pad`` is not (callers leave such Convs alone).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np


def _window(node) -> Tuple[list, list, list]:
    """``(strides, dilations, pads)`` of a 2-D Conv node (ONNX defaults: 1, 1, 0)."""
    strides = (list(node.attr("strides", None) or [1, 1]) + [1, 1])[:2]
    dilations = (list(node.attr("dilations", None) or [1, 1]) + [1, 1])[:2]
    pads = list(node.attr("pads", None) or [0, 0, 0, 0])
    return strides, dilations, pads


def conv_output_size(xshape, node, wshape) -> Tuple[int, int]:
    """``(height, width)`` of the output of 2-D Conv ``node`` (a graph index's node, read through
    ``node.attr``) over an input of shape ``xshape`` ``[B, C, H, W]`` with a weight of shape ``wshape``
    ``[C_out, C_in / group, kh, kw]`` (the ONNX Conv operator's formula, explicit pads)."""
    kh, kw = wshape[2], wshape[3]
    (sh, sw), (dh, dw), pads = _window(node)
    oh = (xshape[2] + pads[0] + pads[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xshape[3] + pads[1] + pads[3] - dw * (kw - 1) - 1) // sw + 1
    return oh, ow


def conv_rows(x: np.ndarray, node, wshape, group: int, pick: np.ndarray) -> np.ndarray:
    """The input patches of 2-D Conv ``node`` over input ``x`` ``[B, C, H, W]`` at output positions
    ``pick`` (flat indices over batch, output height and output width: `conv_output_size`), as
    ``[group, rows, C_in / group · kh · kw]`` (float64). One gather over a strided window view of the
    padded input (no copy of the windows)."""
    b, c, height, width = x.shape
    kh, kw = wshape[2], wshape[3]
    (sh, sw), (dh, dw), pads = _window(node)
    oh, ow = conv_output_size(x.shape, node, wshape)
    bi, rest = np.divmod(pick, oh * ow)
    yi, xi = np.divmod(rest, ow)
    last = np.ascontiguousarray(np.moveaxis(x, 1, -1))  # [B, H, W, C]: each gathered piece contiguous
    if kh == kw == 1 and not any(pads):
        patches = last[bi, yi * sh, xi * sw][:, None, None, :]  # [R, 1, 1, C]
    else:
        xp = np.pad(last, ((0, 0), (pads[0], pads[2]), (pads[1], pads[3]), (0, 0)))
        span = (dh * (kh - 1) + 1, dw * (kw - 1) + 1)
        windows = np.lib.stride_tricks.sliding_window_view(xp, span, axis=(1, 2))[..., ::dh, ::dw]
        # windows: [B, OH, OW, C, kh, kw]
        patches = np.moveaxis(windows, 3, -1)[bi, yi * sh, xi * sw]  # [R, kh, kw, C]
    r = patches.shape[0]
    patches = patches.reshape(r, kh * kw, group, c // group).transpose(2, 0, 3, 1)  # [group, R, C/g, kh·kw]
    return patches.reshape(group, r, -1).astype(np.float64)


__all__ = ["conv_rows", "conv_output_size"]
