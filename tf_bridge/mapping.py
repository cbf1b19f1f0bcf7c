"""Map every quantizer of a Keras QAT model to the ONNX tensor tf2onnx made of it, by structure.

Both sides know the graph: the Keras model its layers and their inputs, the ONNX graph its nodes
and their names. tf2onnx keeps TensorFlow's op names, which carry the Keras layer scope
(``model_1/stem_conv_1/convolution``), so every node is read as belonging to a layer
(`tf_bridge.scopes.LayerScopes`); NHWC Transposes and other nodes tf2onnx adds itself
carry no scope and are walked through.

* **Weights.** The quantized kernel of a layer is the weight of the Conv, ConvTranspose, MatMul
  or Gemm in that layer's scope (or in the scope of the BatchNormalization reading it: tf2onnx
  names a Conv folded with its BatchNorm after the BatchNorm). Its values confirm it: every
  weighted node and kernel are brought to one canonical form, a matrix ``[output channel,
  rest]`` (Conv ``[O, I, k...]``, grouped Conv ``[C*m, 1, k...]`` for DepthwiseConv2D,
  ConvTranspose ``[I, O, k...]``, MatMul ``[K, N]``, Conv1D with its unit axis), and each output
  row of the ONNX weight must be the Keras row times one factor: 1, or the BatchNorm fold factor
  ``gamma / sqrt(var + eps)``. The per-channel amax then becomes ``amax * |factor|``, which is
  exact for symmetric per-channel quantization: ``fq(w * f) = f * fq(w)`` when the scale is
  ``max |w * f| / 127``. Only when no node carries the layer's scope are the weights looked for
  by their values in the whole graph (logged as a warning).
* **Activations.** A quantizer sits between a producer layer and its consumer layers. For a
  quantized weighted consumer the ONNX tensor is the activation input of its mapped node (before
  a Pad, TensorRT rule 8). For any other consumer (Add, Concatenate, Multiply, pooling...) it is
  each input of the consumer layer's nodes (`KERAS_TO_ONNX_OPS`, extended with
  `register_layer_ops`) that comes, through layout ops only, from a node of the producer
  layer's scope (`tf_bridge.scopes.LayerScopes.source`); a producer that leaves no node
  (Dropout, the input of a nested model) stands for what it reads
  (`tf_bridge.scopes.KerasGraph.sources`). No activation value is read, so the mapping is
  the same whatever the activations hold and on every run.
* A SeparableConv's depthwise output, quantized inside its wrapper, is the activation input of
  the pointwise Conv its pointwise kernel maps to: both convolutions run in INT8.
* A quantized weight whose ONNX node gets no quantized activation cannot run in INT8 in
  TensorRT; its fake-quantized values are written into the float weight instead ("baked"),
  so the ONNX model computes exactly what the Keras model computes.

Anything that cannot be mapped raises [`onnx_qat.errors.ExportError`][] naming every such
quantizer and its layer, in one line.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import keras
import numpy as np
import onnx
from onnx import numpy_helper

from onnx_qat.errors import ExportError
from onnx_qat.graph.index import GraphIndex, NodeInfo
from onnx_qat.graph.ops import WEIGHTED_OPS
from onnx_qat.placement.handlers import rule3_weight_axis
from onnx_qat.placement.marks import ActivationMark, Placement, WeightMark
from onnx_qat.scales import ScaleTable, WeightRange

from .custom_layers import registered_quantization
from .describe import QuantizerRecord, iter_quantizer_layers, quantizer_records
from .onnx_values import SAME_TENSOR_RTOL, value_error
from .quantizers import QuantizeWrapper
from .scopes import KerasGraph, LayerScopes, scope_operations
from .trace import LayerCall

logger = logging.getLogger(__name__)

_CONV = ("Conv",)
#: The ONNX ops that read a Keras layer's inputs, by layer class (the one table of per-class
#: knowledge; `register_layer_ops` adds a class). Weighted layers are found by their weights.
KERAS_TO_ONNX_OPS = {
    "Add": ("Add", "Sum"), "Subtract": ("Sub",), "Multiply": ("Mul",), "Concatenate": ("Concat",),
    "Average": ("Mean", "Add", "Sum", "Div", "Mul"), "Maximum": ("Max",), "Minimum": ("Min",),
    "AveragePooling1D": ("AveragePool",), "AveragePooling2D": ("AveragePool",),
    "AveragePooling3D": ("AveragePool",), "MaxPooling1D": ("MaxPool",), "MaxPooling2D": ("MaxPool",),
    "MaxPooling3D": ("MaxPool",), "GlobalAveragePooling1D": ("GlobalAveragePool", "ReduceMean"),
    "GlobalAveragePooling2D": ("GlobalAveragePool", "ReduceMean"),
    "GlobalAveragePooling3D": ("GlobalAveragePool", "ReduceMean"),
    "GlobalMaxPooling2D": ("GlobalMaxPool", "ReduceMax"),
    "Conv1D": _CONV, "Conv2D": _CONV, "Conv3D": _CONV, "DepthwiseConv1D": _CONV, "DepthwiseConv2D": _CONV,
    "SeparableConv1D": _CONV, "SeparableConv2D": _CONV, "Conv1DTranspose": ("ConvTranspose",),
    "Conv2DTranspose": ("ConvTranspose",), "Conv3DTranspose": ("ConvTranspose",),
    "Dense": ("MatMul", "Gemm"), "EinsumDense": ("MatMul", "Gemm", "Einsum"),
}
_REGISTERED_OPS: Dict[type, Tuple[str, ...]] = {}


def register_layer_ops(layer_class: type, onnx_ops: Sequence[str]) -> None:
    """Tell the mapping which ONNX op types read the inputs of ``layer_class`` (a custom layer
    whose tf2onnx conversion the table `KERAS_TO_ONNX_OPS` does not know)."""
    if not isinstance(layer_class, type) or not onnx_ops:
        raise ExportError("register_layer_ops: give a layer class and at least one ONNX op type")
    _REGISTERED_OPS[layer_class] = tuple(str(op) for op in onnx_ops)


def layer_onnx_ops(layer) -> Optional[Tuple[str, ...]]:
    """The ONNX op types that read ``layer``'s inputs: registered classes first (most derived),
    then the table by class name; None when unknown (any non-layout op of its scope)."""
    for cls in type(layer).__mro__:
        if cls in _REGISTERED_OPS:
            return _REGISTERED_OPS[cls]
    return KERAS_TO_ONNX_OPS.get(type(layer).__name__)


_ROW_RTOL = 1e-5
_AMAX_RTOL = 1e-6
RULE = "keras"


@dataclass(frozen=True)
class MappingEntry:
    """How one Keras quantizer landed in the ONNX graph.

    Attributes:
        quantizer: the Keras quantizer path (see [`tf_bridge.quantizer_records`][]).
        kind: ``"activation"`` or ``"weight"``.
        keras: what it quantizes in Keras (``"stem_relu:0 -> conv[0]"``, ``"conv.kernel"``).
        onnx_tensors: the ONNX tensors that carry it (activation input / weight initializer).
        onnx_nodes: the ONNX consumer nodes (activation) or weighted nodes (weight).
        amax: activation amax, or the largest per-channel weight amax after the fold.
        fold_factor: weights: ``(min, max)`` of ``|factor|`` applied per channel (1.0, 1.0 without a fold).
        note: ``"BatchNorm folded"``, ``"placed before Pad"``, ``"baked: ..."`` or ``""``.
    """

    quantizer: str
    kind: str
    keras: str
    onnx_tensors: Tuple[str, ...]
    onnx_nodes: Tuple[str, ...]
    amax: float
    fold_factor: Optional[Tuple[float, float]] = None
    note: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"quantizer": self.quantizer, "kind": self.kind, "keras": self.keras,
                "onnx_tensors": list(self.onnx_tensors), "onnx_nodes": list(self.onnx_nodes),
                "amax": self.amax,
                "fold_factor": None if self.fold_factor is None else list(self.fold_factor),
                "note": self.note}


@dataclass(frozen=True)
class KerasOnnxMapping:
    """The result of `map_quantizers`: entries, the placement and ScaleTable they define,
    and the float model to quantize (mapped weights snapped to the Keras int8 grid, see `_snap`)."""

    entries: Tuple[MappingEntry, ...]
    placement: Placement
    scales: ScaleTable
    model: onnx.ModelProto
    baked: Tuple[str, ...] = ()


# --------------------------------------------------------------------------- canonical weights
def _keras_canonical(layer, attr: str, kernel: np.ndarray) -> List[np.ndarray]:
    """``[output channel, rest]`` forms of a Keras kernel (several when the ONNX layout is ambiguous)."""
    k = _declared_layout(layer, attr, np.asarray(kernel, np.float64))
    nd = k.ndim
    spatial = tuple(range(nd - 2))
    L = keras.layers
    if attr == "depthwise_kernel" or isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
        flat = k.reshape(k.shape[:-2] + (-1,))  # [*k, C*m], channel c*m + j
        return [np.moveaxis(flat, -1, 0).reshape(flat.shape[-1], -1)]
    if isinstance(layer, (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)):
        t = k.transpose((nd - 2, nd - 1) + spatial)  # [O, I, *k]
        flipped = np.flip(t, axis=tuple(range(2, nd)))
        return [t.reshape(t.shape[0], -1), flipped.reshape(t.shape[0], -1)]
    if nd == 2:  # Dense [in, out]
        return [k.T]
    t = k.transpose((nd - 1, nd - 2) + spatial)  # Conv [O, I, *k]
    return [t.reshape(t.shape[0], -1)]


def _declared_layout(layer, attr: str, k: np.ndarray) -> np.ndarray:
    """A weight of a declared layer class (`tf_bridge.custom_layers`) with its output-channel
    axis moved last, the Dense/Conv kernel layout the forms below start from."""
    declared = registered_quantization(layer)
    axes = dict(declared.weights).get(attr) if declared is not None else None
    if not axes or len(axes) != 1:
        return k
    return np.moveaxis(k, axes[0] % k.ndim, -1)


def _input_weight(layer, attr: str) -> bool:
    """True for the weight whose ONNX node reads the layer's (quantized) input."""
    declared = registered_quantization(layer)
    if declared is not None:
        return attr == declared.input_weight
    return attr in ("kernel", "depthwise_kernel")


