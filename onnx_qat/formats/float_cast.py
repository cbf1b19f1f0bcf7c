"""The typed rewrite behind [`onnx_qat.formats.float_parts.cast_float_parts`][]: FP32 -> FP16/BF16.

Given the set of nodes that must stay FP32, every other node of the main graph computes in the
low float type wherever its ONNX schema lets it: an input or output slot takes the low type when
it holds an FP32 tensor and the slot's type constraint admits the low type (``Resize``'s
``scales``, for one, is ``tensor(float)`` in every opset and stays FP32). One ``Cast`` per tensor
and type joins a tensor to a consumer that wants the other type; an FP32 initializer read only
by low slots is stored in the low type (the file shrinks), one read by both keeps FP32 and gives
its low readers a small low copy (a Q/DQ scale: TensorRT wants constant scales) or a ``Cast``.
Tensors whose name must keep FP32 (graph outputs with ``keep_io_types``, names read inside
If/Loop/Scan bodies) are produced under a new name and cast back to FP32 under their own; a body's
low slots read that low tensor itself (``outer_low``), and the caller drops a copy nothing reads.
`cast_graph` rewrites one graph; an If/Loop/Scan body is rewritten as the graph of a model of its
own (``onnx_qat.formats.float_parts``), its inputs and outputs kept, with the names of the enclosing
graphs ``reserved``.

Source of the type rules: the ONNX operator schemas (``onnx.defs``) of the model's opset.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..graph.index import subgraphs_of, weightless_copy
from .scale_grid import fp16_round_up

logger = logging.getLogger(__name__)

FLOAT = TensorProto.FLOAT
#: Initializers read by both FP32 and low slots up to this many values get a low copy (scales,
#: biases); larger ones a Cast.
SMALL_COPY = 4096
#: Ops whose ``dtype`` attribute (not an input) decides the output type.
DTYPE_ATTR_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                            "EyeLike", "Bernoulli"})


@dataclass(frozen=True)
class LowType:
    """A float type float parts can take.

    Attributes:
        name: ``fp16`` or ``bf16``.
        onnx_type: its ONNX element type.
        type_str: its name in ONNX type constraints (``tensor(float16)``).
        max: the largest finite value.
        normal_min: the smallest normal value.
        eps: the spacing of values just above 1 (relative precision).
        tiny: the smallest positive value (subnormal).
    """

    name: str
    onnx_type: int
    type_str: str
    max: float
    normal_min: float
    eps: float
    tiny: float

    def round(self, values: np.ndarray) -> np.ndarray:
        """``values`` (float32) rounded to this type, as float32 (round to nearest even)."""
        values = np.asarray(values, dtype=np.float32)
        if self.onnx_type == TensorProto.FLOAT16:
            with np.errstate(over="ignore"):
                return values.astype(np.float16).astype(np.float32)
        return _bf16_bits_to_float(_float_to_bf16_bits(values))

    def round_up(self, values: np.ndarray) -> np.ndarray:
        """``values`` (float32, none negative) rounded to this type toward +inf, as float32: for each,
        the smallest value of the type not below it (a Q/DQ scale stored so that the range it
        quantizes never shrinks). FP16: `onnx_qat.formats.scale_grid.fp16_round_up`, the one FP16
        round-up, which the scale grid puts calibrated ranges on."""
        values = np.asarray(values, dtype=np.float32)
        if self.onnx_type == TensorProto.FLOAT16:
            return fp16_round_up(values)
        nearest = self.round(values)
        below = nearest < values
        if not np.any(below):
            return nearest
        above = _bf16_bits_to_float(_float_to_bf16_bits(nearest) + np.uint16(1))
        return np.where(below, above, nearest)

    def tensor(self, name: str, values: np.ndarray) -> TensorProto:
        """An initializer ``name`` holding ``values`` in this type (raw little-endian bytes)."""
        values = np.asarray(values, dtype=np.float32)
        if self.onnx_type == TensorProto.FLOAT16:
            with np.errstate(over="ignore"):
                raw = values.astype("<f2").tobytes()
        else:
            raw = _float_to_bf16_bits(values).astype("<u2").tobytes()
        return helper.make_tensor(name, self.onnx_type, values.shape, raw, raw=True)


def _float_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(values)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, np.uint16(0x7FC0), rounded)


def _bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


FP16 = LowType("fp16", TensorProto.FLOAT16, "tensor(float16)", 65504.0, 2.0 ** -14, 2.0 ** -10, 2.0 ** -24)
BF16 = LowType("bf16", TensorProto.BFLOAT16, "tensor(bfloat16)", float(_bf16_bits_to_float(
    np.array([0x7F7F], np.uint16))[0]), 2.0 ** -126, 2.0 ** -7, 2.0 ** -133)


# --------------------------------------------------------------------------- schema slots
_SCHEMAS: Dict[Tuple[str, str, int], object] = {}


def schema_of(node: onnx.NodeProto, opset: int):
    """The ONNX schema of ``node`` at ``opset`` (None for other domains or unknown ops)."""
    key = (node.domain or "", node.op_type, opset)
    if key not in _SCHEMAS:
        try:
            _SCHEMAS[key] = None if key[0] not in ("", "ai.onnx") else \
                onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            _SCHEMAS[key] = None
    return _SCHEMAS[key]


def _formal(params, index: int):
    if index < len(params):
        return params[index]
    if params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return params[-1]
    return None


def slot_admits(schema, outputs: bool, index: int, type_str: str) -> bool:
    """Whether input (or output) slot ``index`` of an op with ``schema`` may hold ``type_str``."""
    formal = _formal(schema.outputs if outputs else schema.inputs, index)
    if formal is None:
        return False
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    return type_str in allowed.get(formal.type_str, (formal.type_str,))


def tensor_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element type of every tensor of the main graph and of its If/Loop/Scan bodies onnx's shape
    inference can tell (0 is unknown)."""
    light = weightless_copy(model)  # float weights as types and shapes only: no data copied
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False).graph
    except Exception:  # noqa: BLE001 - a model shape inference cannot read: what the file says
        inferred = light.graph
    types: Dict[str, int] = {}
    for graph in all_graphs(inferred):  # If/Loop/Scan bodies too: their tensors' names are their own
        for info in list(graph.value_info) + list(graph.input) + list(graph.output):
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
                types.setdefault(info.name, info.type.tensor_type.elem_type)
    for graph in all_graphs(model):
        for tensor in graph.initializer:
            types[tensor.name] = tensor.data_type
    _propagate(model, types)
    return types


