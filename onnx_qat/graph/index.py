"""A read-only index of an ONNX graph for placement: nodes, producers, consumers, constants.

Built once per graph in one pass over the protobuf (linear in graph size); every
placement question is then a dictionary lookup, never a search of the graph.
The index never copies weight data and never mutates the model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain, compress
from math import prod
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import onnx
from onnx import helper

from .constants import CONSTANT_PASS_OPS, MAX_CONSTANT_HOPS

logger = logging.getLogger(__name__)

#: Domains that mean the standard ONNX operator set.
DEFAULT_DOMAINS = ("", "ai.onnx")
#: Element types whose raw little-endian bytes `GraphIndex.decode_initializers` joins into shared buffers
#: (the float types of weights), with their NumPy types.
_JOINED_TYPES = {onnx.TensorProto.FLOAT: np.dtype("<f4"), onnx.TensorProto.FLOAT16: np.dtype("<f2"),
                 onnx.TensorProto.DOUBLE: np.dtype("<f8")}
#: Raw bytes `GraphIndex.decode_initializers` joins at most into one buffer (a larger tensor is read alone).
JOIN_MOST = 1 << 24


def unique_node_names(nodes: Iterable[onnx.NodeProto]) -> List[str]:
    """Stable, unique names for ``nodes`` in order: the node's own name, or ``<op_type>_<position>``
    when it has none; a repeated name gets ``_1``, ``_2``... appended."""
    nodes = list(nodes)
    return _unique_names([n.name for n in nodes], [n.op_type for n in nodes])


def _unique_names(names: List[str], op_types: List[str]) -> List[str]:
    """`unique_node_names` from the names and op types already read from the nodes.

    A model whose nodes all have distinct non-empty names (every model ``onnx_qat.quantize``
    indexes, after `assign_node_names`) keeps them as they are, checked with one set.
    """
    if all(names) and len(set(names)) == len(names):
        return list(names)
    used = set()
    unique = []
    for position, (own, op_type) in enumerate(zip(names, op_types)):
        base = own or f"{op_type}_{position}"
        name, k = base, 1
        while name in used:
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        unique.append(name)
    return unique


def assign_node_names(model) -> None:
    """Give every node of ``model``'s main graph the name `unique_node_names` chooses (in place),
    and likewise every node of each subgraph (unique within its own graph).

    Use only on a model you own (``onnx_qat.quantize`` calls it on its private copy) so that
    placement marks and the inserted graph name the same nodes. Only names that change are
    written. ``model`` may also be a GraphProto.
    """
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    nodes = list(graph.node)
    own = [n.name for n in nodes]
    for node, before, name in zip(nodes, own, _unique_names(own, [n.op_type for n in nodes])):
        if name != before:
            node.name = name
        if node.attribute:
            for sub in subgraphs_of(node):
                assign_node_names(sub[2])


def subgraphs_of(node: onnx.NodeProto) -> List[Tuple[str, int, onnx.GraphProto]]:
    """``(attribute name, position, graph)`` of every graph ``node`` holds (an If's ``then_branch``
    and ``else_branch``, a Loop's or Scan's ``body``); position counts within a GRAPHS attribute."""
    found = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            found.append((attribute.name, 0, attribute.g))
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            found.extend((attribute.name, i, g) for i, g in enumerate(attribute.graphs))
    return found


_GRAPH_ATTRIBUTE_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


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

    def __init__(self, position: int, name: str, op_type: str, domain: str, inputs: Tuple[str, ...],
                 outputs: Tuple[str, ...], proto: onnx.NodeProto):
        # The same fields the generated __init__ sets, stored straight into the instance dict
        # (the generated one of a frozen dataclass calls object.__setattr__ once per field,
        # twice as slow; the index makes one NodeInfo per node).
        fields = self.__dict__
        fields["position"] = position
        fields["name"] = name
        fields["op_type"] = op_type
        fields["domain"] = domain
        fields["inputs"] = inputs
        fields["outputs"] = outputs
        fields["proto"] = proto

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
        return any(a.type in _GRAPH_ATTRIBUTE_TYPES for a in self.proto.attribute)


def _join(dtype: np.dtype, items: list, arrays: Dict[str, np.ndarray]) -> np.ndarray:
    """One read-only array of ``dtype`` over the joined raw bytes of ``items`` (``(name, raw bytes, shape,
    count)``, as `GraphIndex.decode_initializers` queues them); each item's view of its slice, in its shape,
    goes to ``arrays`` under its name."""
    joined = np.frombuffer(items[0][1] if len(items) == 1 else b"".join([item[1] for item in items]), dtype)
    start = 0
    for name, _, shape, count in items:
        arrays[name] = joined[start:start + count].reshape(shape)
        start += count
    return joined


#: Float element types other than float32: a model holding them may compute in them.
_OTHER_FLOATS = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})
_FLOAT_TYPES = _OTHER_FLOATS | {onnx.TensorProto.FLOAT}


def weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose float initializers of more than 64 values keep their type and dims but
    not their data: shape and type inference need only those (and the values of small integer constants
    such as Reshape shapes), and copying ResNet50's 100 MB of weights would cost more than the inference."""
    from ..io.models import copy_except_initializers

    probe = copy_except_initializers(model)
    for init in model.graph.initializer:
        size = int(np.prod(init.dims)) if init.dims else 1
        if init.data_type in _FLOAT_TYPES and size > 64:
            probe.graph.initializer.add(name=init.name, data_type=init.data_type, dims=init.dims)
        else:
            probe.graph.initializer.append(init)
    return probe


