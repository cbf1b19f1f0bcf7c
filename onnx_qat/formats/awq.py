"""Activation-aware INT4 weight scales (AWQ-style), chosen on calibration data.

For a group of MatMul/Gemm weights ``W_i [K, N_i]`` that read the same activation ``x [.., K]``,
``x @ W = (x / s) @ (s * W)`` for any positive per-input-channel ``s``. Input channels where
``|x|`` is large matter most to the output, and scaling their weight rows up before rounding gives
them finer INT4 steps. The search tries ``s = mean|x|^alpha`` (normalised to a geometric mean of 1)
for ``alpha`` in 0, 0.05 ... 1 and keeps the one with the least relative output error
``sum_i ||x W_i - (x / s) Q(s W_i)||^2 / ||x W_i||^2`` on the calibration rows (``alpha = 0`` is
plain round-to-nearest, so the search never does worse than it on those rows). ``s`` multiplies
the weight rows; then each block's range is shrunk where that lowers its activation-weighted error
(`search_clip`), each block's scale is moved to the FP16 neighbour that reconstructs the block best
(`onnx_qat.formats.blockwise.fp16_block_amax`: FP16 float parts then store it unchanged), and the block
ranges go to the inserter through the ScaleTable. ``1 / s``
is folded into the op that produces ``x``:

* LayerNormalization with constant scale (and bias): both divided by ``s``;
* MatMul/Gemm with a constant weight (optionally followed by an Add of a constant bias): its
  output columns (and bias) divided by ``s``.

Otherwise (another reader of ``x``, or a producer that cannot absorb it, such as GELU or a
Reshape of attention heads) a float ``Mul`` by ``1 / s`` is inserted before the group's readers;
TensorRT runs it as a pointwise op in front of the weight-only GEMM. The edits are made to the
float model ``quantize`` owns,
before insertion; the caller's model is never touched.

Source: Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration" (MLSys 2024), Section 3.2 (per-channel scaling searched on activation statistics).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np

from .blockwise import dequantize_blocks, fp16_block_amax, quantize_blocks
from ..graph.index import GraphIndex
from ..placement.marks import Placement

logger = logging.getLogger(__name__)

#: alpha values tried (0 is round-to-nearest).
ALPHAS = tuple(np.round(np.linspace(0.0, 1.0, 21), 2))
#: Calibration rows (tokens or samples) kept per activation for the search.
MAX_ROWS = 1024


def apply_awq(model, index: GraphIndex, placement: Placement, data, block_size: int, *,
              progress: bool = False, batch_size: Optional[int] = None) -> Tuple[Tuple[dict, ...], dict]:
    """Search and apply AWQ scales for every group of INT4 weight marks; edits ``model``'s constants in
    place (``model`` is the private float copy [`onnx_qat.quantize`][onnx_qat.quantize.quantize] owns); then
    choose each block's clipping range (`search_clip`).

    Returns ``(records, ranges)``: one record per group (the activation, its weights, where ``1 / s``
    went and why, the chosen ``alpha``, the relative output errors of round-to-nearest, of the scaled
    weights and of the scaled and clipped weights on the calibration rows), and the block ranges
    ``{weight: WeightRange(axis, amax, block_size)}`` for the ScaleTable the inserter reads."""
    from ..scales import WeightRange

    groups = _groups(index, placement)
    if not groups:
        return (), {}
    folds = {x: _fold_target(index, x, nodes) for x, nodes in groups.items()}
    wanted = [x for x, (kind, _) in folds.items() if kind is not None]
    samples = _activation_rows(model, wanted, data, progress, batch_size) if wanted else {}
    records, muls, ranges = [], [], {}
    for x, nodes in groups.items():
        kind, why = folds[x]
        weights = [(n, _weight_matrix(index, n)) for n in nodes]
        record = {"activation": x, "weights": [n.inputs[1] for n in nodes],
                  "fold": kind, "reason": why}
        if kind is None:
            records.append({**record, "alpha": 0.0})
            continue
        rows = samples[x]
        alpha, scale, errors = search_scale(rows, [w for _, w in weights], block_size)
        record.update(alpha=alpha, rtn_error=errors[0.0], awq_error=errors[alpha])
        if alpha > 0:
            for node, matrix in weights:
                _set_weight_matrix(index, node, matrix * scale[:, None])
            if kind == "mul":
                muls.append((x, [n.name for n in nodes], (1.0 / scale).astype(np.float32)))
            else:
                _fold_inverse(index, x, kind, 1.0 / scale)
        scaled_rows = rows / scale if alpha > 0 else rows
        clipped, final = [], 0.0
        for node, matrix in weights:
            scaled = matrix * scale[:, None] if alpha > 0 else matrix
            amax = fp16_block_amax(scaled, search_clip(scaled, scaled_rows, block_size), 0, block_size)
            final += _relative_error(scaled_rows, scaled, amax, block_size) / len(weights)
            grid = amax.T if stored_transposed(node) else amax
            axis = 1 if grid is not amax else 0
            ranges[node.inputs[1]] = WeightRange(axis, tuple(float(v) for v in grid.reshape(-1)), block_size)
            clipped.append(float(np.mean(amax / np.maximum(_block_max(scaled, block_size), 1e-30))))
        record.update(clip_error=final, mean_clip=float(np.mean(clipped)))
        logger.info("awq %s: alpha %.2f, relative output error %.3g -> %.3g, clipped %.3g (%s)", x, alpha,
                    errors[0.0], errors[alpha], final, kind)
        records.append(record)
    _insert_muls(model, muls)  # last: it rebuilds the node list the index's protos point into
    return tuple(records), ranges


#: Fractions of a block's max |w| tried as its clipping range (1 keeps the max).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _block_max(matrix: np.ndarray, block_size: int) -> np.ndarray:
    k, n = matrix.shape
    return np.abs(matrix.reshape(k // block_size, block_size, n)).max(axis=1)


def search_clip(matrix: np.ndarray, rows: np.ndarray, block_size: int) -> np.ndarray:
    """Per block of ``matrix [K, N]`` (blocks along K), the clipping range ``r * max|w|`` (``r`` among
    `CLIP_RATIOS`) with the least output error of that block on the activation ``rows [n, K]``,
    ``E[(x_b . (Q(w_b) - w_b))^2] = e^T C_b e`` with ``C_b`` the block's activation second moments;
    returns the block amax grid ``[K / block_size, N]``.

    Source: Lin et al., AWQ (MLSys 2024), and its reference code's clipping search (a shrunk block
    range trades clipping of rare large weights for finer steps on the rest)."""
    k, n = matrix.shape
    groups = k // block_size
    blocks = matrix.reshape(groups, block_size, n).astype(np.float32)
    split = np.asarray(rows, np.float32).reshape(len(rows), groups, block_size)
    moments = np.einsum("rgb,rgc->gbc", split, split) / max(len(rows), 1)  # [groups, B, B]
    return clip_with_moments(blocks, moments)


def clip_with_moments(blocks: np.ndarray, moments: np.ndarray) -> np.ndarray:
    """`search_clip` on ``blocks [groups, B, N]`` with each block's activation second moments
    ``moments [groups, B, B]`` given: the block amax ``[groups, N]``."""
    blocks = np.asarray(blocks, np.float32)
    moments = np.asarray(moments, np.float32)
    top = np.abs(blocks).max(axis=1)
    best_err, best = np.full(top.shape, np.inf, np.float32), top.copy()
    for ratio in CLIP_RATIOS:
        amax = top * np.float32(ratio)
        scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)[:, None, :]
        e = np.clip(np.rint(blocks / scale), -8, 7) * scale - blocks
        err = np.einsum("gbn,gbc,gcn->gn", e, moments, e)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, amax, best)
    return np.where(best > 0, best, top)


def _relative_error(rows: np.ndarray, matrix: np.ndarray, amax: np.ndarray, block_size: int) -> float:
    ref = rows @ matrix
    q, scale = quantize_blocks(matrix, 0, block_size, amax)
    out = rows @ dequantize_blocks(q, scale, 0, block_size)
    return float(np.sum((out - ref) ** 2)) / max(float(np.sum(ref * ref)), 1e-30)


def search_scale(rows: np.ndarray, matrices: List[np.ndarray], block_size: int):
    """``(alpha, s, {alpha: relative error})`` of the best ``s = mean|x|^alpha`` for weights
    ``matrices`` (each ``[K, N]``, blocks along K) on activation ``rows [n, K]``."""
    rows = np.asarray(rows, np.float32)
    mean_abs = np.maximum(np.abs(rows).mean(axis=0), 1e-8)
    refs = [rows @ w for w in matrices]
    norms = [max(float(np.sum(r * r)), 1e-30) for r in refs]
    errors: Dict[float, float] = {}
    best = (np.inf, 0.0, np.ones_like(mean_abs))
    for alpha in ALPHAS:
        s = mean_abs ** alpha
        s = s / np.sqrt(s.max() * s.min())
        s = np.clip(s, 1e-4, 1e4).astype(np.float32)
        err = 0.0
        for w, ref, norm in zip(matrices, refs, norms):
            q, scale = quantize_blocks(w * s[:, None], 0, block_size)
            out = (rows / s) @ dequantize_blocks(q, scale, 0, block_size)
            err += float(np.sum((out - ref) ** 2)) / norm
        errors[float(alpha)] = err / len(matrices)
        if errors[float(alpha)] < best[0]:
            best = (errors[float(alpha)], float(alpha), s)
    return best[1], best[2], errors


# --------------------------------------------------------------------------- graph
def _groups(index: GraphIndex, placement: Placement) -> Dict[str, list]:
    """Activation tensor -> the marked MatMul/Gemm nodes reading it as input 0 (graph order); a weight
    folded through a Transpose or Reshape (not stored as it is used) is left to round to nearest."""
    groups: Dict[str, list] = {}
    for mark in placement.weights:
        node = index.by_name.get(mark.node)
        trans_a = node is not None and node.op_type == "Gemm" and int(node.attr("transA", 0) or 0)
        if node is None or mark.input_index != 1 or trans_a or not index.is_stored_constant(mark.tensor):
            continue
        groups.setdefault(node.inputs[0], []).append(node)
    return groups


def _fold_target(index: GraphIndex, x: str, nodes) -> Tuple[Optional[str], str]:
    """Where ``1 / s`` can go for activation ``x``: ``("layernorm" | "matmul", why)``, or
    ``(None, why)`` when nowhere (round-to-nearest is kept)."""
    readers = {n.name for n, _ in index.consumers(x)}
    if readers != {n.name for n in nodes} or x in index.graph_outputs:
        return "mul", "the activation has readers besides the quantized weights: 1/s in a Mul before them"
    producer = index.producer.get(x)
    if producer is None:
        return "mul", "the activation is a graph input: 1/s in a Mul before its readers"
    if producer.op_type == "LayerNormalization" and len(producer.inputs) >= 2 and \
            all(_private_constant(index, t, producer) for t in producer.inputs[1:3] if t):
        return "layernorm", f"1/s folded into LayerNormalization {producer.name!r}"
    if producer.op_type == "Add" and len(producer.inputs) == 2:
        consts = [t for t in producer.inputs if index.is_constant(t)]
        others = [t for t in producer.inputs if not index.is_constant(t)]
        if len(consts) == 1 and len(others) == 1 and _private_constant(index, consts[0], producer) and \
                len(index.consumers(others[0])) == 1 and _weighted_producer(index, others[0]) is not None:
            return "matmul", f"1/s folded into {_weighted_producer(index, others[0]).name!r} and its bias"
    if _weighted_producer(index, x) is not None:
        return "matmul", f"1/s folded into {producer.name!r}"
    return "mul", f"produced by {producer.op_type} {producer.name!r}, which cannot absorb 1/s: " \
                  "1/s in a Mul before the weights' nodes"


def _weighted_producer(index: GraphIndex, tensor: str):
    node = index.producer.get(tensor)
    if node is None or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    if not _private_constant(index, node.inputs[1], node):
        return None
    shape = index.constant_shape(node.inputs[1]) or ()
    if len(shape) != 2 or node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] and \
            not _private_constant(index, node.inputs[2], node):
        return None
    return node


def _private_constant(index: GraphIndex, tensor: str, node) -> bool:
    """``tensor`` is a float32 constant read only by ``node``."""
    proto = index.constant_proto(tensor) if index.is_stored_constant(tensor) else None
    return proto is not None and proto.data_type == 1 and \
        {n.name for n, _ in index.consumers(tensor)} == {node.name}


def _array(index: GraphIndex, tensor: str) -> np.ndarray:
    from ..io.models import tensor_array

    return np.array(tensor_array(index.constant_proto(tensor)), np.float32)


def _store(index: GraphIndex, tensor: str, values: np.ndarray) -> None:
    from onnx import numpy_helper

    proto = index.constant_proto(tensor)
    proto.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values, np.float32), proto.name))


def stored_transposed(node) -> bool:
    """Whether the node stores its weight as ``[N, K]`` (a Gemm with ``transB``)."""
    return node.op_type == "Gemm" and bool(int(node.attr("transB", 0) or 0))


def _weight_matrix(index: GraphIndex, node) -> np.ndarray:
    """The node's weight as ``[K, N]``."""
    w = _array(index, node.inputs[1])
    return w.T if stored_transposed(node) else w


