"""Sequential reconstruction of INT8 weighted ops on the quantized model's own inputs.

Each weighted op's INT8 weights (and its float bias) are chosen so that its output, computed from the
input it gets **in the Q/DQ model** (every op before it already quantized and already reconstructed,
its own input quantized), comes closest to its output in the float model on the calibration data:

``min over Ŵ on the INT8 grid, b̂:  Σ_rows ‖x̃ Ŵ + b̂ − (x W + b)‖²``

(``x`` the float model's input of the op, ``x̃`` the Q/DQ model's). This is the asymmetric
reconstruction of AdaRound (Nagel et al., "Up or Down? Adaptive Rounding for Post-Training
Quantization", ICML 2020, section 5: the quantized model's input, the float model's output) done in
graph order as BRECQ (Li et al., ICLR 2021) and QDrop (Wei et al., ICLR 2022) do, so that each op
corrects the error the ops before it left, activation quantization included, and no op corrects an
error an op before it has already removed. Instead of learned rounding, each op is solved in closed
form from the Gram matrices of sampled rows: the least-squares weights
``W* = (H + λI)⁻¹ (x̃ᵀ y + λ W)`` with ``H = x̃ᵀ x̃`` over the centered rows (``y = x W`` the float
output; a ridge towards the float weights, ``λ`` = `RIDGE` times ``H``'s mean diagonal), put on the
op's INT8 grid by GPTQ's error-compensated rounding (Frantar et al., ICLR 2023, Algorithm 1, with
``H + λI`` as its Hessian: reduction row by reduction row, each row's rounding error spread over the
rows not rounded yet, which lowers ``‖x̃ Q − y‖² + λ‖Q − W‖²`` below rounding ``W*`` to nearest;
``rounding="nearest"`` rounds ``W*`` to nearest), then the bias that makes the mean output match. The
grid is the one round to nearest uses (the Q/DQ model's per-output-channel weight scale), so the
placement, the scales and the inserter are unchanged: only which integer each weight takes and the
float biases differ. Measured with ``--optimize accuracy`` (judged / unseen inputs; 2026-11-27,
load average 6-7), GPTQ's rounding against rounding ``W*`` to nearest: the trained MiniLM encoder
(`tools/minilm.py`) 0.9903 / 0.9901 against 0.9898 / 0.9895; the PP-OCRv4 recognizer 0.9901 /
0.9922 against 0.9833 / 0.9912; its detector 0.9924 / 0.9772 against 0.9928 / 0.9763; the step's
CPU time 31 s against 26 s on the recognizer. Ordering the rows by ``H``'s diagonal (GPTQ's
"act order") and ridges of 0.3 or 3 did not raise MiniLM's judged cosine (0.9902, 0.9889, 0.9901).
Fitting every op on the inputs of a Q/DQ model whose earlier ops were not yet fitted (all ops at
once) over-corrects: cosine 0.55.

With ``weights=False`` no weight is fitted: every op keeps its round-to-nearest integers and only its
bias takes the mean output shift on the Q/DQ model's own input (method ``bias``), which a few rows
estimate well where a weight fit cannot be made: the empirical bias correction of Nagel et al.
("Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019, section 4.2),
computed in graph order on the Q/DQ model's inputs, so each op takes in the error of the ops before
it (`onnx_qat.accuracy.optimize`'s ``bias`` step, where the weight fits do not pay). Giving the ops
with too few rows for a weight fit this correction inside the full pass was measured and not kept:
on the PP-OCRv4 recognizer it raised the judged lines (0.9833 -> 0.9897) and lowered the unseen ones
(0.9912 -> 0.9899).

The Q/DQ model is run once, in pieces: the node list is cut before each op, and each piece runs on
the tensors the pieces before it left (so every op's input is computed after the ops before it were
reconstructed, at the cost of one run of the model in all). An op keeps round to nearest (and its
bias) when its layout is not handled (a ConvTranspose, a Conv that is not 2-D or uses ``auto_pad``,
a Gemm with ``transA``, a weight not quantized per output channel), when the reconstruction does not
lower its output error on the calibration rows (the residuals on the sampled rows themselves,
`_Residuals`, not the expanded square of the Gram matrices, which cancels at the small errors that
decide), or when it has fewer sampled rows than `MIN_ROWS`
times its reduction size (the fit would then fit the rows). Each op gets a record. A
Q/DQ graph that is not topologically sorted or holds subgraphs is left alone (one record says why).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .constants import private, read_constant, sole_consumer, write_constant

logger = logging.getLogger(__name__)

#: How the fitted weights are put on the INT8 grid (`reconstruct`'s ``rounding``).
ROUNDINGS = ("gptq", "nearest")
#: Ridge towards the float weights, as a share of the mean diagonal of ``H`` (also GPTQ's damping).
RIDGE = 1.0
#: Sampled rows needed per reduction row of an op's weight for its fit.
MIN_ROWS = 4
#: Rows (output positions) sampled per op, over all samples (fixed seed).
MAX_ROWS = 2048
#: Calibration samples used at most (the first ones).
MAX_SAMPLES = 32
QMAX = 127.0


class _Op:
    """One weighted op of the Q/DQ model to reconstruct."""

    def __init__(self, node, position: int, weight_q: str, scale: np.ndarray, axis: int, float_input: str,
                 bias: Optional[str]):
        self.node, self.position = node, position
        self.weight_q, self.scale, self.axis = weight_q, scale, axis
        self.float_input, self.bias = float_input, bias
        self.kind = "conv" if node.op_type == "Conv" else "matmul"
        self.transposed = node.op_type == "Gemm" and bool(int(node.attr("transB", 0) or 0))
        self.group = int(node.attr("group", 1) or 1) if self.kind == "conv" else 1

    def matrices(self, w: np.ndarray) -> np.ndarray:
        """A weight as ``[groups, K, N]``."""
        if self.kind == "conv":
            n = w.shape[0] // self.group
            return w.reshape(self.group, n, -1).transpose(0, 2, 1)
        return (w.T if self.transposed else w)[None]

    def from_matrices(self, mats: np.ndarray, shape) -> np.ndarray:
        if self.kind == "conv":
            return mats.transpose(0, 2, 1).reshape(shape)
        return mats[0].T if self.transposed else mats[0]

    def rows(self, x: np.ndarray, shape, pick) -> np.ndarray:
        """``[groups, rows, K]`` float32 rows of input ``x`` at positions ``pick``."""
        from .conv_patches import conv_rows

        if self.kind == "conv":
            return np.ascontiguousarray(conv_rows(x, self.node, shape, self.group, pick), np.float32)
        flat = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        return flat[pick][None]

    def picks(self, xshape, wshape, rng) -> np.ndarray:
        if self.kind == "conv":
            from .conv_patches import conv_output_size

            oh, ow = conv_output_size(xshape, self.node, wshape)
            total = xshape[0] * oh * ow
        else:
            total = int(np.prod(xshape[:-1]))
        return np.sort(rng.choice(total, size=MAX_ROWS, replace=False)) if total > MAX_ROWS \
            else np.arange(total)


def _supported(node, wshape=None) -> str:
    """Why ``node``'s weight (of shape ``wshape`` when known) keeps round to nearest ('' when it can be
    reconstructed here)."""
    if node.op_type == "Conv":
        if wshape is not None and len(wshape) != 4:  # the patches are a 2-D Conv's
            return "not a 2-D Conv"
        if (node.attr("auto_pad", b"NOTSET") or b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return "auto_pad"
        return ""
    if node.op_type in ("MatMul", "Gemm"):
        if node.op_type == "Gemm" and int(node.attr("transA", 0) or 0):
            return "transA"
        if wshape is not None and len(wshape) != 2:  # a batched weight's slices each meet other rows
            return f"a {len(wshape)}-D MatMul weight"
        return ""
    return f"{node.op_type} weights are rounded to nearest"


def _bias_of(index, node) -> Optional[Tuple[str, str]]:
    """``(bias tensor, node that adds it)`` of a weighted op whose bias can be rewritten."""
    if node.op_type in ("Conv", "Gemm") and len(node.inputs) > 2 and \
            private(index, node.inputs[2], node.name):
        return node.inputs[2], node.name
    if node.op_type == "MatMul":
        add = sole_consumer(index, node.outputs[0])
        if add is not None and add.op_type == "Add":
            other = [t for t in add.inputs if t != node.outputs[0]]
            if len(other) == 1 and private(index, other[0], add.name) and \
                    len(index.constant_shape(other[0]) or ()) == 1:
                return other[0], add.name
    return None


def _dq_weight(qindex, tensor: str):
    """``(int8 initializer, scale array, axis)`` behind the DequantizeLinear producing ``tensor``."""
    dq = qindex.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    proto = qindex.constant_proto(dq.inputs[0])
    if proto is None or proto.data_type != onnx.TensorProto.INT8:
        return None
    zero = read_zero(qindex, dq.inputs[2] if len(dq.inputs) > 2 else "")
    if zero:
        return None
    scale = numpy_helper.to_array(qindex.constant_proto(dq.inputs[1]))
    axis = dq.attr("axis", 1)
    return dq.inputs[0], np.asarray(scale, np.float32), int(1 if axis is None else axis)


def read_zero(qindex, tensor: str) -> bool:
    """True when ``tensor`` (a zero point) holds a non-zero value."""
    if not tensor:
        return False
    proto = qindex.constant_proto(tensor)
    return proto is None or bool(np.any(numpy_helper.to_array(proto)))


def reconstruct(float_model: onnx.ModelProto, qdq: onnx.ModelProto, placement, data, *,
                batch_size: int = 16, ridge: float = RIDGE, seed: int = 0,
                only=None, weights: bool = True, rounding: str = "gptq") -> Tuple[Tuple[dict, ...], dict]:
    """Reconstruct the INT8 weighted ops of ``qdq`` (built from ``float_model``, a private copy edited in
    place; same node names) on the first `MAX_SAMPLES` samples of ``data``.

    Returns ``(records, ranges)``: one record per op (``node``, ``rows``, ``method`` ``reconstructed``,
    ``bias`` (integers rounded to nearest, bias corrected: `changed` counts both) or ``rtn``, the
    relative output errors on the sampled rows ``rtn_error`` and ``error``, ``reason`` when the
    weights keep round to nearest) and ``{weight: WeightRange}`` of the weights changed (the
    per-channel ranges that give the Q/DQ model's scales back), for the ScaleTable, so the inserter
    stores exactly the integers chosen. ``only``: node names to reconstruct (default: every quantized
    weighted op). ``weights=False``: no weight is fitted; every op with a bias gets its bias corrected
    (``ranges`` is then empty: the edited biases are in ``float_model``). ``rounding``: how the fitted
    weights go onto the INT8 grid, one of `ROUNDINGS` (``gptq``, the default: error-compensated;
    ``nearest``: each weight to its nearest integer).
    """
    from ..errors import ConfigError
    from ..io.data import load_data
    from ..graph.index import GraphIndex
    from ..runtime.sessions import make_session
    from ..scales import WeightRange

    from .cuts import CutPlan

    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    if not CutPlan.usable(qdq):  # pieces need a sorted node list without subgraphs
        why = "the Q/DQ graph is not sorted or holds subgraphs: it cannot be run in pieces"
        return ({"node": None, "method": "rtn", "reason": why},), {}
    findex, qindex = GraphIndex(float_model), GraphIndex(qdq)
    wanted = set(only) if only is not None else None
    ops: List[_Op] = []
    records: List[dict] = []
    weight_of: Dict[str, str] = {}
    for mark in placement.weights:
        if mark.input_index != 1 or (wanted is not None and mark.node not in wanted):
            continue
        fnode, qnode = findex.by_name.get(mark.node), qindex.by_name.get(mark.node)
        if fnode is None or qnode is None or mark.tensor in weight_of.values():
            continue
        why = _supported(fnode, findex.constant_shape(mark.tensor))
        found = None if why else _dq_weight(qindex, qnode.inputs[1])
        if not why and (found is None or len(findex.consumers(mark.tensor)) != 1
                        or read_constant(findex, mark.tensor) is None):
            why = "weight shared, not a float32 constant, or not stored as INT8"
        if not why and found[1].ndim and found[2] % read_constant(findex, mark.tensor).ndim != \
                (mark.axis if mark.axis is not None else -1) % read_constant(findex, mark.tensor).ndim:
            why = "weight not per output channel"
        if why:
            records.append({"node": mark.node, "method": "rtn", "reason": why})
            continue
        bias = _bias_of(findex, fnode)
        if not weights and bias is None:
            records.append({"node": mark.node, "method": "rtn", "reason": "no bias to correct"})
            continue
        ops.append(_Op(qnode, qnode.position, found[0], found[1], found[2], fnode.inputs[0],
                       None if bias is None else bias[0]))
        weight_of[mark.node] = mark.tensor
    if not ops:
        return tuple(records), {}
    ops.sort(key=lambda op: op.position)

    dataset = load_data(data, float_model, what="calibration data")
    feeds, taken = [], 0
    for feed in dataset.batches(batch_size):
        feeds.append(feed)
        taken += len(np.asarray(next(iter(feed.values())))) if feed and not dataset.unbatched else 1
        if taken >= MAX_SAMPLES:
            break
    graph_inputs = {i.name for i in float_model.graph.input}
    fetched = sorted({op.float_input for op in ops} - graph_inputs)
    fsession = make_session(float_model, extra_outputs=fetched, spin=False)
    names = fetched or [fsession.get_outputs()[0].name]
    float_inputs: Dict[str, List[np.ndarray]] = {t: [] for t in fetched}
    for feed in feeds:
        for name, value in zip(names, fsession.run(names, {k: v for k, v in feed.items()})):
            if name in float_inputs:
                float_inputs[name].append(value)
    del fsession
    for t in list(float_inputs):
        float_inputs[t] = np.concatenate(float_inputs[t]) if len(feeds) > 1 else float_inputs[t][0]
    for t in graph_inputs & {op.float_input for op in ops}:
        float_inputs[t] = np.concatenate([np.asarray(f[t]) for f in feeds])

    pieces = _Pieces(qdq, [op.position for op in ops])
    state = [dict(f) for f in feeds]
    rng = np.random.default_rng(seed)
    ranges = {}
    for op in ops:
        pieces.advance(op.position, state, qindex)
        xq = np.concatenate([s[op.node.inputs[0]] for s in state]) if len(state) > 1 \
            else state[0][op.node.inputs[0]]
        xf = float_inputs[op.float_input]
        weight = read_constant(findex, weight_of[op.node.name])
        record = {"node": op.node.name, "method": "rtn"}
        records.append(record)
        pick = op.picks(xq.shape, weight.shape, rng)
        result = _fit(op, weight, None if op.bias is None else read_constant(findex, op.bias),
                      op.rows(xq, weight.shape, pick), op.rows(xf, weight.shape, pick), ridge, record,
                      weights, rounding)
        if result is None:
            continue
        ints, bias = result
        if ints is None:
            record["method"] = "bias"
            _write_bias(findex, qindex, op.bias, bias, state)
            continue
        record["method"] = "reconstructed"
        qproto = qindex.constant_proto(op.weight_q)
        qproto.CopyFrom(numpy_helper.from_array(ints.astype(np.int8), qproto.name))
        scale_b = op.scale.reshape([-1 if i == op.axis else 1 for i in range(ints.ndim)]) \
            if op.scale.ndim else op.scale
        dequantized = ints.astype(np.float32) * scale_b
        write_constant(findex, weight_of[op.node.name], dequantized)
        for s in state:  # the weight's DequantizeLinear ran in an earlier piece: its output is kept
            if op.node.inputs[1] in s:
                s[op.node.inputs[1]] = dequantized
        if bias is not None:
            _write_bias(findex, qindex, op.bias, bias, state)
        amax = np.where(op.scale > 0, op.scale.astype(np.float64) * QMAX, 0.0)
        ranges[weight_of[op.node.name]] = WeightRange(op.axis, tuple(float(v) for v in amax.reshape(-1)))
        pieces.refresh(qdq)
    logger.info("reconstruct: %d of %d ops, %d more with their bias corrected", len(ranges), len(ops),
                sum(r.get("method") == "bias" for r in records))
    return tuple(records), ranges


def changed(records) -> int:
    """How many ops the records of `reconstruct` say were changed (weights fitted or bias corrected)."""
    return sum(r.get("method") in ("reconstructed", "bias") for r in records)


def _write_bias(findex, qindex, name: str, bias: np.ndarray, state) -> None:
    """``name`` set to ``bias`` in the float model, in the Q/DQ model, and in the tensors kept from an
    earlier piece (a Constant node's output)."""
    write_constant(findex, name, bias)
    if qindex.constant_proto(name) is not None:
        write_constant(qindex, name, bias)
    for s in state:
        if name in s:
            s[name] = bias


def _fit(op: _Op, weight, bias, xq, xf, ridge: float, record: dict, weights: bool = True,
         rounding: str = "gptq"):
    """The INT8 integers and bias of ``op``, see the module docstring: None to keep round to nearest
    and the bias; ``(None, bias)`` to keep round to nearest with a corrected bias. The fit is computed
    from the Gram matrices of the sampled rows (float32 products), the output errors that decide
    whether it is kept from the residuals on those rows (`_Residuals`, float64)."""
    g, rows, k = xq.shape
    record["rows"] = int(rows)
    mats = op.matrices(weight).astype(np.float64)  # [g, K, N]
    n = mats.shape[2]
    scale = op.scale.astype(np.float64).reshape(g, n) if op.scale.ndim else np.full((g, n), float(op.scale))
    scale = np.where(scale > 0, scale, 1.0)
    if weights and rows < MIN_ROWS * k:
        record["reason"] = f"{rows} sampled rows for {k} reduction rows"
        return None
    if not weights:
        if bias is None:
            return None
        nearest = np.clip(np.rint(mats / scale[:, None, :]), -QMAX, QMAX) * scale[:, None, :]
        return None, _mean_matched(bias, mats, nearest, xq.astype(np.float64).mean(axis=1),
                                   xf.astype(np.float64).mean(axis=1))
    xqt = xq.transpose(0, 2, 1)
    h = np.matmul(xqt, xq).astype(np.float64)  # Σ x̃ᵀx̃  [g, K, K]
    hqf = np.matmul(xqt, xf).astype(np.float64)  # Σ x̃ᵀx
    mean_q = xq.astype(np.float64).mean(axis=1)  # [g, K]
    mean_f = xf.astype(np.float64).mean(axis=1)
    if bias is not None:  # centered rows: the bias takes the mean
        h = h - rows * mean_q[:, :, None] * mean_q[:, None, :]
        hqf = hqf - rows * mean_q[:, :, None] * mean_f[:, None, :]
    cross = np.matmul(hqf, mats)  # x̃ᵀ y
    residuals = _Residuals(xq, xf, mats, scale, (mean_q, mean_f) if bias is not None else None)
    error, signal = residuals.error, residuals.signal

    diag = np.einsum("gkk->gk", h)
    lam = ridge * np.maximum(diag.mean(axis=1), 1e-30)[:, None, None]
    regularized = h + lam * np.eye(k)[None]
    solved = np.linalg.solve(regularized, cross + lam * mats)
    if rounding == "gptq":
        ints = _compensated(solved, regularized, scale)
    else:
        ints = np.clip(np.rint(solved / scale[:, None, :]), -QMAX, QMAX)
    nearest = np.clip(np.rint(mats / scale[:, None, :]), -QMAX, QMAX)
    rtn = error(nearest)
    new = residuals.changed_error(ints, nearest, rtn)
    if bias is not None:  # round to nearest keeps its own bias: its error includes the mean shift
        shift = np.einsum("gk,gkn->gn", mean_q, nearest * scale[:, None, :]) - \
            np.einsum("gk,gkn->gn", mean_f, mats)
        rtn += float(np.sum(shift * shift)) * rows
    record.update(rtn_error=rtn / signal, error=new / signal)
    if not new < rtn:
        record["reason"] = "the reconstruction did not lower the output error on the sampled rows"
        return None
    new_bias = None if bias is None else _mean_matched(bias, mats, ints * scale[:, None, :], mean_q, mean_f)
    return op.from_matrices(ints, weight.shape), new_bias


class _Residuals:
    """The output errors of an op's candidate weights on its sampled rows, from the residuals
    themselves: ``Σ ‖x̃ Q − y‖²`` (``y = x W``, both sides' rows centered when the op has a bias),
    each residual formed in float64 before it is squared. The expanded square the Gram matrices
    give, ``‖y‖² − 2 Qᵀx̃ᵀy + Qᵀx̃ᵀx̃Q``, cancels where the error is a small share of the signal:
    from float32 Gram matrices (and centering a large mean out of them) it went negative, or off by
    orders of magnitude, at errors of 1e-8 to 1e-5 of the signal on built ops, errors of the size
    an op whose weights are near their INT8 grid has."""

    def __init__(self, xq, xf, mats, scale, means=None):
        self.xq = xq.astype(np.float64)  # [g, rows, K]
        xf = xf.astype(np.float64)
        if means is not None:  # the bias takes the mean: centered rows
            self.xq -= means[0][:, None, :]
            xf -= means[1][:, None, :]
        self.scale = scale[:, None, :]  # [g, 1, N]
        self.target = np.matmul(xf, mats)  # y on the rows, [g, rows, N]
        self.signal = max(float(np.sum(np.square(self.target))), 1e-30)
        self._columns = None  # each output channel's error under the integers `error` saw last

    def _column_errors(self, q) -> np.ndarray:
        diff = np.matmul(self.xq, q * self.scale) - self.target
        return np.einsum("grn,grn->gn", diff, diff)

    def error(self, q) -> float:
        """``Σ ‖x̃ (q · scale) − y‖²`` over the rows (``q`` the integers ``[g, K, N]``)."""
        self._columns = self._column_errors(q)
        return float(np.sum(self._columns))

    def changed_error(self, q, before, total: float) -> float:
        """`error` of ``q`` given the last `error`, ``total``, of ``before``: only the output channels
        whose integers differ are computed again (each channel's residual reads its own column)."""
        differ = np.any(q != before, axis=1)  # [g, N]
        if not differ.any():
            return total
        groups = np.flatnonzero(differ.any(axis=1))
        cols = np.flatnonzero(differ[groups].any(axis=0))
        sub = q[np.ix_(groups, np.arange(q.shape[1]), cols)]
        diff = np.matmul(self.xq[groups], sub * self.scale[np.ix_(groups, [0], cols)]) - \
            self.target[np.ix_(groups, np.arange(self.target.shape[1]), cols)]
        columns = self._columns.copy()
        columns[np.ix_(groups, cols)] = np.einsum("grn,grn->gn", diff, diff)
        return float(np.sum(columns))


#: Rows rounded before their error is spread over all the rows after them at once (GPTQ's lazy
#: batch; the result does not depend on it).
LAZY_BLOCK = 128


def _compensated(target: np.ndarray, hessian: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The integers of ``target [g, K, N]`` on the grid ``scale [g, N]`` (clipped to ±`QMAX`), rounded
    reduction row by reduction row, each row's rounding error spread over the rows not rounded yet
    through the inverse of ``hessian [g, K, K]`` (GPTQ's loop, Frantar et al., ICLR 2023, Algorithm 1,
    as `onnx_qat.formats.gptq.compensated_rounding` runs it for one matrix; here every group at once).
    With ``hessian`` the regularized Gram matrix of `_fit`, this lowers ``‖x̃ Q − y‖² + λ‖Q − W‖²``
    (``Q`` the rounded weights) below rounding ``target``, its minimizer, to nearest. A ``hessian``
    that is not positive definite in float64 gets round to nearest."""
    g, k, n = target.shape
    w = np.array(target, np.float64)
    try:
        inverse = np.linalg.inv(hessian)
        upper = np.linalg.cholesky((inverse + inverse.transpose(0, 2, 1)) / 2).transpose(0, 2, 1)
    except np.linalg.LinAlgError:  # not positive definite in float64 (no ridge): round to nearest
        return np.clip(np.rint(w / scale[:, None, :]), -QMAX, QMAX)
    ints = np.empty_like(w)
    for start in range(0, k, LAZY_BLOCK):
        end = min(start + LAZY_BLOCK, k)
        errors = np.empty((g, end - start, n))
        for j in range(start, end):
            q = np.clip(np.rint(w[:, j] / scale), -QMAX, QMAX)
            ints[:, j] = q
            errors[:, j - start] = (w[:, j] - q * scale) / upper[:, j, j][:, None]
            w[:, j + 1:end] -= upper[:, j, j + 1:end][:, :, None] * errors[:, j - start][:, None, :]
        w[:, end:] -= np.matmul(upper[:, start:end, end:].transpose(0, 2, 1), errors)
    return ints


def _mean_matched(bias, mats, quantized, mean_q, mean_f) -> np.ndarray:
    """The bias that gives the op's mean output on the Q/DQ model's input (mean ``mean_q``, weights
    ``quantized``, ``[g, K, N]``) the float op's mean output (``mean_f``, ``mats``)."""
    g, _, n = mats.shape
    b = np.asarray(bias, np.float64).reshape(g, n)
    b = b + np.einsum("gk,gkn->gn", mean_f, mats) - np.einsum("gk,gkn->gn", mean_q, quantized)
    return b.reshape(np.shape(bias)).astype(np.float32)


class _Pieces:
    """The Q/DQ model's node list cut before given positions; `advance` runs the nodes up to the next
    cut on the tensors kept so far."""

    def __init__(self, qdq: onnx.ModelProto, cuts):
        self.model = qdq
        self.nodes = list(qdq.graph.node)
        self.cuts = sorted(set(cuts))
        self.at = 0
        last: Dict[str, int] = {}
        for p, node in enumerate(self.nodes):
            for name in node.input:
                if name:
                    last[name] = p
        for out in qdq.graph.output:
            last[out.name] = len(self.nodes)
        self.last = last
        self.initializers = {t.name: t for t in qdq.graph.initializer}

    def refresh(self, qdq) -> None:
        self.initializers = {t.name: t for t in qdq.graph.initializer}

    def advance(self, cut: int, state, qindex) -> None:
        """Run nodes ``[self.at, cut)`` and keep the tensors read at or after ``cut``."""
        from ..runtime.sessions import make_session

        if cut <= self.at:
            return
        nodes = self.nodes[self.at:cut]
        produced = {o for nd in nodes for o in nd.output if o}
        read = {i for nd in nodes for i in nd.input if i}
        have = set(state[0])
        inputs = [t for t in sorted(read) if t in have]
        outputs = [t for t in sorted(produced) if self.last.get(t, -1) >= cut]
        if outputs:
            graph = helper.make_graph(
                nodes, "piece", [helper.make_tensor_value_info(t, _elem(state[0][t]), None) for t in inputs],
                [onnx.ValueInfoProto(name=t) for t in outputs],
                [self.initializers[t] for t in sorted(read) if t in self.initializers])
            model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
            model.ir_version = self.model.ir_version
            session = make_session(model, spin=False)
            for s in state:
                values = session.run(outputs, {t: s[t] for t in inputs})
                s.update(zip(outputs, values))
        for s in state:
            for t in [t for t in s if self.last.get(t, -1) < cut]:
                del s[t]
        self.at = cut


def _elem(value) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)


__all__ = ["reconstruct", "changed", "ROUNDINGS", "RIDGE", "MIN_ROWS", "MAX_ROWS", "MAX_SAMPLES"]
