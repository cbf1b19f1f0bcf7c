"""Error-compensating INT4 rounding (GPTQ-style), after the activation-aware scales.

``int4_method="gptq"``: the activation-aware scale search (:mod:`onnx_qat.awq`) runs first; then
each constant MatMul/Gemm weight ``W [K, N]`` (``K`` the reduction axis) read by activation ``x`` is
rounded input channel by input channel, and the rounding error of each row is spread over the rows
not rounded yet so that the layer's output on the calibration data, ``X W``, moves least
(Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023, Algorithm 1). The weights of the error spreading come from the inverse of
``H = Σ xᵀx`` over every calibration row (plus 1% of its mean diagonal, the paper's dampening);
an input channel that is always zero gets no compensation. Rows are rounded in order, so each INT4
block (``block_size`` rows along ``K``) is rounded whole before the next: its per-column range is
chosen when the block starts, on the weights as updated so far, among
:data:`~onnx_qat.awq.CLIP_RATIOS` × max |w| by the block's error weighted with ``H``'s diagonal
block (AWQ's clipping search, :func:`onnx_qat.awq.clip_with_moments`).

The rounded weights replace the float ones in the private float model :func:`onnx_qat.quantize`
owns and their block ranges go to the ScaleTable; the rounded values lie exactly on the INT4 grid
those ranges define (``q × scale``, with the scale the inserter computes), so the one inserter
stores exactly the INT4 values chosen here. Activations are the float model's (after the AWQ edits),
not those of already quantized layers: each weight is rounded on its own.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import numpy as np

from .blockwise import INT4_MAX, INT4_MIN, block_scale
from .placement.graph_index import GraphIndex
from .placement.marks import Placement

logger = logging.getLogger(__name__)

#: Share of the mean Hessian diagonal added to its diagonal (GPTQ's ``percdamp``).
DAMP = 0.01
#: Fewer calibration rows than this many per input channel get a warning: GPTQ then fits the
#: calibration rows (measured: on a transformer block with 128-512 input channels, 256 rows rounded
#: worse than AWQ on other data, 2048 rows better).
MIN_ROWS_PER_CHANNEL = 2


def gptq_round(matrix: np.ndarray, hessian: np.ndarray, block_size: int,
               damp: float = DAMP) -> Tuple[np.ndarray, np.ndarray]:
    """GPTQ rounding of ``matrix [K, N]`` (blocks of ``block_size`` along K) for inputs with second
    moments ``hessian [K, K]`` (``Σ xᵀx``). Returns ``(rounded [K, N] float32, amax [K / block_size, N]
    float32)``: ``rounded`` is on the INT4 grid of ``amax`` (``quantize_blocks(rounded, 0, block_size,
    amax)`` gives it back exactly). With a diagonal ``hessian`` no error is spread: round to nearest
    with the ranges the clipping search picks."""
    from .awq import clip_with_moments

    w = np.array(matrix, np.float64)
    k, n = w.shape
    h = np.array(hessian, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    upper = _inverse_cholesky_upper(h)
    q = np.empty((k, n), np.int8)
    amax = np.empty((k // block_size, n), np.float32)
    scales = np.empty((k // block_size, n), np.float32)
    for g, start in enumerate(range(0, k, block_size)):
        end = start + block_size
        block = w[start:end]  # a view: updated in place as rows are rounded
        amax[g] = clip_with_moments(block[None].astype(np.float32), h[None, start:end, start:end])[0]
        scales[g] = block_scale(amax[g])
        scale = scales[g].astype(np.float64)
        errors = np.empty((block_size, n))
        u = upper[start:end, start:end]
        for j in range(block_size):
            row = np.clip(np.rint(block[j] / scale), INT4_MIN, INT4_MAX)
            q[start + j] = row
            errors[j] = (block[j] - row * scale) / u[j, j]
            block[j + 1:] -= np.outer(u[j, j + 1:], errors[j])
        w[end:] -= upper[start:end, end:].T @ errors
    rounded = q.astype(np.float32) * np.repeat(scales, block_size, axis=0)
    return rounded, amax


def _inverse_cholesky_upper(h: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor ``U`` of ``H⁻¹`` (``H⁻¹ = Uᵀ U``), as GPTQ uses it."""
    inverse = np.linalg.inv(h)
    return np.linalg.cholesky((inverse + inverse.T) / 2).T