#: Ops that can make a float tensor of a type no input of theirs has (from an attribute, or CastLike from its
#: second input's type).
_TYPE_SOURCES = frozenset({"Cast", "CastLike", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal",
                           "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli"})


def _holds_other_floats(graph: onnx.GraphProto, op_types: List[str], protos: list) -> bool:
    """Whether the main graph ``graph`` may compute in a float type other than float32 (FP16, BF16,
    double). An activation of such a type starts at a graph input of that type or at a node that makes
    a type its inputs do not have (`_TYPE_SOURCES`: a Cast to it, a Constant of it...): every other op
    computes in its inputs' type, and a float32 activation cannot meet another float type without a
    Cast. Weights alone are not looked at (rule 9 asks for their own types)."""
    if not _OTHER_FLOATS.isdisjoint(v.type.tensor_type.elem_type for v in graph.input):
        return True
    found = _TYPE_SOURCES.intersection(op_types)  # one C-level pass: most graphs end here
    if not found:
        return False
    if "CastLike" in found:
        return True
    for i in compress(range(len(op_types)), map(found.__contains__, op_types)):
        for a in protos[i].attribute:
            if a.name in ("to", "dtype") and a.i in _OTHER_FLOATS \
                    or a.name == "value" and a.t.data_type in _OTHER_FLOATS:
                return True
    return False


