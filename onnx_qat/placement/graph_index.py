"""A read-only index of an ONNX graph for placement: nodes, producers, consumers, constants.

Built once per graph in one pass over the protobuf (linear in graph size); every
placement question is then a dictionary lookup, never a search of the graph.
The index never copies weight data and never mutates the model.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import onnx
from onnx import helper

#: Domains that mean the standard ONNX operator set.
DEFAULT_DOMAINS = ("", "ai.onnx")
#: How far :meth:`GraphIndex.constant_source` follows Identity chains.
_MAX_IDENTITY_HOPS = 8


def unique_node_names(nodes: Iterable[onnx.NodeProto]) -> List[str]:
    """Stable, unique names for ``nodes`` in order: the node's own name, or ``<op_type>_<position>``
    when it has none; a repeated name gets ``_1``, ``_2``... appended."""
    used = set()
    names = []
    for position, node in enumerate(nodes):
        base = node.name or f"{node.op_type}_{position}"
        name, k = base, 1
        while name in used:
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        names.append(name)
    return names


def assign_node_names(model: onnx.ModelProto) -> None:
    """Give every node of ``model``'s main graph the name :func:`unique_node_names` chooses (in place).

    Use only on a model you own (``onnx_qat.quantize`` calls it on its private copy) so that
    placement marks and the inserted graph name the same nodes.
    """
    for node, name in zip(model.graph.node, unique_node_names(model.graph.node)):
        node.name = name


@dataclass(frozen=True)
class NodeInfo:
    """One node of the main graph, as placement sees it."""

    position: int
    name: str
    op_type: str
    domain: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    proto: onnx.NodeProto = field(repr=False, compare=False)

    def attr(self, name: str, default=None):
        """The value of attribute ``name`` (decoded), or ``default``."""
        for attribute in self.proto.attribute:
            if attribute.name == name:
                return helper.get_attribute_value(attribute)
        return default

    @property
    def standard(self) -> bool:
        """True for operators of the default ONNX domain."""
        return self.domain in DEFAULT_DOMAINS

    @property
    def has_subgraphs(self) -> bool:
        """True for control-flow nodes (If, Loop, Scan...) that hold graphs."""
        graph_types = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        return any(a.type in graph_types for a in self.proto.attribute)

    def data_inputs(self) -> Tuple[Tuple[int, str], ...]:
        """``(index, tensor)`` of the non-empty inputs."""
        return tuple((i, t) for i, t in enumerate(self.inputs) if t)


class GraphIndex:
    """Producer/consumer maps, constants and dtypes of a model's main graph.

    Args:
        model: the ModelProto (read, never changed).
    """

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        names = unique_node_names(graph.node)
        self.nodes: Tuple[NodeInfo, ...] = tuple(
            NodeInfo(i, names[i], n.op_type, n.domain, tuple(n.input), tuple(n.output), n)
            for i, n in enumerate(graph.node))
        self.by_name: Dict[str, NodeInfo] = {n.name: n for n in self.nodes}
        self.producer: Dict[str, NodeInfo] = {}
        consumers: Dict[str, List[Tuple[NodeInfo, int]]] = defaultdict(list)
        for node in self.nodes:
            for out in node.outputs:
                if out:
                    self.producer[out] = node
            for i, t in enumerate(node.inputs):
                if t:
                    consumers[t].append((node, i))
        self._consumers = dict(consumers)
        self.initializers: Dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
        self.graph_inputs = tuple(i.name for i in graph.input)
        self.graph_outputs = frozenset(o.name for o in graph.output)
        self.dtypes: Dict[str, int] = {}
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.dtypes[vi.name] = vi.type.tensor_type.elem_type
        for name, init in self.initializers.items():
            self.dtypes[name] = init.data_type
        self._is_constant: Dict[str, bool] = {}
        self._sorted: Optional[bool] = None

    # -- structure ------------------------------------------------------------------
    def consumers(self, tensor: str) -> List[Tuple[NodeInfo, int]]:
        """``(node, input index)`` pairs reading ``tensor`` (main graph only)."""
        return self._consumers.get(tensor, [])

    def all_tensor_names(self) -> Tuple[str, ...]:
        """Every tensor name of the main graph (inputs, outputs, initializers, node inputs/outputs)."""
        names = dict.fromkeys(self.graph_inputs)
        names.update(dict.fromkeys(self.initializers))
        for node in self.nodes:
            names.update(dict.fromkeys(t for t in node.inputs + node.outputs if t))
        names.update(dict.fromkeys(sorted(self.graph_outputs)))
        return tuple(names)

    def production_order(self) -> Dict[str, int]:
        """Tensor name -> the order in which the graph makes it (graph inputs first, then node outputs)."""
        order: Dict[str, int] = {}
        for name in self.graph_inputs:
            order.setdefault(name, len(order))
        for node in self.nodes:
            for out in node.outputs:
                order.setdefault(out, len(order))
        return order

    def is_topologically_sorted(self) -> bool:
        """True when every node comes after the producers of all its inputs (as ONNX requires);
        then every ancestor of a tensor is produced by an earlier node. Computed once, linear."""
        if self._sorted is None:
            producer = self.producer
            self._sorted = all(producer[t].position < node.position
                               for node in self.nodes for t in node.inputs if t in producer)
        return self._sorted

    # -- constants ------------------------------------------------------------------
    def constant_source(self, tensor: str) -> Optional[str]:
        """The initializer or ``Constant``-node output that ``tensor`` is (through Identity nodes), or None.

        An initializer also listed as a graph input counts as constant (old exporters list every
        initializer as an input; :func:`onnx_qat.model_io.load_model` removes those inputs).
        """
        for _ in range(_MAX_IDENTITY_HOPS):
            if tensor in self.initializers:
                return tensor
            node = self.producer.get(tensor)
            if node is None:
                return None
            if node.op_type == "Constant" and node.standard and node.attr("value") is not None:
                return tensor
            if node.op_type != "Identity" or not node.inputs:
                return None
            tensor = node.inputs[0]
        return None

    def is_constant(self, tensor: str) -> bool:
        """True when ``tensor`` is an initializer or a Constant (possibly through Identity); memoized,
        as placement asks about the same tensors many times."""
        known = self._is_constant.get(tensor)
        if known is None:
            known = self._is_constant[tensor] = self.constant_source(tensor) is not None
        return known

    def constant_proto(self, tensor: str) -> Optional[onnx.TensorProto]:
        """The TensorProto holding ``tensor``'s value (initializer or Constant ``value``), or None."""
        source = self.constant_source(tensor)
        if source is None:
            return None
        if source in self.initializers:
            return self.initializers[source]
        return self.producer[source].attr("value")

    def constant_shape(self, tensor: str) -> Optional[Tuple[int, ...]]:
        """The shape of a constant tensor (read from its dims; no data is decoded), or None."""
        proto = self.constant_proto(tensor)
        return None if proto is None else tuple(int(d) for d in proto.dims)

    def constant_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shape of every constant tensor name (initializers, Constant outputs, Identity of those)."""
        shapes = {name: tuple(int(d) for d in t.dims) for name, t in self.initializers.items()}
        for node in self.nodes:
            if node.op_type in ("Constant", "Identity") and node.outputs:
                shape = self.constant_shape(node.outputs[0])
                if shape is not None:
                    shapes[node.outputs[0]] = shape
        return shapes

    def dtype(self, tensor: str) -> Optional[int]:
        """The ONNX element type of ``tensor`` when the model declares it, else None."""
        known = self.dtypes.get(tensor)
        if known is not None:
            return known
        proto = self.constant_proto(tensor)
        return None if proto is None else proto.data_type

    def is_float_or_unknown(self, tensor: str) -> bool:
        """True unless the model declares ``tensor`` with a type other than float32."""
        dtype = self.dtype(tensor)
        return dtype is None or dtype == onnx.TensorProto.FLOAT
