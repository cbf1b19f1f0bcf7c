"""Error-compensated INT8 weight rounding (GPTQ-style) for Conv, Gemm and MatMul weights.

Round to nearest picks each weight's INT8 value on its own. GPTQ (Frantar et al., ICLR 2023,
Algorithm 1; the loop is `onnx_qat.formats.gptq.compensated_rounding`, shared with the INT4 and FP8
roundings) rounds the reduction axis one row at a time and spreads each row's rounding error over
the rows not rounded yet, weighted by the inverse of ``H = Σ xᵀx`` of the layer's input on the
calibration data, so that the layer's output ``x W`` moves least. Here the grid is INT8 with the
per-output-channel scale round to nearest uses (``max |w| / 127``), so the scales, the placement
and the inserter are unchanged: only which integer each weight takes differs.

A Conv is a matrix product over its input patches: its Hessian is built from patches (im2col) at
up to `MAX_ROWS` sampled output positions per batch, one ``[K, K]`` matrix per group
(``K = C_in / group · kh · kw``; a depthwise Conv has one 9×9 matrix per channel for a 3×3
kernel). Activations are the float model's.

A weight keeps round to nearest when its input has fewer than
`onnx_qat.formats.gptq.MIN_ROWS_PER_CHANNEL` calibration rows per reduction row (GPTQ would fit
those rows), when GPTQ does not lower the output error on the calibration rows, when its layout is
not handled (ConvTranspose, a Conv that is not 2-D or uses ``auto_pad``, a per-tensor weight), or
once the work bound is spent (``max_work`` multiply-adds of the rounding loops, counted per weight
as ``groups · K² · (K + N)``, in graph order; a bound on work, never on time, so the same inputs
give the same weights on any machine load). Each weight gets a record saying which and why.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

logger = logging.getLogger(__name__)

#: Patch rows sampled per batch from a Conv input for its Hessian (fixed seed).
MAX_ROWS = 4096
#: Default bound on the rounding's work, in multiply-adds of its loops (``groups · K² · (K + N)``
#: per weight; weights left over keep round to nearest). The PP-OCRv4 recognizer needs 1.1e9.
MAX_WORK = 1e10
#: INT8 weight range (rule 2: weights use [-127, 127]).
QMAX = 127.0


class _Layer:
    """One weight to round: its node, layout, and the Hessian collected so far."""

    def __init__(self, mark, node, weight: np.ndarray):
        self.mark, self.node, self.weight = mark, node, weight
        self.kind = "conv" if node.op_type == "Conv" else "matmul"
        self.transposed = node.op_type == "Gemm" and bool(int(node.attr("transB", 0) or 0))
        self.group = int(node.attr("group", 1) or 1) if self.kind == "conv" else 1
        self.hessian: Optional[np.ndarray] = None  # [groups, K, K]
        self.rows = 0

    def matrices(self) -> np.ndarray:
        """The weight as ``[groups, K, N]`` (N: output channels per group)."""
        w = self.weight
        if self.kind == "conv":
            cout = w.shape[0]
            n = cout // self.group
            return w.reshape(self.group, n, -1).transpose(0, 2, 1)
        return (w.T if self.transposed else w)[None]

    def from_matrices(self, mats: np.ndarray) -> np.ndarray:
        if self.kind == "conv":
            return mats.transpose(0, 2, 1).reshape(self.weight.shape)
        return mats[0].T if self.transposed else mats[0]

    def add(self, x: np.ndarray, rng: np.random.Generator) -> None:
        rows = _conv_rows(x, self.node, self.weight.shape, self.group, rng) if self.kind == "conv" \
            else np.asarray(x, np.float64).reshape(1, -1, x.shape[-1])
        h = np.matmul(rows.transpose(0, 2, 1), rows)  # BLAS, batched over groups
        self.hessian = h if self.hessian is None else self.hessian + h
        self.rows += rows.shape[1]


def conv_picks(xshape, node, wshape, rng) -> np.ndarray:
    """Up to `MAX_ROWS` output positions of a 2-D Conv over an input of shape ``xshape``, sampled
    without replacement (flat indices over batch, height and width; all of them when fewer)."""
    oh, ow = _out_size(xshape, node, wshape)
    total = xshape[0] * oh * ow
    return rng.choice(total, size=MAX_ROWS, replace=False) if total > MAX_ROWS else np.arange(total)


def _out_size(xshape, node, wshape):
    kh, kw = wshape[2], wshape[3]
    sh, sw = (list(node.attr("strides", None) or [1, 1]) + [1, 1])[:2]
    dh, dw = (list(node.attr("dilations", None) or [1, 1]) + [1, 1])[:2]
    pads = list(node.attr("pads", None) or [0, 0, 0, 0])
    oh = (xshape[2] + pads[0] + pads[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xshape[3] + pads[1] + pads[3] - dw * (kw - 1) - 1) // sw + 1
    return oh, ow


def conv_rows(x: np.ndarray, node, wshape, group: int, pick: np.ndarray) -> np.ndarray:
    """The input patches of a 2-D Conv at output positions ``pick`` (`conv_picks`) as
    ``[group, rows, C_in / group · kh · kw]`` (float64). One gather over a strided window view of the
    padded input (no copy of the windows)."""
    b, c, height, width = x.shape
    kh, kw = wshape[2], wshape[3]
    sh, sw = (list(node.attr("strides", None) or [1, 1]) + [1, 1])[:2]
    dh, dw = (list(node.attr("dilations", None) or [1, 1]) + [1, 1])[:2]
    pads = list(node.attr("pads", None) or [0, 0, 0, 0])
    oh, ow = _out_size(x.shape, node, wshape)
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


def _conv_rows(x: np.ndarray, node, wshape, group: int, rng) -> np.ndarray:
    """Sampled input patches of a 2-D Conv as ``[group, rows, C_in / group · kh · kw]`` (float64)."""
    return conv_rows(x, node, wshape, group, conv_picks(x.shape, node, wshape, rng))


def _supported(node, weight: np.ndarray, axis) -> str:
    """Why ``node``'s weight keeps round to nearest ('' when it can be rounded here)."""
    if node.op_type == "Conv":
        if weight.ndim != 4:
            return "not a 2-D Conv"
        if (node.attr("auto_pad", b"NOTSET") or b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return "auto_pad"
        return "" if axis == 0 else "weight not per output channel"
    if node.op_type in ("MatMul", "Gemm"):
        if weight.ndim != 2 or (node.op_type == "Gemm" and int(node.attr("transA", 0) or 0)):
            return "weight not a 2-D matrix B"
        transposed = node.op_type == "Gemm" and bool(int(node.attr("transB", 0) or 0))
        return "" if axis == (0 if transposed else 1) else "weight not per output channel"
    return f"{node.op_type} weights are rounded to nearest"


def round_int8(model, placement, data, *, input_amax: Optional[Mapping[str, float]] = None,
               max_work: float = MAX_WORK, batch_size: int = 16, skip=(), seed: int = 0,
               progress: bool = False, observed=None,
               damp: Optional[float] = None) -> Tuple[Tuple[dict, ...], dict]:
    """Round the INT8 weights placement quantizes in ``model`` (a private float copy, edited in place)
    with GPTQ on the Hessians of their inputs over ``data``.

    Returns ``(records, ranges)``: one record per weight (``weight``, ``node``, ``rows``, ``method``
    ``gptq`` or ``rtn``, the relative output errors on the calibration rows ``rtn_error`` and
    ``gptq_error``, ``reason`` when round to nearest is kept) and ``{weight: WeightRange}`` of the
    weights rounded here (their per-channel ``max |w|`` before rounding), for the ScaleTable, so the
    inserter stores exactly the integers chosen. Weights named in ``skip`` are left alone.

    ``input_amax`` (``{activation tensor: amax}``, e.g. the calibrated ScaleTable's activations)
    adds each input's INT8 rounding noise to its Hessian: ``H = Σ xᵀx + rows · (amax/127)² / 12 · I``,
    the second moments of the quantized input ``x + n``. Without it GPTQ moves the rounding error into
    the directions the float inputs do not reach, where the input's own quantization noise then meets
    it: on the PP-OCRv4 recognizer the GPTQ weights alone gave output cosine 0.998 (round to nearest
    0.989), but with INT8 activations 0.937 against round to nearest's 0.966.

    ``observed`` (a model with the same node names, e.g. the Q/DQ model) is run instead of ``model``
    to collect the inputs: each weighted op's input 0 there (its dequantized input in a Q/DQ model).
    ``damp``: share of the mean Hessian diagonal added to it (default GPTQ's 0.01). Larger values
    spread less of each row's error; on the PP-OCRv4 recognizer with INT8 activations the output
    cosine moved without a trend (0.954 / 0.958 / 0.961 / 0.974 / 0.966 / 0.974 for 0.1 / 1 / 3 / 10 /
    30 / 100; round to nearest 0.967), so the default is kept.
    """
    from ..formats.encoding import ZERO_CHANNEL_SCALE
    from ..formats.gptq import DAMP, MIN_ROWS_PER_CHANNEL, compensated_rounding, output_error
    from ..graph.index import GraphIndex
    from ..scales import WeightRange
    from .equalize import read_constant, write_constant

    spent = 0.0
    index = GraphIndex(model)
    layers: Dict[str, _Layer] = {}
    records: List[dict] = []
    for mark in placement.weights:
        node = index.by_name.get(mark.node)
        if node is None or mark.tensor in layers or mark.tensor in skip:
            continue
        if mark.input_index != 1 or len(index.consumers(mark.tensor)) != 1:
            records.append({"weight": mark.tensor, "node": mark.node, "method": "rtn",
                            "reason": "weight shared or not input 1"})
            continue
        weight = read_constant(index, mark.tensor)
        why = "not a float32 constant" if weight is None else _supported(node, weight, mark.axis)
        if why:
            records.append({"weight": mark.tensor, "node": mark.node, "method": "rtn", "reason": why})
            continue
        layers[mark.tensor] = _Layer(mark, node, weight)
    if not layers:
        return tuple(records), {}
    _collect(model if observed is None else observed, layers, data, batch_size, seed, progress)
    ranges = {}
    for tensor, layer in layers.items():
        record = {"weight": tensor, "node": layer.node.name, "rows": layer.rows, "method": "rtn"}
        records.append(record)
        mats = layer.matrices().astype(np.float64)
        k = mats.shape[1]
        amax_in = (input_amax or {}).get(layer.node.inputs[0])
        if amax_in and layer.hessian is not None:  # the input's INT8 noise, uniform: step² / 12
            noise = layer.rows * (float(amax_in) / QMAX) ** 2 / 12.0
            layer.hessian = layer.hessian + noise * np.eye(k)[None]
        if layer.rows < MIN_ROWS_PER_CHANNEL * k:
            record["reason"] = f"{layer.rows} calibration rows for {k} reduction rows"
            continue
        work = mats.shape[0] * k * k * (k + mats.shape[2])
        if spent + work > max_work:
            record["reason"] = f"work bound of {max_work:g} multiply-adds spent"
            continue
        spent += work
        amax = np.max(np.abs(mats), axis=1)  # [groups, N]: the per-output-channel range of RTN
        scale = (amax / QMAX).astype(np.float32).astype(np.float64)
        scale = np.where(scale > 0, scale, 1.0)
        rounded = np.empty_like(mats)
        nearest = np.clip(np.rint(mats / scale[:, None, :]), -QMAX, QMAX) * scale[:, None, :]
        rtn_err = gptq_err = 0.0
        total = 0.0
        for g in range(mats.shape[0]):
            s = scale[g]
            rounded[g] = compensated_rounding(
                mats[g], layer.hessian[g], k,
                lambda _g, _b, _h, s=s: (lambda row: np.clip(np.rint(row / s), -QMAX, QMAX) * s),
                DAMP if damp is None else damp)
            w, h = mats[g], layer.hessian[g]
            signal = float(np.sum(w * (h @ w)))
            total += signal
            rtn_err += output_error(w, nearest[g], h) * signal
            gptq_err += output_error(w, rounded[g], h) * signal
        total = max(total, 1e-30)
        record.update(rtn_error=rtn_err / total, gptq_error=gptq_err / total)
        if not gptq_err < rtn_err:
            record["reason"] = "GPTQ did not lower the output error on the calibration rows"
            continue
        record["method"] = "gptq"
        write_constant(index, tensor, layer.from_matrices(rounded).astype(np.float32))
        # an all-zero channel stays zero; its range is the inserter's own for such a channel
        amax = np.where(amax > 0, amax, ZERO_CHANNEL_SCALE * QMAX)
        ranges[tensor] = WeightRange(layer.mark.axis, tuple(float(v) for v in amax.reshape(-1)))
        logger.info("int8 gptq %s: relative output error %.3g (round to nearest) -> %.3g", tensor,
                    record["rtn_error"], record["gptq_error"])
    return tuple(records), ranges


def _collect(model, layers: Dict[str, _Layer], data, batch_size: int, seed: int, progress: bool) -> None:
    """Accumulate each layer's Hessian over the float model's activations on ``data``."""
    from ..io.data import load_data
    from ..runtime.sessions import make_session, run_batches

    readers = {n.name: n for n in model.graph.node}
    source = {t: readers[layer.node.name].input[0] for t, layer in layers.items()}
    inputs = sorted(set(source.values()))
    graph_inputs = {i.name for i in model.graph.input}
    fetched = [t for t in inputs if t not in graph_inputs]
    session = make_session(model, extra_outputs=fetched, spin=False)
    dataset = load_data(data, model, what="calibration data")
    rng = np.random.default_rng(seed)
    outputs = fetched or [session.get_outputs()[0].name]
    for feed, values in zip(dataset.batches(batch_size),
                            run_batches(session, dataset, batch_size=batch_size, outputs=outputs,
                                        progress=progress, desc="int8 rounding: activations")):
        for tensor, layer in layers.items():
            name = source[tensor]
            layer.add(np.asarray(values[name] if name in values else feed[name], np.float32), rng)


__all__ = ["round_int8", "conv_picks", "conv_rows", "MAX_ROWS", "MAX_WORK"]
