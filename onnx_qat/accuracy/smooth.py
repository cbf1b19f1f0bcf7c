"""Activation smoothing (SmoothQuant-style): outlier input channels moved into the weights that read them.

An activation quantized per tensor whose channels differ widely in range (a few outlier channels
after a LayerNorm, as in transformers) loses its small channels to the outliers' scale. Its weights
are quantized per output channel, so they can take the range instead: input channel ``j`` of the
activation is divided by ``s_j = a_j^α / w_j^(1-α)`` (``a_j``: the channel's max |x| on the
calibration data; ``w_j``: max |w| of the weights' input channel ``j``; ``α`` = `ALPHA`) and
row ``j`` of every consumer's weight multiplied by it (Xiao et al., "SmoothQuant: Accurate and
Efficient Post-Training Quantization for Large Language Models", ICML 2023, section 4).

The division is folded into what produces the activation, so the graph keeps its nodes and the float
function is unchanged up to float rounding: a LayerNormalization (its scale and bias), a
BatchNormalization (scale and bias), a Mul by a constant then an Add of a constant (a LayerNorm
written out), a Conv/Gemm/MatMul (its output channels, and the Add of a constant bias after it).
Where the producer cannot absorb the division because it is not homogeneous (a GELU, written as one
``Gelu`` node or as its ``Erf`` expression, a Sigmoid, a Tanh, ...: any op of `POINTWISE_PRODUCERS`),
an explicit ``Mul`` by ``1 / s`` (one constant per channel) is inserted right after it and every reader
reads the ``Mul``'s output instead. Placement then puts the readers' Q/DQ pair after the ``Mul``, on
the tensor the weighted op reads. TensorRT fuses adjacent pointwise layers into one pointwise layer,
and the activation, the ``Mul`` and the QuantizeLinear after them are such a chain (TensorRT
documentation, "Layer Fusion Catalog": PointWise fusion,
https://docs.nvidia.com/deeplearning/tensorrt/latest/performance/fusion-catalog.html), so the
``Mul`` adds no kernel of its own.

Every weighted reader (MatMul, Gemm, Conv reading the activation as input 0) must have a private
constant weight. A tensor is smoothed only where its channel ranges are uneven (the largest at least
`MIN_SPREAD` times the median) and smoothing makes them less so: a channel whose weight row is as
much an outlier as the channel itself (the product ``a_j * w_j`` is what is large) has nothing to
migrate; such channels are split out (below), and where they cannot be the tensor is left alone.

Where the product is the outlier (a channel ``a_j`` far above the others *and* read by a weight row
``w_j`` far above the others: trained transformers' "massive activations", one channel huge on one
token, e.g. the first), smoothing has nothing to migrate. Those channels (``a_j * w_j`` over
`SPLIT_RATIO` times the median, at most `MAX_SPLIT` of them; MatMul readers only) are split out:
the ``Mul`` zeroes them on the tensor the readers quantize (and divides the rest by ``s`` when they
qualify for smoothing), their weight rows are zeroed, and a ``Gather`` of those channels times those
rows (a second, small MatMul, quantized like every weighted op, with an activation scale of its own)
is added to the reader's output after its bias ``Add``. Exact in float; every MatMul stays INT8.

A tensor that only depthwise Convs read (``group`` equal to its channels) is smoothed fully (``α = 1``)
once its channel spread reaches `DEPTHWISE_MIN_SPREAD`: a depthwise weight's row ``j`` is output channel
``j``'s own weight, quantized per output channel, so it takes any scale without changing its INT8 error,
and the per-tensor activation scale then fits every channel (as a per-channel activation scale would).
A tensor read by other nodes as well (a LayerNorm output that also feeds a residual Add) is smoothed
with a ``Mul`` that only the weighted readers read; it sits right before their QuantizeLinear, a
pointwise layer TensorRT fuses with it.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np

from .constants import private, read_constant, sole_consumer, write_constant

logger = logging.getLogger(__name__)

#: SmoothQuant's migration strength (0.5: the range split evenly between activation and weight).
ALPHA = 0.5
#: A tensor is smoothed when its largest channel range is at least this many times the median.
MIN_SPREAD = 8.0
#: A tensor only depthwise Convs read is smoothed fully (``α = 1``: every channel to the same range)
#: when its largest channel range is at least this many times the median.
DEPTHWISE_MIN_SPREAD = 2.0
#: Input channels whose ``a_j * w_j`` is over this many times the median are split out (see `smooth`).
SPLIT_RATIO = 20.0
#: At most this many channels of one tensor are split out (more is not an outlier but a wide tensor).
MAX_SPLIT = 4
#: Op types whose input 0 may be smoothed, and the axis of their input channels.
READERS = {"MatMul": -1, "Gemm": -1, "Conv": 1}
#: Element-wise producers after which a ``Mul`` by ``1 / s`` is inserted when the division cannot be folded
#: into them (TensorRT fuses the ``Mul`` with them into one pointwise kernel).
POINTWISE_PRODUCERS = ("Gelu", "Erf", "Mul", "Add", "Sub", "Div", "Sigmoid", "Tanh", "Relu", "LeakyRelu",
                       "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Mish",
                       "Clip", "PRelu", "Abs", "Neg", "Exp", "Sqrt", "Pow")


def _weight_rows(index, node, channels: int) -> Optional[np.ndarray]:
    """``node``'s weight as ``[input channels, rest]`` (None when it is not a private constant of the
    right shape)."""
    w = read_constant(index, node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or not private(index, node.inputs[1], node.name):
        return None
    if node.op_type == "Conv":
        if _depthwise(node, w, channels):  # output channel o reads input channel o // (C_out / C_in)
            return w.reshape(channels, -1)
        if int(node.attr("group", 1) or 1) != 1 or w.shape[1] != channels:
            return None
        return np.moveaxis(w, 1, 0).reshape(channels, -1)
    if w.ndim != 2 or (node.op_type == "Gemm" and int(node.attr("transA", 0) or 0)):
        return None
    transposed = node.op_type == "Gemm" and bool(int(node.attr("transB", 0) or 0))
    w = w.T if transposed else w
    return w if w.shape[0] == channels else None


def _depthwise(node, w: np.ndarray, channels: int) -> bool:
    """``node`` is a depthwise Conv over ``channels`` input channels (``group`` = C_in, one input channel
    per group; C_in > 1)."""
    return node.op_type == "Conv" and channels > 1 and int(node.attr("group", 1) or 1) == channels and \
        w.ndim >= 3 and w.shape[1] == 1 and w.shape[0] % channels == 0


def _scale_weight(index, node, s: np.ndarray) -> None:
    w = read_constant(index, node.inputs[1])
    if _depthwise(node, w, s.size):
        w = w * np.repeat(s, w.shape[0] // s.size).reshape(-1, *([1] * (w.ndim - 1)))
    elif node.op_type == "Conv":
        w = w * s.reshape(1, -1, *([1] * (w.ndim - 2)))
    elif node.op_type == "Gemm" and int(node.attr("transB", 0) or 0):
        w = w * s[None, :]
    else:
        w = w * s[:, None]
    write_constant(index, node.inputs[1], w.astype(np.float32))


def _fold_targets(index, tensor: str, channels: int, axis: int,
                  trailing: int) -> Optional[List[Tuple[str, str]]]:
    """``[(constant, how)]`` to divide per channel so that ``tensor`` is divided by ``s``, or None
    (``trailing``: the tensor's dimensions after the channel axis; 0 when it is the last)."""
    node = index.producer.get(tensor)
    if node is None:
        return None
    consts = [t for t in node.inputs if t and index.is_constant(t)]
    if node.op_type == "Add" and len(consts) == 1 and private(index, consts[0], node.name):
        other = next(t for t in node.inputs if t != consts[0])
        inner = _fold_targets(index, other, channels, axis, trailing) \
            if sole_consumer(index, other) is not None else None
        return None if inner is None else inner + [(consts[0], f"broadcast:{trailing}")]
    if node.op_type == "Mul" and len(consts) == 1 and private(index, consts[0], node.name):
        return [(consts[0], f"broadcast:{trailing}")]
    if node.op_type == "LayerNormalization" and axis == -1:
        return [(t, "channel") for t in node.inputs[1:3] if t] \
            if all(private(index, t, node.name) for t in node.inputs[1:3] if t) else None
    if node.op_type == "BatchNormalization" and axis == 1:
        return [(node.inputs[1], "channel"), (node.inputs[2], "channel")] \
            if all(private(index, t, node.name) for t in node.inputs[1:3]) else None
    if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.inputs) > 1 and \
            private(index, node.inputs[1], node.name):
        found = [(node.inputs[1], f"out:{node.op_type}:{int(node.attr('transB', 0) or 0)}")]
        if len(node.inputs) > 2 and node.inputs[2]:
            if not private(index, node.inputs[2], node.name):
                return None
            found.append((node.inputs[2], "channel"))
        return found
    return None