class GraphIndex:
    """Producer/consumer maps, constants and dtypes of a model's main graph (or of one subgraph).

    Each protobuf field of a node is read once, while indexing (every read of a protobuf field
    builds new Python objects); the consumer map and the set of nodes holding subgraphs are
    built on first use, as only some callers need them.

    Args:
        model: the ModelProto (read, never changed unless ``assign_names``), or a GraphProto: a subgraph
            (an If branch).
        outer: for a subgraph, the index of the graph holding it. Names the subgraph reads but does
            not define resolve through it (outer-scope scoping, as ONNX defines it): an outer
            initializer or Constant output is a constant here too, and outer declared types apply.
        assign_names: first give the model's nodes the names `assign_node_names` gives them (in place:
            only on a model you own), reading each node's name, op type and attributes once for both
            (the nodes holding subgraphs are then known without a second pass, `subgraph_nodes`).
    """

    def __init__(self, model, outer: Optional["GraphIndex"] = None, *, assign_names: bool = False):
        graph = model.graph if isinstance(model, onnx.ModelProto) else model
        self.outer = outer
        protos = list(graph.node)
        op_types = [n.op_type for n in protos]
        own = [n.name for n in protos]
        names = _unique_names(own, op_types)
        self._subgraph_nodes: Optional[frozenset] = None
        if assign_names:  # assign_node_names, from the columns read here (one read of each field)
            if names != own:
                for node, before, name in zip(protos, own, names):
                    if name != before:
                        node.name = name
            holders = [i for i, n in enumerate(protos)
                       if n.attribute and any(a.type in _GRAPH_ATTRIBUTE_TYPES for a in n.attribute)]
            for i in holders:
                for sub in subgraphs_of(protos[i]):
                    assign_node_names(sub[2])
            self._subgraph_nodes = frozenset(names[i] for i in holders)
        # One comprehension per field, and NodeInfo mapped over the columns (no generator frame per
        # node); ``field[:]`` copies a repeated string field to a list faster than iterating it.
        outputs = [tuple(n.output[:]) for n in protos]
        self.nodes: Tuple[NodeInfo, ...] = tuple(map(
            NodeInfo, range(len(protos)), names, op_types, [n.domain for n in protos],
            [tuple(n.input[:]) for n in protos], outputs, protos))
        self.by_name: Dict[str, NodeInfo] = dict(zip(names, self.nodes))  # the names are unique
        self.producer: Dict[str, NodeInfo] = {out: node for node, made in zip(self.nodes, outputs)
                                              for out in made if out}
        self._consumers: Optional[Dict[str, List[Tuple[NodeInfo, int]]]] = None
        self.initializers: Dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
        self.graph_inputs = tuple(i.name for i in graph.input)
        self.graph_outputs = frozenset(o.name for o in graph.output)
        #: Element types declared by graph inputs, outputs and value_info (an initializer's own
        #: type, read when asked, comes first: see `dtype`).
        self.declared_dtypes: Dict[str, int] = {}
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.declared_dtypes[vi.name] = vi.type.tensor_type.elem_type
        self._declarations = (graph.input, graph.output, graph.value_info)  # ranks read when first asked
        self._ranks: Optional[Dict[str, int]] = None
        if outer is None and isinstance(model, onnx.ModelProto) \
                and _holds_other_floats(graph, op_types, protos):
            self._infer_dtypes(model)
        self._folded: Dict[str, onnx.TensorProto] = {}
        self._arrays: Dict[str, np.ndarray] = {}  # see initializer_array
        self._constants = self._constant_names()
        self._sorted: Optional[bool] = None

    def _infer_dtypes(self, model: onnx.ModelProto) -> None:
        """Add the element types onnx type inference gives to the tensors no declaration types: in a model
        that may compute in FP16, BF16 or double, an undeclared tensor is not float32 by default (rule 9
        and every ``is_float_or_unknown`` ask: a Q/DQ pair on an FP16 tensor at opset 13 is an invalid
        model). Float32 models, nearly all, skip this."""
        try:
            inferred = onnx.shape_inference.infer_shapes(weightless_copy(model))
        except Exception as exc:  # noqa: BLE001 - inference failing leaves the declared types only
            logger.info("type inference of a model holding FP16/BF16/double values failed (%s); "
                        "undeclared tensors are taken as float32", exc)
            return
        for vi in chain(inferred.graph.value_info, inferred.graph.output):
            elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
            if elem and vi.name not in self.declared_dtypes:
                self.declared_dtypes[vi.name] = elem

    def release(self) -> None:
        """Drop this index's tables (the nodes, producers, initializers, decoded weights...) for an owner done
        with it while other references to it live on a little longer (`onnx_qat.rewrite` releases the index
        of the model it rewrote before the edit's commit, whose result then reuses their memory). The index
        then describes an empty graph: ask it nothing more."""
        self.nodes, self.graph_inputs, self.graph_outputs = (), (), frozenset()
        self.by_name, self.producer, self.initializers = {}, {}, {}
        self.declared_dtypes, self._folded, self._arrays = {}, {}, {}
        self._declarations, self._ranks = (), None
        self._consumers, self._constants, self._subgraph_nodes = None, frozenset(), frozenset()
        self._sorted = None

    def _constant_names(self) -> frozenset:
        """Every tensor name `constant_source` resolves: the initializers, and outputs of
        Constant and Identity nodes that resolve (no other tensor can), so that
        `is_constant` is one set lookup."""
        names = set(self.initializers)
        for node in self.nodes:
            if node.op_type == "Constant" or node.op_type in CONSTANT_PASS_OPS:
                names.update(t for t in node.outputs if self.constant_source(t) is not None)
        if self.outer is not None:  # outer-scope constants this subgraph reads
            local = set(self.producer) | set(self.graph_inputs)
            names.update(t for node in self.nodes for t in node.inputs
                         if t and t not in local and self.outer.is_constant(t))
        return frozenset(names)

    # -- structure ------------------------------------------------------------------
    def consumers(self, tensor: str) -> List[Tuple[NodeInfo, int]]:
        """``(node, input index)`` pairs reading ``tensor`` (main graph only)."""
        if self._consumers is None:
            consumers: Dict[str, List[Tuple[NodeInfo, int]]] = {}
            get = consumers.get
            for node in self.nodes:
                i = 0  # counted by hand: a third faster than enumerate over ~10^5 edges
                for t in node.inputs:
                    if t:
                        found = get(t)
                        if found is None:
                            consumers[t] = [(node, i)]
                        else:
                            found.append((node, i))
                    i += 1
            self._consumers = consumers
        return self._consumers.get(tensor, [])

    @property
    def subgraph_nodes(self) -> frozenset:
        """Names of the nodes holding subgraphs (If, Loop, Scan...: `NodeInfo.has_subgraphs`);
        found on first use by reading the attributes of the nodes that have any."""
        if self._subgraph_nodes is None:
            found = []
            for node in self.nodes:
                attributes = node.proto.attribute
                if attributes and any(a.type in _GRAPH_ATTRIBUTE_TYPES for a in attributes):
                    found.append(node.name)
            self._subgraph_nodes = frozenset(found)
        return self._subgraph_nodes

    def all_tensor_names(self) -> Tuple[str, ...]:
        """Every tensor name of the main graph (inputs, outputs, initializers, node inputs/outputs)."""
        names = dict.fromkeys(self.graph_inputs)
        names.update(dict.fromkeys(self.initializers))
        names.update(dict.fromkeys(t for node in self.nodes for t in node.inputs + node.outputs if t))
        names.update(dict.fromkeys(sorted(self.graph_outputs)))
        return tuple(names)

    def has_tensor(self, tensor: str) -> bool:
        """True when ``tensor`` is a graph input or output, an initializer or a node's output here: a
        tensor of the graph found by dictionary lookups (a name only node inputs hold, such as an
        outer-scope name a subgraph reads, is in `all_tensor_names` but not found here)."""
        return tensor in self.producer or tensor in self.initializers or tensor in self.graph_outputs \
            or tensor in self.graph_inputs

    def production_order(self) -> Dict[str, int]:
        """Tensor name -> the order in which the graph makes it (graph inputs first, then node outputs); the
        mapping iterates in that order."""
        made = dict.fromkeys(self.graph_inputs)
        made.update(dict.fromkeys(chain.from_iterable([node.outputs for node in self.nodes])))
        return dict(zip(made, range(len(made))))

    def is_topologically_sorted(self) -> bool:
        """True when every node comes after the producers of all its inputs (as ONNX requires);
        then every ancestor of a tensor is produced by an earlier node. Computed once, linear."""
        if self._sorted is None:
            producer = self.producer
            self._sorted = all(producer[t].position < node.position
                               for node in self.nodes for t in node.inputs if t in producer)
        return self._sorted

    # -- constants ------------------------------------------------------------------
    def constant_chain(self, tensor: str) -> Optional[Tuple[str, Tuple[NodeInfo, ...]]]:
        """``(source, chain)`` when ``tensor`` is constant (`onnx_qat.graph.constants`): the
        initializer or ``Constant``-node output it comes from, and the nodes of
        `CONSTANT_PASS_OPS` between (nearest ``tensor`` first, each
        with constant other inputs); None when it is not constant. An outer-scope constant has an
        empty chain here (its own graph's index knows the rest).

        An initializer also listed as a graph input counts as constant (old exporters list every
        initializer as an input; `onnx_qat.io.models.load_model` removes those inputs).
        """
        chain: List[NodeInfo] = []
        for _ in range(MAX_CONSTANT_HOPS):
            if tensor in self.initializers:
                return tensor, tuple(chain)
            node = self.producer.get(tensor)
            if node is None:
                outer = self.outer
                if outer is None or tensor in self.graph_inputs or outer.constant_source(tensor) is None:
                    return None
                return tensor, tuple(chain)
            if node.op_type == "Constant" and node.standard and node.attr("value") is not None:
                return tensor, tuple(chain)
            if node.op_type not in CONSTANT_PASS_OPS or not node.standard or not node.inputs \
                    or any(t and self.constant_source(t) is None for t in node.inputs[1:]):
                return None
            chain.append(node)
            tensor = node.inputs[0]
        return None

    def constant_source(self, tensor: str) -> Optional[str]:
        """The initializer or ``Constant``-node output that ``tensor`` comes from (see
        `constant_chain`), or None when ``tensor`` is not constant."""
        found = self.constant_chain(tensor)
        return None if found is None else found[0]

    def is_constant(self, tensor: str) -> bool:
        """True when ``tensor`` is constant: an initializer or a Constant, possibly through the ops of
        `CONSTANT_PASS_OPS` (one meaning everywhere)."""
        return tensor in self._constants

    def is_stored_constant(self, tensor: str) -> bool:
        """True when ``tensor`` is constant and its value is the stored one (through Identity nodes
        at most): what a pass may edit in place (AWQ, GPTQ); a folded constant is computed."""
        found = self.constant_chain(tensor) if tensor in self._constants else None
        return found is not None and all(n.op_type == "Identity" for n in found[1])

    def constant_proto(self, tensor: str) -> Optional[onnx.TensorProto]:
        """The TensorProto holding ``tensor``'s value (initializer or Constant ``value``), or None; for
        a constant folded through Transpose, Reshape... a new TensorProto of the folded value (made
        once; editing it changes nothing in the model)."""
        found = self.initializers.get(tensor)
        if found is not None or tensor not in self._constants:
            return found
        source, chain = self.constant_chain(tensor)
        proto = self._stored_proto(source)
        if all(n.op_type == "Identity" for n in chain):
            return proto
        folded = self._folded.get(tensor)
        if folded is None:
            from onnx import numpy_helper

            from .constants import fold_chain

            def value_of(name):
                other = self.constant_proto(name)
                return None if other is None else numpy_helper.to_array(other)

            value = fold_chain([n.proto for n in chain], numpy_helper.to_array(proto), value_of)
            folded = self._folded[tensor] = numpy_helper.from_array(np.ascontiguousarray(value), tensor)
        return folded

    def initializer_array(self, name: str) -> np.ndarray:
        """The value of initializer ``name`` as a read-only array (`onnx_qat.io.models.tensor_array`),
        decoded once: the refusal of non-finite weights and the inserter (through `GraphEdit`, which
        takes this index from given scales) read the same 10^4-10^5 weights (the refusal decodes them at
        once, `decode_initializers`). A weight of `JOIN_MOST` bytes or more is decoded again each time
        instead of kept: kept, every large weight of a model was held twice (its protobuf bytes and its
        array), 2.35 GB more for a model of 2.35 GB of weights. KeyError when ``name`` is no initializer
        of this graph."""
        found = self._arrays.get(name)
        if found is None:
            from ..io.models import tensor_array

            found = tensor_array(self.initializers[name])
            if found.nbytes < JOIN_MOST:  # a large weight is decoded each time it is asked for
                self._arrays[name] = found
        return found

    def decode_initializers(self, names: Iterable[str]) -> Iterator[np.ndarray]:
        """Decode the initializers ``names`` of this graph (KeyError for another name) for `initializer_array`
        in one go, and yield flat read-only arrays that together hold every value of ``names``, each value
        once (a name given twice counts once). A generator: a tensor of `JOIN_MOST` bytes or more is decoded
        when its array is asked for and not kept (`initializer_array`), so a caller that checks the arrays
        one by one holds one large weight's copy at a time.

        The raw little-endian bytes of float tensors (float32, float16, float64 held in ``raw_data``) are
        joined per element type into buffers of at most `JOIN_MOST` bytes, each read as one array, of which
        each tensor's array is a view (the values, type and shape `onnx_qat.io.models.tensor_array` gives,
        read-only): a check of all values (the refusal of non-finite weights) is then one NumPy call per
        buffer instead of one per weight, and each weight costs a slice instead of a decoding. A tensor
        decoded before (its array is returned whole), of another type or form, or whose raw bytes do not
        fit its dims, is decoded as `initializer_array` decodes it."""
        arrays, initializers = self._arrays, self.initializers
        queued: Dict[np.dtype, list] = {}  # NumPy type -> [(name, raw bytes, shape, count)]
        sizes: Dict[np.dtype, int] = {}
        default = onnx.TensorProto.DEFAULT
        for name in dict.fromkeys(names):
            known = arrays.get(name)
            if known is None:
                tensor = initializers[name]
                dtype = _JOINED_TYPES.get(tensor.data_type)
                if dtype is not None and tensor.data_location == default and tensor.HasField("raw_data"):
                    raw, shape = tensor.raw_data, tuple(tensor.dims[:])
                    count = prod(shape)
                    if len(raw) == count * dtype.itemsize:
                        if len(raw) >= JOIN_MOST:  # alone, not kept: no joined copy of a large tensor
                            yield _join(dtype, [(name, raw, shape, count)], {})
                            raw = None  # not held while the next one is read
                            continue
                        items = queued.setdefault(dtype, [])
                        items.append((name, raw, shape, count))
                        sizes[dtype] = sizes.get(dtype, 0) + len(raw)
                        if sizes[dtype] >= JOIN_MOST:
                            yield _join(dtype, items, arrays)
                            queued[dtype], sizes[dtype] = [], 0
                        continue
                known = self.initializer_array(name)
            yield known.reshape(-1)
        for dtype, items in queued.items():
            if items:
                yield _join(dtype, items, arrays)

    def _stored_proto(self, source: str) -> Optional[onnx.TensorProto]:
        if source in self.initializers:
            return self.initializers[source]
        if source not in self.producer or source in self.graph_inputs:  # an outer-scope constant
            return self.outer.constant_proto(source)
        return self.producer[source].attr("value")

    def constant_shape(self, tensor: str) -> Optional[Tuple[int, ...]]:
        """The shape of a constant tensor (read from its dims; no data is decoded), or None."""
        proto = self.constant_proto(tensor)
        # dims[:] copies the int64 dims as Python ints in one call
        return None if proto is None else tuple(proto.dims[:])

    def constant_shapes(self, only: Optional[Iterable[str]] = None) -> Dict[str, Tuple[int, ...]]:
        """Shape of every constant tensor name (initializers, Constant outputs, and what passes them on);
        with ``only``, of those of its names that are constant (the same shapes, the others not read: a
        ScaleTable's weights are checked against a few shapes, not the 10^4-10^5 of a large graph)."""
        if only is None:
            wanted = None
            shapes = {name: tuple(t.dims[:]) for name, t in self.initializers.items()}
        else:
            wanted = frozenset(only)
            initializers = self.initializers
            shapes = {name: tuple(initializers[name].dims[:]) for name in wanted if name in initializers}
            if not wanted.intersection(self._constants).difference(shapes):
                return shapes  # no Constant output (or what passes one on) asked for
        for node in self.nodes:
            if (node.op_type == "Constant" or node.op_type in CONSTANT_PASS_OPS) and node.outputs \
                    and node.outputs[0] in self._constants and (wanted is None or node.outputs[0] in wanted):
                shape = self.constant_shape(node.outputs[0])
                if shape is not None:
                    shapes[node.outputs[0]] = shape
        return shapes

    def dtype(self, tensor: str) -> Optional[int]:
        """The ONNX element type of ``tensor`` when the model declares it, else None: an initializer's
        own type, else the type the graph declares for it (in a model that may compute in FP16, BF16 or
        double: or the type onnx type inference gives it, `_infer_dtypes`), else a Constant's value
        type."""
        init = self.initializers.get(tensor)
        if init is not None:
            return init.data_type
        known = self._declared(tensor)
        if known is not None:
            return known
        proto = self.constant_proto(tensor)
        return None if proto is None else proto.data_type

    def _declared(self, tensor: str) -> Optional[int]:
        """The element type declared for ``tensor`` here, else (a name this subgraph does not
        define) in the outer scope."""
        known = self.declared_dtypes.get(tensor)
        if known is None and self.outer is not None and tensor not in self.producer:
            return self.outer._declared(tensor)
        return known

    def declared_rank(self, tensor: str) -> Optional[int]:
        """The rank the graph declares for ``tensor`` (a graph input, output or value_info with a shape,
        its dimensions known or not), else None. Read from the declarations when first asked: most
        rewrites never ask."""
        if self._ranks is None:
            self._ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in chain(*self._declarations)
                           if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
        return self._ranks.get(tensor)

    def is_float_or_unknown(self, tensor: str) -> bool:
        """True unless the model declares ``tensor`` with a type other than float32 (or, in a model that
        may compute in another float type, type inference gives it one)."""
        dtype = self.dtype(tensor) if tensor in self._constants else self._declared(tensor)
        return dtype is None or dtype == onnx.TensorProto.FLOAT
