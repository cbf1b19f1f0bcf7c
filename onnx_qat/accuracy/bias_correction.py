"""Empirical bias correction: the mean shift each quantized weighted op adds, folded into its bias.

INT8 rounding of weights and activations moves the mean of a layer's output channels (the errors do
not average out: a per-channel weight error meets inputs with a non-zero mean, and a clipped or
rounded activation is biased). Each Conv (with a bias input), Gemm (with a 1-D ``C``) and MatMul
followed by an ``Add`` of a constant vector gets, per output channel, the mean difference between its
output in the Q/DQ model and in the float model on the calibration data subtracted from its bias
(the empirical variant of Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias
Correction", ICCV 2019, section 4.2). Graph order matters: a layer's shift is measured with every
layer before it already corrected. The layers are grouped by weighted depth (the longest chain of
weighted ops before them); each depth is one run of the Q/DQ model, after every smaller depth.
(Correcting several depths in one run over-corrects: the deeper layer's shift still holds what the shallower
correction removes; on the PP-OCRv4 recognizer, 3 depths per run took the output cosine from 0.96 to
0.50.) At most ``max_runs`` depths are corrected (a bound on work, never on time, so the same inputs
give the same biases on any machine load); deeper layers then keep their biases.
The biases are graph inputs of one session, so the runs share it.

The corrected biases are written into the private float model the Q/DQ model is then built from
(biases stay float: rule 1 never quantizes them), so the inserter is unchanged.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnx
from onnx import helper

from .constants import private, read_constant, sole_consumer, write_constant

logger = logging.getLogger(__name__)

#: Default bound on the correction's runs of the Q/DQ model (one per weighted depth: the first 16 depths,
#: whose shifts reach the most layers; about 2 s of CPU each on the PP-OCRv4 recognizer).
MAX_RUNS = 16
#: Calibration samples used at most (the first ones).
MAX_SAMPLES = 32


def bias_targets(index, nodes) -> List[Tuple[str, str, str, int]]:
    """``(node, bias tensor, output tensor, channel axis)`` of each node in ``nodes`` whose bias can be
    corrected: a Conv with a private constant bias, a Gemm with a private 1-D ``C``, a MatMul whose only
    reader is an Add of a private constant vector."""
    found = []
    for name in nodes:
        node = index.by_name.get(name)
        if node is None:
            continue
        if node.op_type == "Conv" and len(node.inputs) > 2 and private(index, node.inputs[2], name):
            found.append((name, node.inputs[2], node.outputs[0], 1))
        elif node.op_type == "Gemm" and len(node.inputs) > 2 and private(index, node.inputs[2], name) \
                and len(index.constant_shape(node.inputs[2]) or ()) == 1:
            found.append((name, node.inputs[2], node.outputs[0], -1))
        elif node.op_type == "MatMul":
            add = sole_consumer(index, node.outputs[0])
            if add is None or add.op_type != "Add":
                continue
            other = [t for t in add.inputs if t != node.outputs[0]]
            if len(other) == 1 and private(index, other[0], add.name) and \
                    len(index.constant_shape(other[0]) or ()) == 1:
                found.append((name, other[0], add.outputs[0], -1))
    return found


def _depths(index, names) -> Dict[str, int]:
    """Weighted depth of each node in ``names``: 1 + the largest depth among weighted ops upstream."""
    wanted = set(names)
    depth_of_tensor: Dict[str, int] = {}
    out = {}
    for node in index.nodes:  # topological order (placement requires a sorted graph)
        d = max((depth_of_tensor.get(t, 0) for t in node.inputs if t), default=0)
        if node.name in wanted:
            d += 1
            out[node.name] = d
        for t in node.outputs:
            depth_of_tensor[t] = d
    return out


def _with_bias_inputs(qdq: onnx.ModelProto, biases: Dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``qdq`` whose bias tensors are graph inputs (initializers or Constant nodes removed)."""
    model = onnx.ModelProto()
    model.CopyFrom(qdq)
    graph = model.graph
    keep = [t for t in graph.initializer if t.name not in biases]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output and n.output[0] in biases)]
    del graph.node[:]
    graph.node.extend(nodes)
    for name, value in biases.items():
        graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(value.shape)))
    return model