def output_error(matrix: np.ndarray, rounded: np.ndarray, hessian: np.ndarray) -> float:
    """Relative output error ``tr(Eᵀ H E) / tr(Wᵀ H W)`` of ``rounded`` for inputs with second moments
    ``hessian`` (``E = rounded - matrix``): what ``Σ ||x W - x Q||² / Σ ||x W||²`` is on the rows."""
    w = np.asarray(matrix, np.float64)
    e = np.asarray(rounded, np.float64) - w
    h = np.asarray(hessian, np.float64)
    return float(np.sum(e * (h @ e)) / max(float(np.sum(w * (h @ w))), 1e-30))


def apply_gptq(model, placement: Placement, data, block_size: int, *, progress: bool = False,
               batch_size: Optional[int] = None) -> Tuple[Tuple[dict, ...], dict]:
    """Round every INT4 weight mark's weight of ``model`` (the private float copy, after the AWQ
    edits) with :func:`gptq_round` on the Hessians of its input over ``data``; replaces the weights in
    place. Returns ``(records, ranges)``: per weight the activation, its calibration rows, the relative
    output errors (:func:`output_error`) of round to nearest with the block max and of the GPTQ
    rounding; and the block ranges ``{weight: WeightRange(axis, amax, block_size)}`` for the
    ScaleTable."""
    from .awq import _set_weight_matrix, _weight_matrix
    from .blockwise import dequantize_blocks, quantize_blocks
    from .scales import WeightRange

    index = GraphIndex(model)  # after the AWQ edits (which may rebuild the node list)
    readers: Dict[str, list] = {}
    for mark in placement.weights:
        node = index.by_name.get(mark.node)
        trans_a = node is not None and node.op_type == "Gemm" and int(node.attr("transA", 0) or 0)
        if node is None or mark.input_index != 1 or trans_a:
            continue
        readers.setdefault(mark.tensor, []).append(node)
    if not readers:
        return (), {}
    hessians, rows = _hessians(model, sorted({n.inputs[0] for nodes in readers.values() for n in nodes}),
                               data, progress, batch_size)
    records, ranges = [], {}
    for tensor, nodes in readers.items():
        node = nodes[0]
        matrix = _weight_matrix(index, node)
        h = sum(hessians[n.inputs[0]] for n in nodes)
        if rows[node.inputs[0]] < MIN_ROWS_PER_CHANNEL * matrix.shape[0]:
            logger.warning("gptq %s: %d calibration rows for %d input channels; GPTQ fits the calibration "
                           "rows and needs several times more rows than channels to do better than AWQ on "
                           "other data", tensor, rows[node.inputs[0]], matrix.shape[0])
        rounded, amax = gptq_round(matrix, h, block_size)
        q, scale = quantize_blocks(matrix, 0, block_size)
        records.append({"weight": tensor, "activation": node.inputs[0], "rows": rows[node.inputs[0]],
                        "rtn_error": output_error(matrix, dequantize_blocks(q, scale, 0, block_size), h),
                        "gptq_error": output_error(matrix, rounded, h)})
        _set_weight_matrix(index, node, rounded)
        transposed = node.op_type == "Gemm" and int(node.attr("transB", 0) or 0)
        grid = amax.T if transposed else amax
        ranges[tensor] = WeightRange(1 if transposed else 0, tuple(float(v) for v in grid.reshape(-1)),
                                     block_size)
        logger.info("gptq %s: relative output error %.3g (round to nearest) -> %.3g", tensor,
                    records[-1]["rtn_error"], records[-1]["gptq_error"])
    return tuple(records), ranges


def _hessians(model, tensors, data, progress: bool, batch_size: Optional[int]):
    """``({tensor: Σ xᵀx}, {tensor: rows})`` over every row of each activation in ``tensors`` on the
    calibration data."""
    from .data import load_data
    from .runtime import make_session, run_batches

    session = make_session(model, extra_outputs=tensors)
    dataset = load_data(data, model, what="calibration data")
    sums: Dict[str, np.ndarray] = {}
    rows: Dict[str, int] = {t: 0 for t in tensors}
    for outputs in run_batches(session, dataset, batch_size=batch_size or 16, outputs=list(tensors),
                               progress=progress, desc="gptq: activations"):
        for t in tensors:
            x = np.asarray(outputs[t], np.float64)
            x = x.reshape(-1, x.shape[-1])
            sums[t] = sums[t] + x.T @ x if t in sums else x.T @ x
            rows[t] += len(x)
    return sums, rows


__all__ = ["apply_gptq", "gptq_round", "output_error", "DAMP"]
