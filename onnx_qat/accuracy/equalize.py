"""Cross-layer equalization: Conv → (BatchNormalization) → (Relu / PRelu / LeakyRelu / ReLU6 / none) → Conv.

Per-channel INT8 gives each output channel of a weight its own scale, but the activation between
two convolutions has one scale for all its channels, and the second convolution's scale per output
channel is set by its largest input channel. When the first convolution's output channels differ
widely in range (common after BatchNormalization folding, and in depthwise convolutions), the small
channels are lost in both. Output channel ``c`` of the first convolution is divided by ``s_c`` and
input channel ``c`` of the second multiplied by it; since these activations are positively
homogeneous (``f(x / s) = f(x) / s`` for ``s > 0``), the float function is unchanged up to float
rounding. ``s_c = sqrt(r1_c / r2_c)`` (``r1_c``: max |w| of the first weight's output channel,
``r2_c``: of the second weight's input channel) makes both ranges ``sqrt(r1_c · r2_c)`` (Nagel et al.,
"Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019, section 4.1).
Chains (a convolution that is the second of one pair and the first of the next) are equalized in
sweeps until the scales settle.

ReLU6 (``Clip(x, 0, 6)``) is not homogeneous: its bound becomes ``6 / s_c`` per channel, so the
``Clip`` is rewritten as ``Relu`` then ``Min`` with that per-channel bound (two float element-wise
ops, exact). A BatchNormalization between the two takes ``mean / s`` and ``bias / s``.
The pass edits the caller's private copy in place and returns one record per pair: the two
weights' per-channel INT8 SQNR before and after, and the largest and smallest channel scale.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
from onnx import helper, numpy_helper

from .constants import private, read_constant, sole_consumer, write_constant

logger = logging.getLogger(__name__)

#: Sweeps over all pairs at most (a chain needs several for its scales to settle).
MAX_SWEEPS = 20
#: A sweep whose scales all lie within this of 1 ends the iteration.
TOLERANCE = 1e-3
#: Each channel's scale (all sweeps together) is kept within [1 / LIMIT, LIMIT]: a channel whose
#: first weights are nearly zero would otherwise have its bias (and so its activation) scaled up
#: without bound. A dead channel (zero weights) keeps scale 1.
LIMIT = 100.0
#: Homogeneous activations allowed between the two convolutions.
ACTIVATIONS = ("Relu", "PRelu", "LeakyRelu", "Clip")


@dataclass
class Pair:
    """Two convolutions equalized together (names of nodes and tensors of the private copy)."""

    first: str
    second: str
    weight1: str
    bias1: Optional[str]
    weight2: str
    group2: int
    middle: Tuple[str, ...]  # node names between (BatchNormalization, activation)
    batchnorm: Optional[str] = None
    clip: Optional[str] = None  # a ReLU6 Clip node to rewrite
    scale: Optional[np.ndarray] = None  # the product of every sweep's scales


def find_pairs(index) -> List[Pair]:
    """Every Conv → (BatchNormalization) → (activation) → Conv chain whose tensors have one reader
    each and whose weights (and biases, BatchNormalization parameters) are private float32 constants."""
    pairs = []
    for node in index.nodes:
        if node.op_type != "Conv" or len(node.inputs) < 2:
            continue
        pair = _pair_from(index, node)
        if pair is not None:
            pairs.append(pair)
    return pairs


def _pair_from(index, first) -> Optional[Pair]:
    w1 = read_constant(index, first.inputs[1])
    if w1 is None or w1.ndim < 3 or not private(index, first.inputs[1], first.name):
        return None
    bias = first.inputs[2] if len(first.inputs) > 2 and first.inputs[2] else None
    if bias is not None and not private(index, bias, first.name):
        return None
    tensor, middle, batchnorm, clip = first.outputs[0], [], None, None
    node = sole_consumer(index, tensor)
    if node is not None and node.op_type == "BatchNormalization" and node.inputs[0] == tensor:
        if len(node.outputs) > 1 and any(node.outputs[1:]) or \
                not all(private(index, t, node.name) for t in node.inputs[1:5]):
            return None
        batchnorm, tensor = node.name, node.outputs[0]
        middle.append(node.name)
        node = sole_consumer(index, tensor)
    if node is not None and node.op_type in ACTIVATIONS and node.inputs[0] == tensor:
        if not _homogeneous(index, node, w1.shape[0]):
            return None
        if node.op_type == "Clip":
            clip = node.name
        middle.append(node.name)
        tensor = node.outputs[0]
        node = sole_consumer(index, tensor)
    if node is None or node.op_type != "Conv" or node.inputs[0] != tensor or len(node.inputs) < 2:
        return None
    w2 = read_constant(index, node.inputs[1])
    if w2 is None or w2.ndim != w1.ndim or not private(index, node.inputs[1], node.name):
        return None
    group2 = int(node.attr("group", 1) or 1)
    if w2.shape[1] * group2 != w1.shape[0]:
        return None
    return Pair(first.name, node.name, first.inputs[1], bias, node.inputs[1], group2, tuple(middle),
                batchnorm, clip)


def _homogeneous(index, node, channels: int) -> bool:
    """``node`` commutes with a positive per-channel scale (Clip only as ReLU6-like: min 0, constant max)."""
    if node.op_type == "PRelu":
        slope = read_constant(index, node.inputs[1]) if len(node.inputs) > 1 else None
        return slope is not None and (slope.size == 1 or slope.size == channels)
    if node.op_type == "Clip":
        low = _scalar(index, node.inputs[1] if len(node.inputs) > 1 else "")
        high = _scalar(index, node.inputs[2] if len(node.inputs) > 2 else "")
        return low == 0.0 and high is not None and high > 0 and not node.attr("min", None)
    return True


def _scalar(index, tensor: str) -> Optional[float]:
    value = read_constant(index, tensor) if tensor else None
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def _input_channel_max(w2: np.ndarray, group2: int) -> np.ndarray:
    """max |w| of the second weight per input channel of the whole tensor (``C = C_in/g · g``)."""
    per_group = w2.shape[0] // group2
    a = np.abs(w2).reshape(group2, per_group, w2.shape[1], -1)  # [g, out/g, in/g, k]
    return a.max(axis=(1, 3)).reshape(-1)


def _scale_input_channels(w2: np.ndarray, group2: int, s: np.ndarray) -> np.ndarray:
    per_group = w2.shape[0] // group2
    shaped = w2.reshape(group2, per_group, w2.shape[1], -1) * s.reshape(group2, 1, w2.shape[1], 1)
    return shaped.reshape(w2.shape).astype(np.float32)


def _channel_sqnr(w: np.ndarray) -> float:
    """INT8 per-output-channel SQNR (dB) of a weight (round to nearest, max |w| per channel)."""
    from .prepared import weight_statistics

    return float(weight_statistics(w, 0)["sqnr_db"])


def equalize(model, *, max_sweeps: int = MAX_SWEEPS) -> Tuple[dict, ...]:
    """Equalize every pair `find_pairs` finds in ``model`` (a private copy, edited in place).

    Returns one record per pair: ``first``, ``second``, ``activation`` (the op between, or none),
    ``depthwise`` (the second is depthwise), per-channel INT8 weight SQNR of both weights ``before`` and
    ``after`` (dB), ``gain_db`` (the gain of the worse of the two), and ``scale_min``/``scale_max``.
    """
    from ..graph.index import GraphIndex

    index = GraphIndex(model)
    pairs = find_pairs(index)
    if not pairs:
        return ()
    before = {}
    for pair in pairs:
        w1, w2 = read_constant(index, pair.weight1), read_constant(index, pair.weight2)
        before[pair.first, pair.second] = (_channel_sqnr(w1), _channel_sqnr(w2))
        pair.scale = np.ones(w1.shape[0])
    for _ in range(max_sweeps):
        moved = 0.0
        for pair in pairs:
            moved = max(moved, _equalize_pair(index, pair))
        if moved < TOLERANCE:
            break
    records = []
    for pair in pairs:
        _finish(model, index, pair)
        w1, w2 = read_constant(index, pair.weight1), read_constant(index, pair.weight2)
        after = (_channel_sqnr(w1), _channel_sqnr(w2))
        old = before[pair.first, pair.second]
        nodes = {n.name: n for n in index.nodes}
        act = next((nodes[m].op_type for m in pair.middle if nodes[m].op_type != "BatchNormalization"),
                   "none")
        records.append({"first": pair.first, "second": pair.second,
                        "activation": "ReLU6" if pair.clip else act, "depthwise": pair.group2 > 1 and
                        w2.shape[1] == 1, "sqnr_before_db": [round(v, 2) for v in old],
                        "sqnr_after_db": [round(v, 2) for v in after],
                        "gain_db": round(min(after) - min(old), 2),
                        "scale_min": float(pair.scale.min()), "scale_max": float(pair.scale.max())})
        logger.info("equalize %s -> %s: weight SQNR %.1f/%.1f dB -> %.1f/%.1f dB", pair.first, pair.second,
                    *old, *after)
    return tuple(records)


def _equalize_pair(index, pair: Pair) -> float:
    """One equalization step of ``pair``; returns max |log s| of the step."""
    w1, w2 = read_constant(index, pair.weight1), read_constant(index, pair.weight2)
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1).astype(np.float64)
    r2 = _input_channel_max(w2, pair.group2).astype(np.float64)
    live = (r1 > 0) & (r2 > 0)
    s = np.ones_like(r1)
    s[live] = np.sqrt(r1[live] / r2[live])
    s = np.clip(pair.scale * s, 1.0 / LIMIT, LIMIT) / pair.scale
    shape = (-1,) + (1,) * (w1.ndim - 1)
    write_constant(index, pair.weight1, (w1 / s.reshape(shape)).astype(np.float32))
    write_constant(index, pair.weight2, _scale_input_channels(w2, pair.group2, s))
    if pair.bias1:
        write_constant(index, pair.bias1, (read_constant(index, pair.bias1) / s).astype(np.float32))
    if pair.batchnorm:  # BN(x / s) with mean / s and bias / s is BN(x) / s
        node = index.by_name[pair.batchnorm]
        for tensor in (node.inputs[2], node.inputs[3]):
            write_constant(index, tensor, (read_constant(index, tensor) / s).astype(np.float32))
    pair.scale = pair.scale * s
    return float(np.max(np.abs(np.log(s))))


def _finish(model, index, pair: Pair) -> None:
    """Rewrite a ReLU6 Clip as Relu then Min with the per-channel bound ``6 / s`` (exact)."""
    if pair.clip is None or np.allclose(pair.scale, 1.0):
        return
    clip = index.by_name[pair.clip].proto
    high = _scalar(index, clip.input[2])
    ndim = len(read_constant(index, pair.weight1).shape)
    bound = (high / pair.scale).astype(np.float32).reshape((-1,) + (1,) * (ndim - 2))
    name = f"{clip.name}_equalized_bound"
    model.graph.initializer.append(numpy_helper.from_array(bound, name))
    relu_out = f"{clip.output[0]}_relu"
    relu = helper.make_node("Relu", [clip.input[0]], [relu_out], name=clip.name)
    minimum = helper.make_node("Min", [relu_out, name], [clip.output[0]], name=f"{clip.name}_min")
    position = list(model.graph.node).index(clip)
    del model.graph.node[position]
    model.graph.node.insert(position, minimum)
    model.graph.node.insert(position, relu)


__all__ = ["equalize", "find_pairs", "Pair"]