def _divide(index, tensor: str, how: str, s: np.ndarray, axis: int) -> bool:
    """Divide ``tensor`` by ``s`` along its channel axis (``how``); False when its shape does not allow."""
    value = read_constant(index, tensor)
    if how.startswith("broadcast:"):  # an element-wise constant: scalar or one value per channel
        shape = (s.size,) + (1,) * int(how.split(":")[1])
        if value.size == 1:
            value = np.full(shape, float(value.reshape(-1)[0]), np.float32)
        if value.shape[-len(shape):] != shape or value.size != s.size:
            return False
        write_constant(index, tensor, (value / s.reshape(value.shape)).astype(np.float32))
        return True
    if how == "channel":
        if value.size == 1:  # a scalar becomes one value per channel
            value = np.full(s.shape, float(value.reshape(-1)[0]), np.float32)
        if value.size != s.size:
            return False
        write_constant(index, tensor, (value / s.reshape(value.shape)).astype(np.float32))
        return True
    _, op, transposed = how.split(":")
    if op == "Conv":
        out = value / s.reshape((-1,) + (1,) * (value.ndim - 1))
    elif transposed == "1":
        out = value / s[:, None]
    else:
        out = value / s[None, :]
    write_constant(index, tensor, out.astype(np.float32))
    return True