def all_graphs(model) -> List[onnx.GraphProto]:
    """The main graph of ``model`` (a ModelProto or a GraphProto) and every If/Loop/Scan body in it
    (nested ones too), outer first."""
    return [graph for _, graph in prefixed_graphs(model)]


def prefixed_graphs(model) -> List[Tuple[str, onnx.GraphProto]]:
    """`all_graphs` with each graph's prefix: ``(prefix, graph)``, ``""`` for the main graph and
    `body_prefix`'s ``parent/attribute/`` for a body (as ``onnx-qat check`` names its nodes)."""
    found, queue = [], [("", model.graph if isinstance(model, onnx.ModelProto) else model)]
    while queue:
        prefix, graph = queue.pop(0)
        found.append((prefix, graph))
        for i, node in enumerate(graph.node):
            queue.extend((body_prefix(prefix, node, i, attr), body) for attr, _, body in subgraphs_of(node))
    return found


def body_prefix(prefix: str, node: onnx.NodeProto, index: int, attr: str) -> str:
    """The prefix of the names of the nodes inside body ``attr`` of ``node`` (``index``: its place in
    its graph; ``prefix``: that graph's), as ``onnx-qat check`` names them: ``parent/attribute/``."""
    return f"{prefix}{node.name or f'<{node.op_type} #{index}>'}/{attr}/"


def _propagate(model: onnx.ModelProto, types: Dict[str, int]) -> None:
    """Element types shape inference left unknown, from the schemas: an output whose type variable an
    input with a known type shares takes that type (Cast: its ``to``; Constant: its value)."""
    from ..io.models import default_opset

    opset = default_opset(model)
    for node in (n for g in all_graphs(model) for n in g.node):
        missing = [i for i, t in enumerate(node.output) if t and not types.get(t)]
        if not missing:
            continue
        if node.op_type == "Cast":
            types[node.output[0]] = next(a.i for a in node.attribute if a.name == "to")
            continue
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
            continue
        schema = schema_of(node, opset)
        if schema is None:
            continue
        bound = {}
        for i, t in enumerate(node.input):
            formal = _formal(schema.inputs, i)
            if t and formal is not None and types.get(t):
                bound.setdefault(formal.type_str, types[t])
        for i in missing:
            formal = _formal(schema.outputs, i)
            if formal is not None and formal.type_str in bound:
                types[node.output[i]] = bound[formal.type_str]


