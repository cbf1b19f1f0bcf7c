"""Per-channel constant ``Mul``/``Add`` after a convolution, found and folded into its weight and bias.

Exporters that keep batch normalization apart from the convolution before it (the Keras export of
`tf_bridge`, which keeps it as Keras computes it; tf2onnx without its Grappler constant folding) write
``Conv -> Mul(k) -> Add(b)`` with ``k`` and ``b`` constant per output channel. TensorRT fuses such a
scale into the convolution at build time ("Convolution and Scale" in NVIDIA's TensorRT
[Layer Fusion Catalog](https://docs.nvidia.com/deeplearning/tensorrt/latest/performance/fusion-catalog.html);
the Q/DQ placement recommendations of the TensorRT developer guide show batch normalization fused
with the quantized convolution, "no need to simulate BN-folding"), so the engine runs
``conv(x, w * k) + bias * k + b`` with ``k`` inside the INT8 kernel's per-channel scale.

This module holds the two halves both forms use:

* *finding* a chain (`single_consumer`, `channel_vector`, `usable_factors`; `find_scale_folds` for the
  ``tensorrt`` form, `onnx_qat.insertion.ort_cpu` for the ``ort-cpu`` form's rule CPU2);
* *folding* it into the float weight before anything is quantized (`fold_scale_ops`, rule TRT1 of the
  ``tensorrt`` form): ``w[c] <- w[c] * k[c]``, ``bias <- bias * k + b`` (computed in float64, stored as
  float32), the Mul/Add removed, the convolution writing the last folded op's output tensor (so every
  name downstream, and every range a ScaleTable gives for it, still matches). The weight's scale is then
  chosen on the folded values: on the FP16 grid (`onnx_qat.formats.scale_grid`) it absorbs ``k``
  instead of FP16 float parts rounding ``k`` on its own (a per-channel factor of up to ``1 +- 2^-11``
  outside the quantized weight). The ``ort-cpu`` form folds after quantization instead (its weight
  integers and scales, exactly), see `onnx_qat.insertion.ort_cpu`.

A chain folds only where nothing else can see the tensors it removes: each intermediate tensor has one
reader, is not a graph output, not read inside an If/Loop/Scan body and not quantized; the weight is a
float32 constant read by this convolution only; the constants are finite float32 values broadcasting
along the channel axis only (scalar, ``[1, C, 1, 1]``, ``[C, 1, 1]``...), every factor non-zero and
within `FOLD_K_RANGE`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Collection, Dict, Iterable, List, Optional, Tuple

import numpy as np
import onnx

from .edit import fresh_name
from .index import GraphIndex, NodeInfo

logger = logging.getLogger(__name__)

#: Rule name of a scale fold in the ``tensorrt`` form (the ``ort-cpu`` form's is CPU2).
FOLD_RULE = "TRT1"
#: Convolutions a chain folds into (``ConvTranspose``: its output channel ``c`` is column
#: ``c mod (C_out / group)`` of group ``c div (C_out / group)`` of the weight ``[C_in, C_out / group, ...]``).
FOLD_OPS = ("Conv", "ConvTranspose")
#: Ops a chain is made of (each with one constant per-channel or scalar input).
CHAIN_OPS = ("Mul", "Add")
#: Largest and smallest ``|k|`` a fold accepts (the weight and its scale are multiplied by it).
FOLD_K_RANGE = (1e-20, 1e20)
#: The longest chain folded into one convolution.
MAX_CHAIN = 8
_FLOAT = onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class ScaleOpsFold:
    """A chain of per-channel ``Mul``/``Add`` ops folded into the convolution before it (rule TRT1).

    Attributes:
        node: the convolution's name; ``op_type`` its type (``Conv``, ``ConvTranspose``).
        weight: its weight tensor (same name after the fold, new values).
        ops: the folded nodes, in graph order; ``op_types`` their types.
        removed: the tensors the fold removes (the convolution's old output and those between the ops).
        output: the tensor the convolution writes after the fold (the last folded op's output).
        k: the product of the Mul factors per output channel; ``b`` the term added after it (the Adds'
            constants, scaled by later Muls): the chain computes ``y * k + b``.
    """

    node: str
    op_type: str
    weight: str
    ops: Tuple[str, ...]
    op_types: Tuple[str, ...]
    removed: Tuple[str, ...]
    output: str
    k: np.ndarray = field(compare=False, repr=False)
    b: np.ndarray = field(compare=False, repr=False)

    def record(self) -> dict:
        """The report record of this fold (`onnx_qat.rewrite.QuantizeResult.scale_folds`)."""
        shown = " and ".join(f"{t} {n!r}" for t, n in zip(self.op_types, self.ops))
        return {"node": self.node, "op_type": self.op_type, "rule": FOLD_RULE, "folded": list(self.ops),
                "folded_op_types": list(self.op_types), "output": self.output, "channels": int(self.k.size),
                "negative_k": int(np.count_nonzero(self.k < 0)),
                "reason": f"per-channel {shown} after {self.op_type} {self.node!r} folded into its weight "
                          "and bias before quantization (TensorRT fuses a scale into the convolution; the "
                          "weight scale then holds the factor)"}


# --------------------------------------------------------------------------- finding a chain
def single_consumer(tensor: str, op_types: Collection[str], index: GraphIndex, marked: Collection[str] = ()):
    """``(node, position)`` of the only reader of ``tensor`` when it is a standard two-input node of one
    of ``op_types`` with one output, and ``tensor`` is neither in ``marked`` (quantized) nor a graph
    output; else None."""
    consumers = index.consumers(tensor)
    if not tensor or tensor in marked or tensor in index.graph_outputs or len(consumers) != 1:
        return None
    node, position = consumers[0]
    if node.op_type not in op_types or not node.standard or len(node.inputs) != 2 or len(node.outputs) != 1 \
            or node.inputs[0] == node.inputs[1]:
        return None
    return node, position


def channel_vector(node: NodeInfo, position: int, index: GraphIndex, channels: int,
                   rank: int) -> Optional[np.ndarray]:
    """The other input of ``node`` as a float32 vector of length ``channels``, when it is a finite
    float32 initializer or Constant output that broadcasts against a rank-``rank`` NCHW... tensor along
    the channel axis only (scalar, ``[1, C, 1, 1]``, ``[C, 1, 1]``...); else None. ONNX broadcasting
    aligns shapes on the right, so a ``[C]`` vector runs along the last axis and does not fit."""
    other = node.inputs[1 - position]
    producer = index.producer.get(other)
    if other not in index.initializers and (producer is None or producer.op_type != "Constant"):
        return None
    proto = index.constant_proto(other)
    if proto is None or proto.data_type != _FLOAT or len(proto.dims) > rank:
        return None
    padded = (1,) * (rank - len(proto.dims)) + tuple(int(d) for d in proto.dims)
    if any(d != 1 for axis, d in enumerate(padded) if axis != 1) or padded[1] not in (1, channels):
        return None
    from onnx import numpy_helper

    values = numpy_helper.to_array(proto).astype(np.float32).reshape(-1)
    if not np.all(np.isfinite(values)):
        return None
    return np.ascontiguousarray(np.broadcast_to(values, (channels,)))


def usable_factors(k: np.ndarray) -> bool:
    """True when every non-zero ``|k|`` is within `FOLD_K_RANGE` (the weight scale is multiplied
    by it and must stay a positive finite float32)."""
    magnitude = np.abs(k[k != 0]).astype(np.float64)
    return bool(np.all((magnitude >= FOLD_K_RANGE[0]) & (magnitude <= FOLD_K_RANGE[1])))


def find_scale_folds(index: GraphIndex, convs: Iterable[str], *, marked: Collection[str] = (),
                     keep_weights: Collection[str] = ()) -> Tuple[ScaleOpsFold, ...]:
    """The chains to fold into the convolutions named in ``convs`` (in graph order; see the module
    docstring): none where the weight is in ``keep_weights`` (a given weight range, which describes the
    weight as it is) or a removed tensor is in ``marked``."""
    hidden = _read_in_bodies(index)
    scaled = _scaled_tensors(index)
    found = []
    for name in convs:
        node = index.by_name.get(name)
        if node is None or len(node.outputs) != 1 or node.outputs[0] not in scaled:
            continue  # no Mul/Add by a constant reads its output: `_chain` would find nothing
        fold = _chain(node, index, marked, keep_weights, hidden)
        if fold is not None:
            found.append(fold)
    found.sort(key=lambda f: index.by_name[f.node].position)
    return tuple(found)


def _scaled_tensors(index: GraphIndex) -> frozenset:
    """The tensors a standard two-input ``Mul`` or ``Add`` of `CHAIN_OPS` multiplies or adds a stored
    constant to (the other input an initializer or a ``Constant`` output): the only convolution outputs
    `_chain` can start a fold from (one pass over the nodes instead of a chain search per convolution)."""
    found = set()
    for node in index.nodes:
        if node.op_type in CHAIN_OPS and len(node.inputs) == 2:
            first, second = node.inputs
            if _stored_constant(second, index):
                found.add(first)
            if _stored_constant(first, index):
                found.add(second)
    return frozenset(found)


def _read_in_bodies(index: GraphIndex) -> frozenset:
    """Names read inside If/Loop/Scan bodies of the graph (outer-scope reads), which a fold must keep."""
    if not index.subgraph_nodes:
        return frozenset()
    from .edit import subgraph_names

    return frozenset(subgraph_names(index.by_name[n].proto for n in index.subgraph_nodes))


def _chain(node: NodeInfo, index: GraphIndex, marked, keep_weights, hidden) -> Optional[ScaleOpsFold]:
    """The fold for convolution ``node``, or None (see `find_scale_folds`)."""
    if node.op_type not in FOLD_OPS or not node.standard or len(node.inputs) < 2 or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    step = single_consumer(out, CHAIN_OPS, index, marked)  # most convolutions have none: checked first
    if step is None or out in hidden or not _stored_constant(step[0].inputs[1 - step[1]], index):
        return None  # a residual Add reads two activations: `channel_vector` would refuse it (no weight read)
    weight = node.inputs[1]
    made_by = index.producer.get(weight)
    stored = weight in index.initializers or (made_by is not None and made_by.op_type == "Constant")
    if weight in keep_weights or weight in hidden or not stored or len(index.consumers(weight)) != 1:
        return None
    proto = index.constant_proto(weight)
    if proto is None or proto.data_type != _FLOAT or len(proto.dims) < 3:
        return None
    channels = _out_channels(node, tuple(int(d) for d in proto.dims))
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    if channels is None or (bias and _bias_values(bias, index, channels) is None):
        return None
    rank = len(proto.dims)
    k, b = np.ones(channels, np.float64), np.zeros(channels, np.float64)
    ops: List[NodeInfo] = []
    removed = [out]
    while step is not None and len(ops) < MAX_CHAIN:
        op, position = step
        values = channel_vector(op, position, index, channels, rank)
        if values is None or op.inputs[1 - position] in hidden:
            break
        if op.op_type == "Mul":
            product = (k * values).astype(np.float32)
            if not np.all(product != 0) or not usable_factors(product):
                break
            k, b = k * values, b * values
        else:
            b = b + values
        ops.append(op)
        tail = op.outputs[0]
        step = single_consumer(tail, CHAIN_OPS, index, marked)
        if step is not None and tail in hidden:
            step = None
        if step is not None:
            removed.append(tail)
    if not ops:
        return None
    return ScaleOpsFold(node.name, node.op_type, weight, tuple(o.name for o in ops),
                        tuple(o.op_type for o in ops), tuple(removed[:len(ops)]), ops[-1].outputs[0],
                        k.astype(np.float32), b.astype(np.float32))


def _stored_constant(tensor: str, index: GraphIndex) -> bool:
    """True when ``tensor`` is an initializer or a ``Constant`` output: the first test of
    `channel_vector`, made before a chain's weight and bias are read."""
    if tensor in index.initializers:
        return True
    producer = index.producer.get(tensor)
    return producer is not None and producer.op_type == "Constant"


def _out_channels(node: NodeInfo, dims: Tuple[int, ...]) -> Optional[int]:
    """The output channels of convolution ``node`` with weight shape ``dims``."""
    if node.op_type == "Conv":
        return dims[0]
    group = node.attr("group", 1)
    return dims[1] * int(group) if group and dims[0] % int(group) == 0 else None


def _bias_values(bias: str, index: GraphIndex, channels: int) -> Optional[np.ndarray]:
    """The values of a convolution's bias when it is a float32 ``[C]`` initializer or ``Constant`` output
    (as Paddle's exporter writes biases); else None."""
    producer = index.producer.get(bias)
    if bias not in index.initializers and (producer is None or producer.op_type != "Constant"):
        return None
    proto = index.constant_proto(bias)
    if proto is None or proto.data_type != _FLOAT or tuple(proto.dims) != (channels,):
        return None
    from ..io.models import tensor_array

    return np.asarray(tensor_array(proto), np.float64)


# --------------------------------------------------------------------------- folding before quantization
def fold_scale_ops(model: onnx.ModelProto, index: GraphIndex,
                   folds: Iterable[ScaleOpsFold]) -> Tuple[str, ...]:
    """Fold each chain of ``folds`` (found on ``index``, an index of ``model`` as it is) into its
    convolution, editing ``model`` (a private copy) in place: new weight values under the same name, a
    bias (the old one's values changed in place where only this convolution reads it, else a new
    initializer), the Mul/Add nodes removed with the constants only they read, the convolution writing
    the fold's output. ``index`` is stale afterwards. Returns the names of the nodes removed (the folded
    ops, then the Constant nodes only they read)."""
    folds = tuple(folds)
    if not folds:
        return ()
    graph = model.graph
    gone_nodes: set = set()
    maybe_unread: List[str] = []
    names = set(index.initializers) | set(index.producer)
    released: List[str] = []  # biases a folded convolution no longer reads
    for fold in folds:
        conv = index.by_name[fold.node]
        _store(graph, index, fold.weight, scaled_weight(index, fold))
        old = _fold_bias(graph, index, conv, fold, names)
        if old:
            released.append(old)
        for op_name in fold.ops:
            op = index.by_name[op_name]
            gone_nodes.add(op.position)
            maybe_unread.extend(t for t in op.inputs if t and t not in fold.removed)
        conv.proto.output[0] = fold.output
        logger.debug("rule %s: %s %r folded %s", FOLD_RULE, fold.op_type, fold.node, ", ".join(fold.ops))
    constants = _drop_unread(graph, index, gone_nodes, maybe_unread + released, released)
    removed = {t for f in folds for t in f.removed}
    kept_info = [vi for vi in graph.value_info if vi.name not in removed]
    if len(kept_info) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
    return tuple(op for f in folds for op in f.ops) + constants


def scaled_weight(index: GraphIndex, fold: ScaleOpsFold) -> np.ndarray:
    """The weight of ``fold``'s convolution with output channel ``c`` multiplied by ``k[c]`` (computed in
    float64, returned as float32): the values the fold stores."""
    from ..io.models import tensor_array

    conv = index.by_name[fold.node]
    weight = np.asarray(tensor_array(index.constant_proto(conv.inputs[1])), np.float64)
    factors = fold.k.astype(np.float64)
    if conv.op_type == "Conv":
        scaled = weight * factors.reshape((-1,) + (1,) * (weight.ndim - 1))
    else:  # ConvTranspose [C_in, C_out / group, ...]: the rows of group g hold output channels g * C_out/g...
        group = int(conv.attr("group", 1))
        per = weight.shape[1]
        shaped = weight.reshape((group, weight.shape[0] // group) + weight.shape[1:])
        scaled = (shaped * factors.reshape((group, 1, per) + (1,) * (weight.ndim - 2))).reshape(weight.shape)
    return scaled.astype(np.float32)


def _fold_bias(graph: onnx.GraphProto, index: GraphIndex, conv: NodeInfo, fold: ScaleOpsFold,
               names: set) -> Optional[str]:
    """Give ``conv`` the bias ``bias * k + b``: in place where only it reads its bias initializer, else as a
    new initializer (a bias shared with other convolutions, or made by a Constant node, stays as it is).
    Returns the old bias when ``conv`` no longer reads it."""
    bias = conv.inputs[2] if len(conv.inputs) > 2 else ""
    old = np.zeros(fold.k.size) if not bias else _bias_values(bias, index, fold.k.size)
    values = (old * fold.k.astype(np.float64) + fold.b.astype(np.float64)).astype(np.float32)
    if bias and bias in index.initializers and len(index.consumers(bias)) == 1:
        _store(graph, index, bias, values)
        return None
    name = fresh_name(f"{conv.name}_folded_bias", names)
    graph.initializer.append(onnx.numpy_helper.from_array(values, name))
    if bias:
        conv.proto.input[2] = name
        return bias
    conv.proto.input.append(name)
    return None


def _store(graph: onnx.GraphProto, index: GraphIndex, tensor: str, values: np.ndarray) -> None:
    """Write ``values`` as the stored value of constant ``tensor`` (an initializer, or the ``value`` of
    the Constant node it comes from, through Identity nodes)."""
    new = onnx.numpy_helper.from_array(np.ascontiguousarray(values), tensor)
    proto = index.initializers.get(tensor)
    if proto is not None:
        proto.CopyFrom(new)
        return
    source, _ = index.constant_chain(tensor)
    if source in index.initializers:
        new.name = source
        index.initializers[source].CopyFrom(new)
        return
    node = index.producer[source].proto
    for attribute in node.attribute:
        if attribute.name == "value":
            new.name = attribute.t.name
            attribute.t.CopyFrom(new)


def _drop_unread(graph: onnx.GraphProto, index: GraphIndex, gone_nodes: set, candidates: List[str],
                 released: List[str]) -> Tuple[str, ...]:
    """Remove the nodes at positions ``gone_nodes``, then the constants in ``candidates`` (the removed
    nodes' other inputs, the ``released`` biases) that nothing reads any more: their initializers, and the
    Constant nodes making them (whose names are returned)."""
    readers: Dict[str, int] = {}
    for node in index.nodes:
        if node.position in gone_nodes:
            continue
        for t in node.inputs:
            if t:
                readers[t] = readers.get(t, 0) + 1
    for bias in released:  # one reader fewer each
        readers[bias] -= 1
        if not readers[bias]:
            del readers[bias]
    outputs = {o.name for o in graph.output}
    unread = {t for t in candidates if t not in readers and t not in outputs}
    constants = []
    for t in sorted(unread):
        producer = index.producer.get(t)
        if producer is not None and producer.op_type == "Constant":
            gone_nodes.add(producer.position)
            constants.append(producer.name)
    for position in sorted(gone_nodes, reverse=True):
        del graph.node[position]
    dropped = {t for t in unread if t in index.initializers}
    if dropped:
        kept = [t for t in graph.initializer if t.name not in dropped]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        inputs = [i for i in graph.input if i.name not in dropped]  # IR < 4 lists initializers as inputs
        if len(inputs) != len(graph.input):
            del graph.input[:]
            graph.input.extend(inputs)
    return tuple(constants)


__all__ = ["ScaleOpsFold", "find_scale_folds", "fold_scale_ops", "scaled_weight", "single_consumer",
           "channel_vector", "usable_factors", "FOLD_RULE", "FOLD_OPS", "CHAIN_OPS", "FOLD_K_RANGE",
           "MAX_CHAIN"]