def _conv_trailing(index, node) -> int:
    """Dimensions after the channel axis of a Conv's input (its weight's rank less 2)."""
    shape = index.constant_shape(node.inputs[1]) or ()
    return max(len(shape) - 2, 0)


def _fits(value: np.ndarray, how: str, channels: int) -> bool:
    """``value`` can be divided per channel as ``how`` says (see `_divide`)."""
    if how.startswith("broadcast:"):
        shape = (channels,) + (1,) * int(how.split(":")[1])
        return value.size == 1 or (value.shape[-len(shape):] == shape and value.size == channels)
    if how == "channel":
        return value.size in (1, channels)
    return True


def smooth(model, data, *, alpha: float = ALPHA, min_spread: float = MIN_SPREAD, batch_size: int = 16,
           tensors=None, insert_mul: bool = True, split: bool = True,
           split_ratio: float = SPLIT_RATIO) -> Tuple[dict, ...]:
    """Smooth every activation of ``model`` (a private copy, edited in place) that qualifies (see the
    module docstring), with channel ranges measured on ``data``; ``tensors`` limits the candidates;
    ``insert_mul=False`` smooths only where the producer absorbs the division (no node added, no
    split); ``split=False`` never splits channels out.

    Returns one record per edited tensor: ``tensor``, ``readers``, ``shared``, ``how`` (``"folded"`` into
    the producer, ``"mul"``: a ``Mul`` inserted after it, ``"split"``: channels split out, the rest
    smoothed through the ``Mul`` when they qualify), ``producer`` (its op type), ``split`` (the channels
    split out and their ``a_j * w_j`` over the median), ``spread_before`` and ``spread_after`` (largest
    channel range over the median, on the calibration data; after: of the channels the readers' Q/DQ
    pair still sees).
    """
    from ..graph.index import GraphIndex

    index = GraphIndex(model)
    candidates: Dict[str, Tuple[int, list, bool]] = {}
    for node in index.nodes:
        if node.op_type not in READERS or not node.inputs or \
                (tensors is not None and node.inputs[0] not in tensors):
            continue
        x = node.inputs[0]
        if x in candidates or index.is_constant(x) or x in index.graph_inputs:
            continue
        consumers = [n for n, i in index.consumers(x)]
        readers = [n for n in consumers
                   if n.op_type in READERS and n.inputs[0] == x and x not in n.inputs[1:]]
        shared = len(readers) != len(consumers) or x in index.graph_outputs
        if len({READERS[n.op_type] for n in readers}) != 1 or (shared and not insert_mul):
            continue
        candidates[x] = (READERS[node.op_type], readers, shared)
    if not candidates:
        return ()
    ranges = _channel_ranges(model, data, {x: a for x, (a, _, _) in candidates.items()}, batch_size)
    records, edits = [], _Edits(model)
    for x, (axis, readers, shared) in candidates.items():
        record = _smooth_one(index, edits, x, ranges.get(x), axis, readers, shared, alpha=alpha,
                             min_spread=min_spread, insert_mul=insert_mul,
                             split_ratio=split_ratio if split and insert_mul else None)
        if record is not None:
            records.append(record)
            logger.info("smooth %s: channel spread %.1f -> %.1f (%s)", x, record["spread_before"],
                        record["spread_after"], record["how"])
    edits.apply()
    return tuple(records)


