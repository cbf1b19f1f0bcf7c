"""Error-compensating INT4 rounding (GPTQ-style), after the activation-aware scales.

``int4_method="gptq"``: the activation-aware scale search (`onnx_qat.formats.awq`) runs first; then
each constant MatMul/Gemm weight ``W [K, N]`` (``K`` the reduction axis) read by activation ``x`` is
rounded input channel by input channel, and the rounding error of each row is spread over the rows
not rounded yet so that the layer's output on the calibration data, ``X W``, moves least
(Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023, Algorithm 1). The weights of the error spreading come from the inverse of
``H = Σ xᵀx`` over every calibration row (plus 1% of its mean diagonal, the paper's dampening);
an input channel that is always zero gets no compensation. Rows are rounded in order, so each INT4
block (``block_size`` rows along ``K``) is rounded whole before the next: its per-column range is
chosen when the block starts, on the weights as updated so far, among
`CLIP_RATIOS` × max |w| by the block's error weighted with ``H``'s diagonal
block (AWQ's clipping search, `onnx_qat.formats.awq.clip_with_moments`), its scale then moved to the
FP16 neighbour that reconstructs the block best (`onnx_qat.formats.blockwise.fp16_block_amax`: the
TensorRT form's weight scales are FP16 values, which FP16 float parts store unchanged).

The rounded weights replace the float ones in the private float model
[`onnx_qat.quantize`][onnx_qat.quantize.quantize] owns and their block ranges go to the ScaleTable; the
rounded values lie exactly on the INT4 grid those ranges define (``q × scale``, with the scale the inserter
computes), so the one inserter stores exactly the INT4 values chosen here. Activations are the float model's
(after the AWQ edits),
not those of already quantized layers: each weight is rounded on its own.

``fp8_method="gptq"`` runs the same loop (`compensated_rounding`) on the FP8 E4M3 grid of each
output channel's scale (``max |w| / 448`` of the float weight, moved to an FP16 value,
`onnx_qat.formats.blockwise.fp16_fp8_amax`): `gptq_round_fp8`,
`apply_gptq_fp8`. Those per-channel ranges go to the ScaleTable, so the FP8 initializer the
inserter writes holds the rounded values bit for bit.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import numpy as np

from .blockwise import INT4_MAX, INT4_MIN, block_scale, fp16_block_amax, fp16_fp8_amax
from ..graph.index import GraphIndex
from ..placement.marks import Placement

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

    k, n = np.shape(matrix)
    amax = np.empty((k // block_size, n), np.float32)

    def start_block(g, block, h_block):
        amax[g] = clip_with_moments(block[None].astype(np.float32), h_block[None])[0]
        amax[g] = fp16_block_amax(block, amax[g][None], 0, block.shape[0])[0]  # FP16 block scales
        scale = block_scale(amax[g]).astype(np.float64)
        return lambda row: np.clip(np.rint(row / scale), INT4_MIN, INT4_MAX) * scale

    rounded = compensated_rounding(matrix, hessian, block_size, start_block, damp)
    return rounded, amax


def gptq_round_fp8(matrix: np.ndarray, hessian: np.ndarray, amax: np.ndarray,
                   damp: float = DAMP) -> np.ndarray:
    """GPTQ rounding of ``matrix [K, N]`` to the FP8 E4M3FN grid of the per-output-channel ranges
    ``amax [N]`` (scale ``amax / 448``, as the inserter stores it) for inputs with second moments
    ``hessian [K, K]``. Returns ``rounded [K, N] float32``: each value is an E4M3 value times its
    column's scale, so casting ``rounded / scale`` to E4M3 gives it back exactly (values the spread
    error pushes past ``amax`` clip at ±448). With a diagonal ``hessian``: round to nearest."""
    from .blockwise import FP8_MAX, from_fp8, to_fp8

    k, n = np.shape(matrix)
    scale = (np.asarray(amax, np.float64) / FP8_MAX).astype(np.float32)
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, np.float32(1.0)).astype(np.float32)

    def fp8_row(row):
        return from_fp8(to_fp8(row.astype(np.float32), scale)).astype(np.float64) * scale

    return compensated_rounding(matrix, hessian, min(k, LAZY_BLOCK), lambda g, b, h: fp8_row, damp)


#: Rows whose error is spread within the block before the rest is updated at once (GPTQ's "lazy
#: batch" updates; the result does not depend on it).
LAZY_BLOCK = 128


def compensated_rounding(matrix: np.ndarray, hessian: np.ndarray, block_size: int, start_block,
                         damp: float = DAMP) -> np.ndarray:
    """GPTQ's loop (Algorithm 1) over the rows of ``matrix [K, N]`` with any grid: for each block of
    ``block_size`` rows along K (the last may be shorter), ``start_block(g, block, h_block)`` sees the
    block as updated so far (and ``hessian``'s dampened diagonal block) and returns the function
    rounding one row; each row's rounding error is spread over the rows not rounded yet, weighted by
    ``hessian``'s inverse. Returns the rounded rows as float32."""
    w = np.array(matrix, np.float64)
    k, n = w.shape
    h = np.array(hessian, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    upper = _inverse_cholesky_upper(h)
    out = np.empty((k, n), np.float32)
    for g, start in enumerate(range(0, k, block_size)):
        end = min(start + block_size, k)
        block = w[start:end]  # a view: updated in place as rows are rounded
        round_row = start_block(g, block, h[start:end, start:end])
        errors = np.empty((end - start, n))
        u = upper[start:end, start:end]
        for j in range(end - start):
            row = round_row(block[j])
            out[start + j] = row
            errors[j] = (block[j] - row) / u[j, j]
            block[j + 1:] -= np.outer(u[j, j + 1:], errors[j])
        w[end:] -= upper[start:end, end:].T @ errors
    return out


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
    edits) with `gptq_round` on the Hessians of its input over ``data``; replaces the weights in
    place. Returns ``(records, ranges)``: per weight the activation, its calibration rows, the relative
    output errors (`output_error`) of round to nearest with the block max and of the GPTQ
    rounding; and the block ranges ``{weight: WeightRange(axis, amax, block_size)}`` for the
    ScaleTable."""
    from .awq import _set_weight_matrix, stored_transposed
    from .blockwise import dequantize_blocks, quantize_blocks
    from ..scales import WeightRange

    index = GraphIndex(model)  # after the AWQ edits (which may rebuild the node list)
    readers = _weight_readers(index, placement)
    records, ranges = [], {}
    for tensor, node, matrix, h, rows in _weights_with_hessians(model, index, readers, data, progress,
                                                                batch_size):
        if rows < MIN_ROWS_PER_CHANNEL * matrix.shape[0]:
            logger.warning("gptq %s: %d calibration rows for %d input channels; GPTQ fits the calibration "
                           "rows and needs several times more rows than channels to do better than AWQ on "
                           "other data", tensor, rows, matrix.shape[0])
        rounded, amax = gptq_round(matrix, h, block_size)
        q, scale = quantize_blocks(matrix, 0, block_size)
        records.append(_record(tensor, node, rows, matrix, dequantize_blocks(q, scale, 0, block_size),
                               rounded, h, "gptq"))
        _set_weight_matrix(index, node, rounded)
        transposed = stored_transposed(node)
        grid = amax.T if transposed else amax
        ranges[tensor] = WeightRange(1 if transposed else 0, tuple(float(v) for v in grid.reshape(-1)),
                                     block_size)
    return tuple(records), ranges


def apply_gptq_fp8(model, placement: Placement, data, *, skip=(), progress: bool = False,
                   batch_size: Optional[int] = None) -> Tuple[Tuple[dict, ...], dict]:
    """Round every FP8 per-channel weight of a constant 2-D MatMul/Gemm weight of ``model`` (the
    private float copy) with `gptq_round_fp8` on the Hessians of its input over ``data``, each
    output channel's range its max |w|; replaces the weights in place. Returns ``(records, ranges)``:
    per weight the activation, its calibration rows and the relative output errors
    (`output_error`) of round to nearest and of GPTQ; and ``{weight: WeightRange(axis, amax)}``
    for the ScaleTable, so the inserter uses the scales the rounding used. Other weights (Conv,
    per-tensor marks, weights named in ``skip``: given ranges) keep round to nearest, and so does a
    weight whose input has fewer than `MIN_ROWS_PER_CHANNEL` calibration rows per input channel
    (with a warning: GPTQ would fit those rows; measured on the benchmark CNN's Gemm head, 32 rows for
    128 channels, it lowered the error on the calibration rows 100× and the cosine on unseen data)."""
    from .awq import _set_weight_matrix, stored_transposed
    from ..scales import WeightRange

    index = GraphIndex(model)
    axes = {m.tensor: m.axis for m in placement.weights}
    readers = {tensor: nodes for tensor, nodes in _weight_readers(index, placement).items()  # per channel
               if tensor not in skip and axes.get(tensor) == (0 if stored_transposed(nodes[0]) else 1)}
    records, ranges = [], {}
    for tensor, node, matrix, h, rows in _weights_with_hessians(model, index, readers, data, progress,
                                                                batch_size):
        if rows < MIN_ROWS_PER_CHANNEL * matrix.shape[0]:
            logger.warning("gptq fp8 %s: %d calibration rows for %d input channels; rounded to nearest "
                           "(GPTQ would fit the calibration rows)", tensor, rows, matrix.shape[0])
            continue
        amax = fp16_fp8_amax(matrix, np.max(np.abs(matrix), axis=0).astype(np.float32), 1)  # FP16 scales
        rounded = gptq_round_fp8(matrix, h, amax)
        nearest = gptq_round_fp8(matrix, np.diag(np.diag(h)), amax)
        records.append(_record(tensor, node, rows, matrix, nearest, rounded, h, "gptq fp8"))
        _set_weight_matrix(index, node, rounded)
        ranges[tensor] = WeightRange(0 if stored_transposed(node) else 1, tuple(float(v) for v in amax))
    return tuple(records), ranges


def _weights_with_hessians(model, index: GraphIndex, readers: Dict[str, list], data, progress: bool,
                           batch_size: Optional[int]):
    """Per weight of ``readers`` (`_weight_readers`): ``(weight, its first reader, the weight
    as [K, N], the Hessian summed over its readers' inputs, the first reader's calibration rows)``,
    with every input's Hessian collected in one pass over ``data`` (none when ``readers`` is empty)."""
    from .awq import _weight_matrix

    if not readers:
        return
    hessians, rows = _hessians(model, sorted({n.inputs[0] for nodes in readers.values() for n in nodes}),
                               data, progress, batch_size)
    for tensor, nodes in readers.items():
        node = nodes[0]
        yield (tensor, node, _weight_matrix(index, node), sum(hessians[n.inputs[0]] for n in nodes),
               rows[node.inputs[0]])


def _record(tensor: str, node, rows: int, matrix, nearest, rounded, hessian, what: str) -> dict:
    """One weight's record (its activation, calibration rows and the relative output errors of
    round to nearest and of GPTQ), logged."""
    record = {"weight": tensor, "activation": node.inputs[0], "rows": rows,
              "rtn_error": output_error(matrix, nearest, hessian),
              "gptq_error": output_error(matrix, rounded, hessian)}
    logger.info("%s %s: relative output error %.3g (round to nearest) -> %.3g", what, tensor,
                record["rtn_error"], record["gptq_error"])
    return record


def _weight_readers(index: GraphIndex, placement: Placement) -> Dict[str, list]:
    """``{weight: [MatMul/Gemm nodes reading it as input 1]}`` over the weight marks whose weight is
    a constant 2-D matrix ``B`` (Gemm without ``transA``)."""
    readers: Dict[str, list] = {}
    for mark in placement.weights:
        node = index.by_name.get(mark.node)
        if node is None or mark.input_index != 1 or node.op_type not in ("MatMul", "Gemm"):
            continue
        if node.op_type == "Gemm" and int(node.attr("transA", 0) or 0):
            continue
        if not index.is_stored_constant(mark.tensor):  # folded through a Transpose...: round to nearest
            continue
        shape = index.constant_shape(mark.tensor)
        if shape is not None and len(shape) != 2:
            continue
        readers.setdefault(mark.tensor, []).append(node)
    return readers


def _hessians(model, tensors, data, progress: bool, batch_size: Optional[int]):
    """``({tensor: Σ xᵀx}, {tensor: rows})`` over every row of each activation in ``tensors`` on the
    calibration data."""
    from ..io.data import load_data
    from ..runtime.sessions import make_session, run_batches

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


__all__ = ["apply_gptq", "apply_gptq_fp8", "compensated_rounding", "gptq_round", "gptq_round_fp8",
           "output_error", "DAMP"]