def _onnx_canonical(node: NodeInfo, w: np.ndarray) -> Optional[np.ndarray]:
    w = np.asarray(w, np.float64)
    op = node.op_type
    if op == "Conv" and w.ndim >= 3:
        return w.reshape(w.shape[0], -1)
    if op == "ConvTranspose" and w.ndim >= 3 and int(node.attr("group", 1) or 1) == 1:
        t = np.swapaxes(w, 0, 1)
        return t.reshape(t.shape[0], -1)
    if op == "Gemm" and w.ndim == 2:
        return w if int(node.attr("transB", 0) or 0) else w.T
    if op == "MatMul" and w.ndim == 2:
        return w.T
    return None


def keras_grid(rows: np.ndarray, amax) -> np.ndarray:
    """The int8 values the Keras QAT model uses for a kernel in canonical form (its numerics:
    ``clip(round_half_even(w / (amax / 127)), -127, 127)`` in float32, per output row)."""
    w = np.asarray(rows, np.float32)
    scale = (np.asarray(amax, np.float32) / np.float32(127.0)).astype(np.float32).reshape(-1, 1)
    return np.clip(np.round(w / scale), -127, 127).astype(np.float32)


def _onnx_layout(node: NodeInfo, canonical: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """Inverse of `_onnx_canonical`: a ``[output channel, rest]`` matrix in the node's weight layout."""
    if node.op_type == "Conv":
        return canonical.reshape(shape)
    if node.op_type == "ConvTranspose":
        return np.swapaxes(canonical.reshape((shape[1], shape[0]) + tuple(shape[2:])), 0, 1)
    if node.op_type == "Gemm" and int(node.attr("transB", 0) or 0):
        return canonical.reshape(shape)
    return canonical.T.reshape(shape)


def fold_factors(keras_rows: np.ndarray, onnx_rows: np.ndarray) -> Optional[np.ndarray]:
    """Per-row factors ``f`` with ``onnx_row == f * keras_row`` (float32 tolerance), or None."""
    if keras_rows.shape != onnx_rows.shape:
        return None
    rows = np.arange(keras_rows.shape[0])
    peak = np.argmax(np.abs(keras_rows), axis=1)
    k_peak = keras_rows[rows, peak]
    zero = k_peak == 0
    factors = np.where(zero, 1.0, onnx_rows[rows, peak] / np.where(zero, 1.0, k_peak))
    resid = np.max(np.abs(onnx_rows - factors[:, None] * keras_rows), axis=1)
    limit = _ROW_RTOL * np.max(np.abs(onnx_rows), axis=1) + 1e-30
    if np.all(resid <= limit) and np.all(np.isfinite(factors)):
        return factors
    return None


@dataclass(frozen=True)
class _WeightedNode:
    node: NodeInfo
    tensor: str
    values: np.ndarray
    canonical: np.ndarray
    axis: Optional[int]


def _weighted_nodes(index: GraphIndex) -> List[_WeightedNode]:
    found = []
    for node in index.nodes:
        if node.op_type not in WEIGHTED_OPS or len(node.inputs) < 2 or not index.is_constant(node.inputs[1]):
            continue
        values = numpy_helper.to_array(index.constant_proto(node.inputs[1]))
        canonical = _onnx_canonical(node, values)
        if canonical is None or values.dtype != np.float32:
            continue
        axis, _ = rule3_weight_axis(node, tuple(values.shape))
        found.append(_WeightedNode(node, node.inputs[1], values, canonical, axis))
    return found


# --------------------------------------------------------------------------- the mapper
@dataclass
class _WeightHit:
    record: QuantizerRecord
    target: _WeightedNode
    factors: np.ndarray
    grid: np.ndarray  # the Keras int8 values, [output channel, rest] in the ONNX weight's order


def _source_in(source: str, wanted) -> bool:
    """True when a scope from `LayerScopes.source` (possibly ``"a|b"``) is one of ``wanted``."""
    return bool(source) and any(s in wanted for s in source.split("|"))


class _Mapper:
    """Structure first: layer scopes of node names on the ONNX side, the layer graph on the Keras
    side; weight values confirm each weight (exactly, with the BatchNorm fold factor)."""

    def __init__(self, q_model, model: onnx.ModelProto,
                 keras_calls: Optional[Mapping[str, List[LayerCall]]] = None,
                 onnx_values: Optional[Mapping[str, np.ndarray]] = None):
        self.q_model = q_model
        self.model = model
        self.index = GraphIndex(model)
        self.calls = keras_calls or {}
        self.values = onnx_values or {}
        self.records = quantizer_records(q_model)
        self.wrappers = {p: layer for p, layer in iter_quantizer_layers(q_model)
                         if isinstance(layer, QuantizeWrapper)}
        self.weighted = _weighted_nodes(self.index)
        self.scopes = LayerScopes(q_model, self.index)
        inputs = [i.name for i in model.graph.input if not self.index.is_constant(i.name)]
        self.graph = KerasGraph(q_model, self.scopes.has_nodes, inputs)
        scope_operations(self.scopes, self.graph, layer_onnx_ops)
        self.layer_nodes: Dict[str, List[str]] = {}  # keras layer path -> entry ONNX nodes
        self.pointwise_nodes: Dict[str, List[str]] = {}  # SeparableConv path -> its pointwise Convs
        self.unmapped: List[str] = []
        self.by_values: List[str] = []

    # -- weights -------------------------------------------------------------------------
    def _scoped_weighted(self, path: str) -> List[_WeightedNode]:
        """Weighted nodes in the layer's scope, or in the scope of a BatchNormalization reading it
        (tf2onnx names a Conv folded with its BatchNorm after the BatchNorm)."""
        scopes = [path] + [c for c in self.graph.consumers(path)
                           if isinstance(self.graph.layer(c), keras.layers.BatchNormalization)]
        names = {n.name for s in scopes for n in self.scopes.nodes(s)}
        return [wn for wn in self.weighted if wn.node.name in names]

    def _confirm(self, rec: QuantizerRecord, forms, candidates):
        found = {}
        for wn in candidates:
            for form in forms:
                factors = fold_factors(form, wn.canonical)
                if factors is not None:
                    found.setdefault(wn.node.name, (wn, (factors, keras_grid(form, rec.amax))))
        return list(found.values())

    def map_weights(self) -> List[_WeightHit]:
        hits = []
        for rec in self.records:
            if rec.kind != "weight":
                continue
            wrapper = self.wrappers[rec.path]
            kernel = getattr(wrapper.layer, rec.tensor).numpy()
            forms = _keras_canonical(wrapper.layer, rec.tensor, kernel)
            found = self._confirm(rec, forms, self._scoped_weighted(rec.path))
            if not found:  # no node in the layer's scope: its weights, wherever they are
                found = self._by_input(rec.path, self._confirm(rec, forms, self.weighted))
                if found:
                    self.by_values.append(rec.path)
                    if not self.scopes.has_nodes(rec.path):  # merged by tf2onnx into an equal layer
                        scopes = {p for wn, _ in found for p in self.scopes.paths(wn.node.name)}
                        self.graph.alias(rec.path, scopes)
                    logger.warning("export_onnx: no ONNX node carries the scope of layer '%s'; its %s "
                                   "was found by its values in %s", rec.path, rec.tensor,
                                   ", ".join(wn.node.name for wn, _ in found))
            if not found:
                self.unmapped.append(f"{rec.path} ({type(wrapper.layer).__name__} '{rec.layer}'.{rec.tensor}:"
                                     " no ONNX weight holds these values)")
                continue
            for wn, (f, grid) in found:
                hits.append(_WeightHit(rec, wn, f, grid))
            if _input_weight(wrapper.layer, rec.tensor):
                self.layer_nodes[rec.path] = [wn.node.name for wn, _ in found]
            elif rec.tensor == "pointwise_kernel":
                self.pointwise_nodes[rec.path] = [wn.node.name for wn, _ in found]
        return hits

    def _by_input(self, path: str, found):
        """Several ONNX nodes hold the same weights: keep those whose input comes from the layer's
        producers (the layer graph), else those whose input holds the layer's input values."""
        if len(found) < 2:
            return found
        wanted = {s for p in self.graph.producers(path) for s in self.graph.sources(p)}
        kept = [(wn, f) for wn, f in found if _source_in(self._node_source(wn.node, 0), wanted)]
        if kept:
            return kept
        calls = self.calls.get(path, [])
        kept = [(wn, f) for wn, f in found if any(
            c.inputs and self._error(c.inputs[0], wn.node.inputs[0]) < SAME_TENSOR_RTOL for c in calls)]
        return kept or found

    def _node_source(self, node: NodeInfo, j: int) -> str:
        return self.scopes.source(node.inputs[j], node.name) or ""

    # -- activations -----------------------------------------------------------------------
    def consumer_inputs(self, rec: QuantizerRecord) -> List[Tuple[str, int, str]]:
        """``(ONNX node, input index, keras consumer)`` for every consumer of an activation quantizer:
        the inputs of the consumer layer's nodes that read what the quantizer's producer computes."""
        prefix = rec.path.rsplit("/", 1)[0] + "/" if "/" in rec.path else ""
        if rec.inside:  # a SeparableConv's depthwise output: the input of its pointwise Conv(s)
            nodes = self.pointwise_nodes.get(prefix + rec.inside, [])
            if not nodes:
                self.unmapped.append(f"{rec.path} (depthwise output of layer '{prefix + rec.inside}': "
                                     "no pointwise ONNX Conv found)")
            return [(n, 0, f"{rec.inside}[pointwise]") for n in nodes]
        wanted = self.graph.sources(rec.path)
        found = []
        for consumer in rec.consumers:
            name, index = consumer[:-1].rsplit("[", 1)
            path = prefix + name
            if path in self.layer_nodes:
                nodes = [self.index.by_name[n] for n in self.layer_nodes[path]]
                kept = [n for n in nodes if _source_in(self._node_source(n, 0), wanted)]
                found += [(n.name, 0, consumer) for n in (kept or nodes)]
                continue
            edges = self.edges_into(path, wanted)
            if not edges:
                what = type(self.graph.layer(path)).__name__
                self.unmapped.append(f"{rec.path} (input {index} of {what} layer '{path}': none of its ONNX "
                                     f"nodes reads the output of '{prefix + rec.layer}')")
                continue
            found += [(node, j, consumer) for node, j in edges]
        return found

    def edges_into(self, path: str, wanted, ops: Optional[Tuple[str, ...]] = None,
                   depth: int = 0) -> List[Tuple[str, int]]:
        """``(ONNX node, input index)`` of the nodes of layer ``path`` that read a scope in
        ``wanted``. A layer without nodes (tf2onnx merged a Concat into the next one, a nested
        model) passes the question on to the layers reading it (or, for a model, its inputs)."""
        layer = self.graph.layer(path)
        if depth > 8 or layer is None:
            return []
        if isinstance(layer, keras.Model):
            inner = [f"{path}/{t._keras_history[0].name}" for t in layer.inputs]
            return [e for p in inner for c in self.graph.consumers(p)
                    for e in self.edges_into(c, wanted, ops, depth + 1)]
        if not self.scopes.has_nodes(path):
            return [e for c in self.graph.consumers(path) for e in self.edges_into(c, wanted, ops, depth + 1)]
        expected = ops or layer_onnx_ops(layer)
        edges = [(n, j) for n, j, src in self.scopes.entry_edges(path) if _source_in(src, wanted)]
        preferred = [(n, j) for n, j in edges if expected is None or n.op_type in expected]
        return list(dict.fromkeys((n.name, j) for n, j in (preferred or edges)))

    def _error(self, keras_value: np.ndarray, tensor: str) -> float:
        """`value_error` of a Keras value against an ONNX tensor's value (inf when unknown)."""
        return value_error(keras_value, self.values.get(tensor, np.zeros(0)))


def _activation_source(index: GraphIndex, node_name: str,
                       input_index: int) -> Tuple[str, Tuple[str, int], str]:
    """The tensor to quantize for an ONNX input, before a Pad that feeds a weighted op (rule 8)."""
    node = index.by_name[node_name]
    tensor = node.inputs[input_index]
    pad = index.producer.get(tensor)
    if (node.op_type in WEIGHTED_OPS and pad is not None and pad.op_type == "Pad" and pad.inputs
            and not index.is_constant(pad.inputs[0])):
        return pad.inputs[0], (pad.name, 0), "placed before Pad"
    return tensor, (node_name, input_index), ""


def _same_amax(a: float, b: float) -> bool:
    return abs(a - b) <= _AMAX_RTOL * max(abs(a), abs(b))


class _Collector:
    """Activation marks by tensor, with their amax and Keras quantizers (rule 10: one per tensor)."""

    def __init__(self, index: GraphIndex):
        self.index = index
        self.consumers: Dict[str, set] = {}
        self.amax: Dict[str, float] = {}
        self.owners: Dict[str, List[str]] = {}
        self.claimed: Dict[Tuple[str, int], str] = {}
        self.groups: Dict[str, str] = {}

    def add(self, tensor: str, consumer: Tuple[str, int], amax: float, owner: str,
            group: Optional[str] = None) -> None:
        if tensor in self.amax and not _same_amax(self.amax[tensor], amax):
            raise ExportError(f"export_onnx: quantizers {self.owners[tensor][0]} and {owner} map to the "
                              f"same ONNX tensor '{tensor}' with different ranges "
                              f"({self.amax[tensor]:.6g} vs {amax:.6g})")
        if self.claimed.get(consumer, owner) != owner and tensor not in self.amax:
            raise ExportError(f"export_onnx: quantizers {self.claimed[consumer]} and {owner} both map to "
                              f"input {consumer[1]} of ONNX node '{consumer[0]}'")
        self.claimed[consumer] = owner
        if group is not None:
            self.groups.setdefault(tensor, group)
        self.amax.setdefault(tensor, amax)
        self.consumers.setdefault(tensor, set()).add(consumer)
        self.owners.setdefault(tensor, []).append(owner)

    def can_take(self, tensor: str, amax: float) -> bool:
        return tensor not in self.amax or _same_amax(self.amax[tensor], amax)

    def marks(self) -> Tuple[ActivationMark, ...]:
        order = {name: i for i, name in enumerate(self.index.all_tensor_names())}
        position = {n.name: n.position for n in self.index.nodes}
        marks = []
        for tensor in sorted(self.consumers, key=lambda t: (order.get(t, len(order)), t)):
            consumers = tuple(sorted(self.consumers[tensor], key=lambda c: (position[c[0]], c[1])))
            owners = ", ".join(dict.fromkeys(self.owners[tensor]))
            marks.append(ActivationMark(tensor, consumers, RULE, f"Keras quantizer {owners}",
                                        scale_group=self.groups.get(tensor)))
        return tuple(marks)


def _map_shared_concat(mapper: _Mapper, collector: _Collector, rec: QuantizerRecord, amax: float):
    """A quantizer on a Concatenate output whose inputs share its scale (TensorRT rule 7): every
    ONNX Concat input is quantized with that amax in one scale group (exactly the Keras numbers,
    fake quantization being elementwise); if an input already carries another range, the Concat
    output is quantized for all its consumers instead."""
    prefix = rec.path.rsplit("/", 1)[0] + "/" if "/" in rec.path else ""
    path = prefix + rec.layer
    nodes = [n for n in mapper.scopes.nodes(path) if n.op_type == "Concat"]
    if not nodes:  # tf2onnx merged this Concat into the Concat that consumes it
        return _map_merged_concat(mapper, collector, rec, path, amax)
    tensors, names = [], []
    for node in nodes:
        inputs = [(t, j) for j, t in enumerate(node.inputs) if t and not mapper.index.is_constant(t)]
        if all(collector.can_take(t, amax) and (node.name, j) not in collector.claimed for t, j in inputs):
            for t, j in inputs:
                collector.add(t, (node.name, j), amax, rec.path, group=f"concat:{node.name}")
            tensors += [t for t, _ in inputs]
            names.append(node.name)
            continue
        out = node.outputs[0]
        consumers = [(c.name, i) for c, i in mapper.index.consumers(out)]
        for consumer in consumers:
            collector.add(out, consumer, amax, rec.path)
        tensors.append(out)
        names += [c for c, _ in consumers]
    return tensors, names


def _map_merged_concat(mapper: _Mapper, collector: _Collector, rec: QuantizerRecord, path: str, amax: float):
    """A Keras Concatenate whose ONNX Concat was merged into its consumer's: quantize its inputs
    where the merged Concat reads them (the same numbers as quantizing its output), found as the
    Concat inputs, in the scopes of the layers reading it, that come from its inputs' producers."""
    tensors, nodes = [], []
    for i, producer in enumerate(mapper.graph.producers(path)):
        wanted = mapper.graph.sources(producer)
        edges = [e for c in mapper.graph.consumers(path)
                 for e in mapper.edges_into(c, wanted, ops=("Concat",))]
        edges = [(n, j) for n, j in edges if (n, j) not in collector.claimed]
        if not edges:
            mapper.unmapped.append(f"{rec.path} (input {i} of Concatenate '{path}': no ONNX Concat reads "
                                   f"the output of '{producer}')")
            continue
        for node, j in edges:
            tensor = mapper.index.by_name[node].inputs[j]
            collector.add(tensor, (node, j), amax, rec.path, group=f"concat:{path}")
            tensors.append(tensor)
            nodes.append(node)
    return tensors, nodes


def _map_activations(mapper: _Mapper, collector: _Collector) -> List[MappingEntry]:
    entries = []
    for rec in mapper.records:
        if rec.kind != "activation":
            continue
        amax = float(rec.amax)
        tensors, nodes, notes = [], [], set()
        for node, j, _ in mapper.consumer_inputs(rec):
            tensor, consumer, note = _activation_source(mapper.index, node, j)
            if note and not collector.can_take(tensor, amax):
                tensor, consumer, note = mapper.index.by_name[node].inputs[j], (node, j), ""
            collector.add(tensor, consumer, amax, rec.path)
            tensors.append(tensor)
            nodes.append(consumer[0])
            if note:
                notes.add(note)
        if rec.shared_with:
            t, n = _map_shared_concat(mapper, collector, rec, amax)
            tensors += t
            nodes += n
            notes.add("Concatenate inputs share its scale")
        if tensors:
            consumers = f"{rec.inside} (pointwise)" if rec.inside else ", ".join(rec.consumers)
            entries.append(MappingEntry(rec.path, "activation", f"{rec.tensor} -> {consumers}",
                                        tuple(dict.fromkeys(tensors)), tuple(dict.fromkeys(nodes)), amax,
                                        None, "; ".join(sorted(notes))))
    return entries


def _quantized_input_nodes(index: GraphIndex, collector: _Collector) -> set:
    """Nodes whose input 0 reads a quantized activation (directly, or through a quantized Pad)."""
    nodes = set()
    for consumers in collector.consumers.values():
        for name, i in consumers:
            node = index.by_name[name]
            if node.op_type == "Pad" and i == 0 and node.outputs:
                nodes.update(c.name for c, j in index.consumers(node.outputs[0]) if j == 0)
            elif i == 0:
                nodes.add(name)
    return nodes


def _weight_entries(hits: Sequence[_WeightHit], quantized_inputs: set):
    """Weight marks, ScaleTable ranges, baked weights and mapping entries for the weight hits."""
    marks, ranges, baked, entries, snapped = [], {}, {}, [], {}
    by_record: Dict[str, List[_WeightHit]] = {}
    for hit in hits:
        by_record.setdefault(hit.record.path + "." + hit.record.tensor, []).append(hit)
    for key, group in by_record.items():
        rec = group[0].record
        top, notes, tensors, nodes, fmin, fmax = 0.0, set(), [], [], np.inf, 0.0
        for hit in group:
            wn = hit.target
            amax = (np.asarray(rec.amax, np.float64) * np.abs(hit.factors)).astype(np.float32)
            amax = np.where(amax > 0, amax, np.float32(1.0))
            if not np.allclose(np.abs(hit.factors), 1.0, rtol=1e-6, atol=0):
                notes.add("BatchNorm folded")
            fmin = min(fmin, float(np.min(np.abs(hit.factors))))
            fmax = max(fmax, float(np.max(np.abs(hit.factors))))
            top = max(top, float(np.max(amax)))
            tensors.append(wn.tensor)
            nodes.append(wn.node.name)
            scale = (amax.astype(np.float64) / 127.0).astype(np.float32)  # as onnx_qat's inserter computes it
            sign = np.sign(hit.factors).astype(np.float32)[:, None]
            grid = (hit.grid * scale[:, None] * sign).astype(np.float32)
            snapped[wn.tensor] = _onnx_layout(wn.node, grid, tuple(wn.values.shape))
            if wn.node.name in quantized_inputs:
                marks.append(WeightMark(wn.tensor, wn.node.name, 1, wn.axis, RULE, f"Keras weight {key}"))
                ranges[wn.tensor] = WeightRange(wn.axis, tuple(float(a) for a in amax))
            else:
                baked[wn.tensor] = wn
                notes.add("baked: its input is not quantized, fake-quantized weights stored in float")
        entries.append(MappingEntry(rec.path, "weight", f"{rec.layer}.{rec.tensor}",
                                    tuple(dict.fromkeys(tensors)), tuple(dict.fromkeys(nodes)), top,
                                    (fmin, fmax), "; ".join(sorted(notes))))
    return marks, ranges, baked, entries, snapped


def _snap(model: onnx.ModelProto, snapped: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose mapped weights hold the Keras int8 values times their scales.

    Re-rounding a folded weight ``w * f`` can pick the other integer where ``w / s`` lies
    within float rounding of x.5; one such weight moves a whole step and deep networks
    carry that on. Snapped weights make the inserter's integers the Keras model's own.
    """
    if not snapped:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    index = GraphIndex(copy)
    for tensor, values in snapped.items():
        proto = index.constant_proto(tensor)
        proto.CopyFrom(numpy_helper.from_array(values.astype(np.float32), proto.name))
    return copy


def map_quantizers(q_model, model: onnx.ModelProto,
                   keras_calls: Optional[Mapping[str, List[LayerCall]]] = None,
                   onnx_values: Optional[Mapping[str, np.ndarray]] = None, *,
                   producer: str = "tf_bridge.export_onnx") -> KerasOnnxMapping:
    """Map every quantizer of ``q_model`` onto the float ONNX ``model`` tf2onnx made of its twin.

    Args:
        q_model: the Keras QAT model (read only).
        model: the float ONNX model of its float twin (not modified).
        keras_calls: optional, the twin's layer values on sample data
            (`tf_bridge.trace.trace_layers`); used only where a layer's weights are found
            outside its scope in several nodes.
        onnx_values: optional, the float ONNX model's tensor values on the same data, by name
            (same use).
        producer: the ScaleTable's producer text.

    Raises:
        ExportError: a quantizer is not calibrated or cannot be mapped (all such are named).
    """
    uncalibrated = [r.path for r in quantizer_records(q_model) if r.kind == "activation" and r.amax is None]
    if uncalibrated:
        raise ExportError(f"export_onnx: {len(uncalibrated)} activation quantizer(s) have no range: "
                          f"{', '.join(uncalibrated[:5])}; call tf_bridge.calibrate(q_model, data) first")
    mapper = _Mapper(q_model, model, keras_calls, onnx_values)
    hits = mapper.map_weights()
    collector = _Collector(mapper.index)
    act_entries = _map_activations(mapper, collector)
    if mapper.unmapped:
        more = len(mapper.unmapped) - 4
        shown = "; ".join(mapper.unmapped[:4]) + (f"; and {more} more" if more > 0 else "")
        raise ExportError(f"export_onnx: {len(mapper.unmapped)} quantizer(s) could not be mapped to the ONNX "
                          f"graph: {shown}; nothing was written")
    quantized_inputs = _quantized_input_nodes(mapper.index, collector)
    w_marks, ranges, baked, w_entries, snapped = _weight_entries(hits, quantized_inputs)
    position = {n.name: n.position for n in mapper.index.nodes}
    w_marks.sort(key=lambda m: position[m.node])
    table = ScaleTable(collector.amax, ranges, producer=producer)
    placement = Placement(collector.marks(), tuple(w_marks))
    return KerasOnnxMapping(tuple(act_entries + w_entries), placement, table, _snap(model, snapped),
                            tuple(sorted(baked)))