def _spread(a: np.ndarray) -> float:
    return float(a.max() / max(np.median(a), 1e-12))


def _smooth_one(index, edits, x, a, axis, readers, shared, *, alpha, min_spread, insert_mul,
                split_ratio) -> Optional[dict]:
    """Smooth (and split) ``x`` read by ``readers`` along ``axis``; its record, or None when left alone
    (also when ``x`` is the output a split has added to: its producer's weight no longer tells it all)."""
    if a is None or not np.all(np.isfinite(a)) or not np.any(a > 0) or x in edits.targets:
        return None
    rows = [_weight_rows(index, n, a.size) for n in readers]
    if any(r is None for r in rows):
        return None
    w = np.max([np.abs(r).max(axis=1) for r in rows], axis=0)
    spread = _spread(a)
    outliers = np.zeros(0, np.int64)
    if split_ratio is not None and axis == -1 and all(n.op_type == "MatMul" for n in readers):
        product = a * w
        found = np.flatnonzero(product > split_ratio * max(float(np.median(product)), 1e-30))
        if 0 < found.size <= MAX_SPLIT and not any(
                _split_target(index, n).outputs[0] in index.graph_outputs for n in readers):
            outliers = found
    keep = np.ones(a.size, bool)
    keep[outliers] = False
    seen = a[keep]
    s = np.ones_like(a)
    spread_after = _spread(seen)
    depthwise = all(_depthwise(n, read_constant(index, n.inputs[1]), a.size) for n in readers)
    if depthwise:  # per-output-channel weight scales take any input channel scale at no cost
        alpha, min_spread = 1.0, DEPTHWISE_MIN_SPREAD
    if spread_after >= min_spread:
        live = keep & (a > 0) & (w > 0)
        s[live] = a[live] ** alpha / w[live] ** (1 - alpha)
        s[live] /= np.exp(np.mean(np.log(s[live])))  # geometric mean 1: ranges keep their magnitude
        smoothed = _spread((a / s)[keep])
        if smoothed < spread_after:
            spread_after = smoothed
        else:  # the outlier is in the weights' rows too: nothing to migrate
            s[:] = 1.0
    smoothing = bool(np.any(s != 1.0))
    if not smoothing and not outliers.size:
        return None
    trailing = 0 if axis == -1 else _conv_trailing(index, readers[0])
    targets = None if shared or outliers.size else _fold_targets(index, x, a.size, axis, trailing)
    if targets is not None and not all(_fits(read_constant(index, t), how, a.size) for t, how in targets):
        targets = None
    producer = index.producer.get(x)
    if targets is None and not (insert_mul and producer is not None and (shared or outliers.size or (
            producer.standard and producer.op_type in POINTWISE_PRODUCERS))):
        return None
    taken = [_take_rows(index, n, outliers) for n in readers] if outliers.size else []
    if targets is None:
        inverse = np.where(keep, 1.0 / s, 0.0).astype(np.float32).reshape((-1,) + (1,) * trailing)
        edits.mul(x, producer.position, [n.position for n in readers], inverse)
    else:
        for t, how in targets:
            _divide(index, t, how, s, axis)
    if smoothing:
        for n in readers:
            _scale_weight(index, n, s)
    for n, removed in zip(readers, taken):
        edits.side(index, x, producer.position, n, outliers, removed)
    return {"tensor": x, "readers": [n.name for n in readers], "shared": shared,
            "how": "split" if outliers.size else "folded" if targets is not None else "mul",
            "producer": None if producer is None else producer.op_type,
            "split": [(int(j), round(float(a[j] * w[j] / np.median(a * w)), 1)) for j in outliers],
            "spread_before": round(spread, 2), "spread_after": round(spread_after, 2)}