def unknown_float_slots(node, types: Mapping[str, int]) -> bool:
    """Whether ``node`` has an input or output whose element type is unknown."""
    return any(t and not types.get(t) for t in list(node.input) + list(node.output))


# --------------------------------------------------------------------------- the rewrite
@dataclass(frozen=True)
class CastStats:
    """What `cast_graph` changed: node outputs and initializers made low, Casts added."""

    low_nodes: int
    low_outputs: int
    low_initializers: int
    low_copies: int
    casts: int
    fp32_slots: Tuple[Tuple[str, str, str], ...]  # (node, slot, why) FP32 by the ONNX schema
    low_names: Tuple[str, ...] = ()  # the nodes computing in the low type
    low_tensors: frozenset = frozenset()  # the node outputs of the low type
    #: (pinned tensor, its low version) that bodies of this graph may read instead of casting it again:
    #: a tensor produced low (its FP32 copy under its own name is a Cast back) or an initializer's low copy
    low_aliases: Tuple[Tuple[str, str], ...] = ()
    cast_backs: Tuple[str, ...] = ()  # pinned tensors produced low, given an FP32 copy by a Cast back
    #: (FP32 initializer read in bodies, its low copy, whether ``low_copies`` counts it: read here too)
    alias_copies: Tuple[Tuple[str, str, bool], ...] = ()


class _Names:
    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.used: Set[str] = {i.name for i in g.input} | {o.name for o in g.output}
        self.used |= {t.name for t in g.initializer} | {n.name for n in g.node}
        for n in g.node:
            self.used.update(n.input)
            self.used.update(n.output)

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name