def _set_weight_matrix(index: GraphIndex, node, matrix: np.ndarray) -> None:
    stored = matrix.T if stored_transposed(node) else matrix
    _store(index, node.inputs[1], stored)


def _fold_inverse(index: GraphIndex, x: str, kind: str, inverse: np.ndarray) -> None:
    producer = index.producer[x]
    if kind == "layernorm":
        for tensor in producer.inputs[1:3]:
            if tensor:
                _store(index, tensor, _array(index, tensor) * inverse)
        return
    if producer.op_type == "Add":
        bias = next(t for t in producer.inputs if index.is_constant(t))
        _store(index, bias, _array(index, bias) * inverse)
        producer = _weighted_producer(index, next(t for t in producer.inputs if not index.is_constant(t)))
    matrix = _weight_matrix(index, producer)
    _set_weight_matrix(index, producer, matrix * inverse[None, :])
    if producer.op_type == "Gemm" and len(producer.inputs) > 2 and producer.inputs[2]:
        _store(index, producer.inputs[2], _array(index, producer.inputs[2]) * inverse)


def _insert_muls(model, muls) -> None:
    """For each ``(x, node names, inverse)``: a ``Mul(x, inverse)`` the named nodes read (input 0)
    instead of ``x``, placed before the first of them (the graph stays topologically sorted)."""
    if not muls:
        return
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    taken = {n.name for n in graph.node} | {t.name for t in graph.initializer}
    taken.update(o for n in graph.node for o in n.output)
    taken.update(i.name for i in graph.input)
    before: Dict[str, list] = {}
    position = {n.name: i for i, n in enumerate(graph.node)}
    for x, names, inverse in muls:
        base, k = f"{x}_awq", 0
        while any(f"{base}{suffix}" in taken for suffix in ("_Mul", "_inv_scale", "_scaled")):
            k += 1
            base = f"{x}_awq{k}"
        taken.update(f"{base}{suffix}" for suffix in ("_Mul", "_inv_scale", "_scaled"))
        graph.initializer.append(numpy_helper.from_array(inverse, f"{base}_inv_scale"))
        for name in names:
            graph.node[position[name]].input[0] = f"{base}_scaled"
        first = graph.node[min(position[n] for n in names)].name
        before.setdefault(first, []).append(
            onnx.helper.make_node("Mul", [x, f"{base}_inv_scale"], [f"{base}_scaled"], name=f"{base}_Mul"))
    ordered = []
    for node in graph.node:
        ordered.extend(before.get(node.name, ()))
        ordered.append(node)
    copies = [onnx.NodeProto() for _ in ordered]
    for copy, node in zip(copies, ordered):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