def _split_target(index, reader):
    """The node after which a split reader's side output is added: its bias ``Add`` (one constant
    input) when that is its sole consumer, else the reader itself."""
    bias = sole_consumer(index, reader.outputs[0])
    if bias is not None and bias.op_type == "Add" and len(bias.inputs) == 2 and \
            sum(1 for t in bias.inputs if index.is_constant(t)) == 1:
        return bias
    return reader


def _take_rows(index, node, channels: np.ndarray) -> np.ndarray:
    """Rows ``channels`` of a MatMul's constant weight ``[K, N]``, zeroed in the stored weight."""
    w = read_constant(index, node.inputs[1])
    rows = w[channels].copy()
    w[channels] = 0.0
    write_constant(index, node.inputs[1], w)
    return rows.astype(np.float32)


class _Edits:
    """The nodes `smooth` adds, collected while the index still describes the graph, then placed in one
    pass (each right after the node whose position it names: the graph stays topologically sorted)."""

    def __init__(self, model):
        self.graph = model.graph
        graph = self.graph
        self.taken = {n.name for n in graph.node} | {t.name for t in graph.initializer} | \
            {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
        self.after: Dict[int, list] = {}
        self.gathers: Dict[str, str] = {}
        self.targets: set = set()  # the tensors a split's side output is added to

    def name(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}{k}"
        self.taken.add(name)
        return name

    def constant(self, base: str, values) -> str:
        from onnx import numpy_helper

        name = self.name(base)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(values), name))
        return name

    def node(self, position: int, op_type: str, inputs, base: str, **attrs) -> str:
        from onnx import helper

        out = self.name(base)
        self.after.setdefault(position, []).append(
            helper.make_node(op_type, list(inputs), [out], name=self.name(f"{base}_{op_type}"), **attrs))
        return out

    def mul(self, x: str, producer: int, readers, inverse: np.ndarray) -> None:
        """``Mul(x, inverse)`` after the producer of ``x``, read by ``readers`` (positions) instead."""
        out = self.node(producer, "Mul", [x, self.constant(f"{x}_smooth_inv_scale", inverse)], f"{x}_smooth")
        for position in readers:
            self.graph.node[position].input[0] = out

    def side(self, index, x: str, producer: int, reader, channels: np.ndarray, rows: np.ndarray) -> None:
        """The split channels of ``x`` (``Gather``, once per tensor) times ``rows`` (a MatMul), added to
        ``reader``'s output after its bias ``Add`` when it has one."""
        if x not in self.gathers:
            self.gathers[x] = self.node(producer, "Gather", [x, self.constant(f"{x}_split_channels",
                                                                               channels.astype(np.int64))],
                                        f"{x}_split", axis=-1)
        at = _split_target(index, reader)
        target = at.outputs[0]
        self.targets.add(target)
        weight = self.constant(f"{reader.name}_split.weight", rows)
        part = self.node(reader.position, "MatMul", [self.gathers[x], weight], f"{reader.name}_split")
        readers = index.consumers(target)
        total = self.node(at.position, "Add", [target, part], f"{target}_split")
        for n, i in readers:
            self.graph.node[n.position].input[i] = total

    def apply(self) -> None:
        if not self.after:
            return
        nodes = []
        for position, node in enumerate(self.graph.node):
            copy = type(node)()
            copy.CopyFrom(node)
            nodes.append(copy)
            nodes.extend(self.after.get(position, ()))
        del self.graph.node[:]
        self.graph.node.extend(nodes)


def _channel_ranges(model, data, axes: Dict[str, int], batch_size: int) -> Dict[str, np.ndarray]:
    """max |x| per channel of each tensor in ``axes`` over ``data`` (float model)."""
    from ..io.data import load_data
    from ..runtime.sessions import make_session, run_batches

    names = list(axes)
    session = make_session(model, extra_outputs=names, spin=False)
    dataset = load_data(data, model, what="calibration data")
    found: Dict[str, np.ndarray] = {}
    for values in run_batches(session, dataset, batch_size=batch_size, outputs=names):
        for name in names:
            v = np.abs(np.moveaxis(np.asarray(values[name], np.float32), axes[name], -1))
            peak = v.reshape(-1, v.shape[-1]).max(axis=0).astype(np.float64)
            found[name] = peak if name not in found else np.maximum(found[name], peak)
    return found


__all__ = ["smooth", "ALPHA", "MIN_SPREAD", "POINTWISE_PRODUCERS", "SPLIT_RATIO", "MAX_SPLIT"]