def cast_graph(model: onnx.ModelProto, low: LowType, keep: Iterable[str], types: Mapping[str, int], *,
               keep_io_types: bool = True, pinned: Iterable[str] = (), reserved: Iterable[str] = (),
               outer_low: Optional[Mapping[str, str]] = None) -> CastStats:
    """Rewrite ``model`` (owned by the caller, edited in place) so that every main-graph node not in
    ``keep`` and holding no If/Loop/Scan body computes in ``low`` where its schema allows (a node with
    bodies keeps the types of its inputs and outputs: its bodies are converted on their own);
    ``types`` from `tensor_types`; ``pinned``: tensor names that must stay FP32 under their own name
    (read inside subgraphs); ``reserved``: names new tensors and nodes must not take (those of enclosing
    and sibling graphs, when ``model`` holds an If/Loop/Scan body as its graph); ``outer_low``: for
    tensors of enclosing graphs, the name of their low version there (`CastStats.low_aliases`), which a
    low slot reads instead of a Cast of its own.

    A pinned tensor produced low keeps its low version under a new name beside its FP32 copy, and a
    pinned FP32 initializer that no FP32 slot of this graph reads gets a low copy (Q/DQ scales and zero
    points excepted: their stored values are the Q/DQ's own): both are given as ``low_aliases``, so that
    a tensor read in low slots of many bodies is rounded once, where it is made. An FP32 copy or an
    initializer nothing reads once the bodies are converted is dropped by the caller
    (``cast_backs``, ``alias_copies``)."""
    from ..io.models import default_opset, tensor_array

    g = model.graph
    opset = default_opset(model)
    keep = set(keep)
    names = _Names(model)
    names.used.update(reserved)
    initializers = {t.name: t for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    outputs = {o.name for o in g.output}
    pinned = set(pinned) | (outputs if keep_io_types else set())
    tensor_type: Dict[str, int] = {}  # the type each tensor has after the rewrite
    wants: Dict[Tuple[int, int], int] = {}  # (node index, input index) -> type the slot reads
    fp32_slots: List[Tuple[str, str, str]] = []
    low_outputs = 0
    low_nodes: Set[int] = set()
    outer_low = outer_low or {}
    qdq_params = _qdq_params(g) if any(has_subgraph(n) for n in g.node) else set()
    for k, node in enumerate(g.node):
        convert = node.name not in keep and not has_subgraph(node) and _rewrite_attributes(node, low)
        schema = schema_of(node, opset) if convert else None
        for i, t in enumerate(node.input):
            if t and types.get(t) == FLOAT:
                ok = convert and schema is not None and slot_admits(schema, False, i, low.type_str)
                wants[(k, i)] = low.onnx_type if ok else FLOAT
                if ok:
                    low_nodes.add(k)
                if convert and not ok and schema is not None:
                    fp32_slots.append((node.name, f"input {i}", f"{node.op_type}-{opset} takes no "
                                       f"{low.type_str} there"))
        for i, t in enumerate(node.output):
            if not t or types.get(t) != FLOAT:
                continue
            ok = convert and (node.op_type in ("Cast", "Constant", "ConstantOfShape") or
                              (schema is not None and slot_admits(schema, True, i, low.type_str)))
            tensor_type[t] = low.onnx_type if ok else FLOAT
            low_outputs += ok
            if ok:
                low_nodes.add(k)
    low_names = tuple(g.node[k].name for k in sorted(low_nodes))
    for name in graph_inputs:
        if types.get(name) == FLOAT and name not in initializers:
            tensor_type[name] = FLOAT if keep_io_types else low.onnx_type
    # initializers: stored low when every reader wants low
    readers: Dict[str, Set[int]] = {}
    for (k, i), want in wants.items():
        readers.setdefault(g.node[k].input[i], set()).add(want)
    low_inits = copies = 0
    copy_of: Dict[str, str] = {}
    alias_copies: List[Tuple[str, str, bool]] = []
    for name, tensor in initializers.items():
        if tensor.data_type != FLOAT or name in graph_inputs:
            continue
        want = readers.get(name, set())
        if want == {low.onnx_type} and name not in pinned:
            values = tensor_array(tensor)
            tensor.CopyFrom(low.tensor(name, values))
            tensor_type[name] = low.onnx_type
            low_inits += 1
        else:
            tensor_type[name] = FLOAT
            small = int(np.prod(tensor.dims, dtype=np.int64)) <= SMALL_COPY
            # read in bodies, by no FP32 slot here: a low copy for the bodies' low slots (kept only if read)
            for_bodies = name in pinned and FLOAT not in want and name not in qdq_params
            if (low.onnx_type in want and small) or for_bodies:
                values = tensor_array(tensor)
                if for_bodies and not small and values.size and float(np.max(np.abs(values))) > low.max:
                    continue
                copy_of[name] = names.fresh(f"{name}/{low.name}")
                g.initializer.append(low.tensor(copy_of[name], values))
                copies += low.onnx_type in want
                if name in pinned:  # the caller drops it, or the FP32 original, when nothing reads it
                    alias_copies.append((name, copy_of[name], low.onnx_type in want))
    # pinned tensors produced low: produced under a new name, cast back to FP32 under their own
    renamed: Dict[str, str] = {}
    for node in g.node:
        for i, t in enumerate(node.output):
            if t in pinned and tensor_type.get(t) == low.onnx_type:
                renamed[t] = names.fresh(f"{t}/{low.name}")
                node.output[i] = renamed[t]
    casts: Dict[Tuple[str, int], str] = {}
    new_nodes: List[onnx.NodeProto] = []
    cast_count = 0

    def cast_of(tensor: str, to: int, before: List[onnx.NodeProto]) -> str:
        nonlocal cast_count
        source = renamed.get(tensor, tensor)
        key = (source, to)
        if key not in casts:
            suffix = low.name if to == low.onnx_type else "fp32"
            out = names.fresh(f"{tensor}/to_{suffix}")
            before.append(helper.make_node("Cast", [source], [out], to=to,
                                           name=names.fresh(f"{tensor}/Cast_{suffix}")))
            casts[key] = out
            cast_count += 1
        return casts[key]

    for k, node in enumerate(g.node):
        before: List[onnx.NodeProto] = []
        for i, t in enumerate(node.input):
            want = wants.get((k, i))
            if want is None:
                continue
            have = tensor_type.get(t, FLOAT)
            if want == have:
                if t in renamed:
                    node.input[i] = renamed[t]
            elif want == FLOAT and t in renamed:
                pass  # the FP32 copy under the tensor's own name
            elif want == low.onnx_type and t in copy_of:
                node.input[i] = copy_of[t]
            elif want == low.onnx_type and t not in tensor_type and t in outer_low:
                node.input[i] = outer_low[t]  # an enclosing graph's tensor, rounded once where it is made
            else:
                node.input[i] = cast_of(t, want, before)
        new_nodes.extend(before)
        new_nodes.append(node)
        for t in node.output:  # a pinned tensor produced low: its FP32 copy under its own name
            if t in renamed.values():
                original = next(o for o, r in renamed.items() if r == t)
                new_nodes.append(helper.make_node("Cast", [t], [original], to=FLOAT,
                                                  name=names.fresh(f"{original}/Cast_fp32")))
                cast_count += 1
    del g.node[:]
    g.node.extend(new_nodes)
    low_set = {t for t, ty in tensor_type.items() if ty == low.onnx_type and t not in renamed}
    low_set.update(renamed.values())
    low_set.update(out for (_, to), out in casts.items() if to == low.onnx_type)
    for t in renamed:
        tensor_type[t] = FLOAT
    _retype_infos(g, tensor_type, low, keep_io_types)
    aliases = {t: r for t, r in renamed.items() if t in pinned and t not in qdq_params}
    aliases.update((t, c) for t, c in copy_of.items() if t in pinned and t not in qdq_params)
    return CastStats(len(low_nodes), low_outputs, low_inits, copies, cast_count, tuple(fp32_slots),
                     low_names, frozenset(low_set), tuple(aliases.items()), tuple(renamed),
                     tuple(alias_copies))


def _qdq_params(graph: onnx.GraphProto) -> Set[str]:
    """The scales and zero points the QuantizeLinear/DequantizeLinear nodes of ``graph`` and of its
    bodies read."""
    return {t for g in all_graphs(graph) for n in g.node
            if n.op_type in ("QuantizeLinear", "DequantizeLinear") for t in n.input[1:]}


def _rewrite_attributes(node: onnx.NodeProto, low: LowType) -> bool:
    """Give ``node``'s type-carrying attributes the low type (Cast ``to``, Constant and
    ConstantOfShape ``value``, ``dtype``); False when an attribute cannot hold the value (it then
    stays FP32)."""
    from onnx import numpy_helper

    for attr in node.attribute:
        if node.op_type == "Cast" and attr.name == "to" and attr.i == FLOAT:
            attr.i = low.onnx_type
        elif node.op_type in DTYPE_ATTR_OPS and attr.name == "dtype" and attr.i == FLOAT:
            attr.i = low.onnx_type
        elif node.op_type in ("Constant", "ConstantOfShape") and attr.name == "value" \
                and attr.t.data_type == FLOAT:
            values = numpy_helper.to_array(attr.t)
            if values.size and float(np.max(np.abs(values))) > low.max:
                return False
            attr.t.CopyFrom(low.tensor(attr.t.name, values))
        elif node.op_type == "Constant" and attr.name in ("value_float", "value_floats"):
            value = np.array(attr.f if attr.name == "value_float" else list(attr.floats), np.float32)
            if value.size and float(np.max(np.abs(value))) > low.max:
                return False
            node.ClearField("attribute")
            node.attribute.append(helper.make_attribute("value", low.tensor("", value)))
            return True
    return True


def _retype_infos(graph: onnx.GraphProto, tensor_type: Mapping[str, int], low: LowType,
                  keep_io_types: bool) -> None:
    for info in graph.value_info:
        if info.name in tensor_type and info.type.HasField("tensor_type"):
            info.type.tensor_type.elem_type = tensor_type[info.name]
    if not keep_io_types:  # an output an FP32-kept node produces stays FP32
        for info in list(graph.input) + list(graph.output):
            if info.type.tensor_type.elem_type == FLOAT:
                info.type.tensor_type.elem_type = tensor_type.get(info.name, low.onnx_type)


def read_in_subgraphs(graph: onnx.GraphProto) -> Set[str]:
    """Outer names read inside If/Loop/Scan bodies of ``graph``'s nodes."""
    holders = [n for n in graph.node if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                            for a in n.attribute)]
    if not holders:
        return set()
    from ..graph.edit import subgraph_names

    return set(subgraph_names(holders))


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


__all__ = ["LowType", "FP16", "BF16", "cast_graph", "tensor_types", "schema_of", "slot_admits",
           "CastStats", "read_in_subgraphs", "has_subgraph", "all_graphs", "prefixed_graphs",
           "body_prefix"]