def correct_biases(float_model, qdq: onnx.ModelProto, placement, data, *,
                   max_runs: int = MAX_RUNS, batch_size: int = 16) -> Tuple[dict, ...]:
    """Correct the biases of ``float_model`` (a private copy, edited in place) from which ``qdq`` was
    built (same node and tensor names), on the first `MAX_SAMPLES` samples of ``data``.

    Returns one record per corrected layer: ``node``, ``depth``, ``shift`` (the largest per-channel
    mean shift removed, relative to the output's standard deviation in the float model), or
    ``skipped`` with the reason when ``max_runs`` runs were spent before its depth.
    """
    from ..io.data import load_data
    from ..graph.index import GraphIndex
    from ..runtime.sessions import make_session

    index = GraphIndex(float_model)
    quantized = [d.node for d in placement.decisions if d.action == "quantize"]
    targets = bias_targets(index, quantized)
    if not targets:
        return ()
    dataset = load_data(data, float_model, what="calibration data")
    feeds, taken = [], 0
    for feed in dataset.batches(batch_size):  # the first MAX_SAMPLES samples, whole batches
        feeds.append(feed)
        taken += len(np.asarray(next(iter(feed.values())))) if feed and not dataset.unbatched else 1
        if taken >= MAX_SAMPLES:
            break
    outputs = [t[2] for t in targets]
    reference = _means(make_session(float_model, extra_outputs=outputs, spin=False), feeds, targets)
    biases = {bias: read_constant(index, bias) for _, bias, _, _ in targets}
    session = make_session(_with_bias_inputs(qdq, biases), extra_outputs=outputs, spin=False)
    depths = _depths(index, [t[0] for t in targets])
    records, runs = [], 0
    for level in sorted(set(depths.values())):
        chosen = [t for t in targets if depths[t[0]] == level]
        if runs >= max_runs:
            why = f"run bound of {max_runs} run(s) spent"
            records.extend({"node": t[0], "depth": level, "skipped": why} for t in chosen)
            continue
        runs += 1
        got = _means(session, feeds, chosen, extra=biases)
        for node, bias, output, _ in chosen:
            shift = got[output][0] - reference[output][0]
            biases[bias] = (biases[bias] - shift.reshape(biases[bias].shape)).astype(np.float32)
            spread = float(np.max(np.abs(shift)) / max(reference[output][1], 1e-12))
            records.append({"node": node, "depth": depths[node], "shift": spread})
    for bias, value in biases.items():
        write_constant(index, bias, value)
    logger.info("bias correction: %d layers in %d run(s)", len(records), runs)
    return tuple(records)


def _means(session, feeds, targets, extra: Optional[Dict[str, np.ndarray]] = None):
    """``{output: (per-channel mean, std of the whole output)}`` over ``feeds``."""
    names = [t[2] for t in targets]
    axes = {t[2]: t[3] for t in targets}
    sums: Dict[str, np.ndarray] = {}
    squares: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    inputs = {i.name for i in session.get_inputs()}
    for feed in feeds:
        given = {k: v for k, v in feed.items() if k in inputs}
        given.update({k: v for k, v in (extra or {}).items() if k in inputs})
        for name, value in zip(names, session.run(names, given)):
            v = np.moveaxis(np.asarray(value, np.float64), axes[name], -1)
            v = v.reshape(-1, v.shape[-1])
            sums[name] = sums.get(name, 0.0) + v.sum(axis=0)
            squares[name] = squares.get(name, 0.0) + float((v * v).sum())
            counts[name] = counts.get(name, 0) + v.shape[0]
    out = {}
    for name in names:
        mean = sums[name] / counts[name]
        var = squares[name] / (counts[name] * mean.size) - float(np.mean(mean)) ** 2
        out[name] = (mean, float(np.sqrt(max(var, 0.0))))
    return out


__all__ = ["correct_biases", "bias_targets", "MAX_RUNS"]