def _activation_rows(model, tensors, data, progress: bool,
                     batch_size: Optional[int]) -> Dict[str, np.ndarray]:
    """Up to `MAX_ROWS` rows ``[n, K]`` of each activation over the calibration data (a fixed
    random subset when there are more)."""
    from ..io.data import load_data
    from ..runtime.sessions import make_session, run_batches

    session = make_session(model, extra_outputs=tensors)
    dataset = load_data(data, model, what="calibration data")
    parts: Dict[str, list] = {t: [] for t in tensors}
    for outputs in run_batches(session, dataset, batch_size=batch_size or 16, outputs=list(tensors),
                               progress=progress, desc="awq: activations"):
        for t in tensors:
            values = np.asarray(outputs[t], np.float32)
            parts[t].append(values.reshape(-1, values.shape[-1]))
    rng = np.random.default_rng(0)
    rows = {}
    for t, chunks in parts.items():
        joined = np.concatenate(chunks)
        if len(joined) > MAX_ROWS:
            joined = joined[np.sort(rng.choice(len(joined), MAX_ROWS, replace=False))]
        rows[t] = joined
    return rows


__all__ = ["apply_awq", "search_scale", "search_clip", "clip_with_moments", "ALPHAS", "CLIP_RATIOS",
           "MAX_ROWS"]
