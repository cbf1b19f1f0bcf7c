"""The precision map: what precision TensorRT runs each compute node in under a strongly typed
build, and which Q/DQ nodes stay standalone layers -- read from the ONNX model, no GPU needed.

A strongly typed network (the only kind TensorRT 11 builds) takes every tensor's type from the
model: a layer runs in the type of its inputs, Q/DQ pairs decide where INT8/FP8/INT4 is used, and
there is no FP16 flag that lets float layers run in half precision [TRT-ST]. So the precision of a
node is known before any build:

* a weighted op (Conv, ConvTranspose, Gemm, MatMul) whose activation input is a DequantizeLinear
  output runs in that DQ's quantized type (``int8`` or ``fp8``); one whose only quantized input is a
  4-bit weight runs ``int4`` (weight-only) [TRT-EQ], [TRT-QS];
* an activation or BatchNormalization reading a weighted op's output alone is fused into it and
  runs in its precision; so is a residual Add of such an output and a DQ output [TRT-EQ]
  ("Q/DQ layer fusion": Conv with BatchNormalization, activations and residual Add);
* a data-movement op (Reshape, Transpose, MaxPool...) fed by a DQ runs on the quantized data (DQ
  forward propagation over commuting layers) [TRT-EQ];
* another op whose float inputs all come from DQ nodes and whose outputs are all read by
  QuantizeLinear nodes is fused with them into a quantized layer (the "quantizable AveragePool"
  of [TRT-EQ]);
* every other node runs in the float type of its inputs: ``fp32``, ``fp16`` or ``bf16``.

Q/DQ nodes that stay standalone layers (reported with their rule):

* ``U1`` a QuantizeLinear of a graph input: there is no producer layer to fuse it into, so it runs
  as its own quantize layer (the engine inspector lists it alone);
* ``U2`` a DequantizeLinear of activation data read by a node that does not run quantized (or by a
  graph output, or by a nested If/Loop/Scan body): the DQ runs as its own dequantize layer in front
  of it [TRT-EQ].

The same rules hold in each If/Loop/Scan body. A tensor a body nested in its graph reads (at any
depth) is stored for that body, as a graph output is: no fusion keeps it inside a kernel.

Sources:

* [TRT-ST] TensorRT 11 Developer Guide, "Precision Control", "Strongly Typed Networks": since 11.0
  TensorRT supports only strongly typed networks, the model specifies every tensor's precision.
* [TRT-EQ] TensorRT Developer Guide, "Explicit Quantization": Q/DQ layer fusion, DQ forward- and
  Q backward-propagation over commuting layers, quantizable layers fused with their input DQ and
  output Q, Conv/BatchNormalization/activation and residual-Add fusions.
* [TRT-QS] TensorRT Developer Guide, "Working with Quantized Types": INT8, FP8 (E4M3), INT4
  (weight-only), FP4.

Nodes a float-parts conversion deliberately keeps in FP32 carry node metadata
`onnx_qat.formats.numeric.KEEP_FP32_KEY` with the reason as value; the map and rule C15 name that reason.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain, filterfalse
from operator import attrgetter, itemgetter
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

from ..formats.numeric import kept_fp32_reason
from .index import WEIGHTED_OPS, _DATA_MOVEMENT, _input, _weight_input

#: Node metadata key (``NodeProto.metadata_props``) marking a node kept in FP32 on purpose; its value
#: is the reason, one line (the convention agreed with the float-parts conversion).

#: Precisions reported, quantized first.
PRECISIONS = ("int8", "fp8", "int4", "fp16", "bf16", "fp32")
QUANTIZED = frozenset({"int8", "fp8", "int4"})
_FLOAT_NAMES = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp32"}  # float64: TensorRT has none; fp32 at best
_FLOATS = frozenset(_FLOAT_NAMES)
_QUANT_NAMES = {3: "int8", 2: "int8", 17: "fp8", 18: "fp8", 19: "fp8", 20: "fp8", 21: "int4", 22: "int4"}
_FOUR_BIT = frozenset({21, 22})
#: Ops that are not compute: conversions, constants, shape reads.
_NOT_COMPUTE = frozenset({"QuantizeLinear", "DequantizeLinear", "Constant", "Cast", "CastLike", "Shape",
                          "Size", "ConstantOfShape"})
#: Ops TensorRT fuses into a preceding Conv/GEMM when they read its output alone ([TRT-EQ]).
_EPILOGUE = frozenset({"BatchNormalization", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid",
                       "Elu", "Selu", "Softplus", "PRelu", "HardSwish"})
#: Output types of ops whose outputs are not of their first input's type.
_INT64_OUT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "NonMaxSuppression"})
_SETS_TYPE = frozenset({"Cast", "DequantizeLinear", "QuantizeLinear", "ConstantOfShape"})
_BOOL_OUT = frozenset({"Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Xor",
                       "IsNaN", "IsInf"})


@dataclass(frozen=True)
class NodePrecision:
    """The precision one compute node runs in, and why."""

    node: str
    op_type: str
    precision: str
    reason: str

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"node": self.node, "op_type": self.op_type, "precision": self.precision,
                "reason": self.reason}


@dataclass(frozen=True)
class UnfusedQDQ:
    """A Q/DQ node TensorRT keeps as a standalone layer, by rule U1 or U2."""

    node: str
    op_type: str
    rule: str
    reason: str

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"node": self.node, "op_type": self.op_type, "rule": self.rule, "reason": self.reason}


@dataclass(frozen=True)
class PrecisionMap:
    """Every compute node's precision under a strongly typed build and the Q/DQ nodes left unfused.

    Attributes:
        nodes: one entry per compute node (every node reading a float tensor, except Q/DQ, Cast,
            Constant and shape reads), in graph order, subgraph nodes named ``parent/attribute/node``.
        unfused: the QuantizeLinear/DequantizeLinear nodes that stay standalone layers.
    """

    nodes: Tuple[NodePrecision, ...] = ()
    unfused: Tuple[UnfusedQDQ, ...] = ()

    def counts(self) -> Dict[str, int]:
        """Number of compute nodes per precision (only precisions present)."""
        out: Dict[str, int] = {}
        for entry in self.nodes:
            out[entry.precision] = out.get(entry.precision, 0) + 1
        return {p: out[p] for p in PRECISIONS if p in out}

    def fp32_compute(self, weighted_only: bool = False) -> Tuple[NodePrecision, ...]:
        """The nodes running in FP32 (only Conv/ConvTranspose/Gemm/MatMul with ``weighted_only``)."""
        return tuple(e for e in self.nodes if e.precision == "fp32"
                     and (not weighted_only or e.op_type in WEIGHTED_OPS))

    def of(self, node: str) -> Optional[str]:
        """The precision of ``node`` (None when it is not a compute node)."""
        return next((e.precision for e in self.nodes if e.node == node), None)

    def summary(self, limit: int = 10) -> str:
        """Counts per precision and unfused Q/DQ on one line; a second names the FP32 Conv/Gemm/MatMul."""
        counts = ", ".join(f"{n} {p.upper()}" for p, n in self.counts().items()) or "no compute nodes"
        rules = {}
        for entry in self.unfused:
            rules[entry.rule] = rules.get(entry.rule, 0) + 1
        unfused = ", ".join(f"{n} by {r}" for r, n in sorted(rules.items())) or "none"
        lines = [f"precision (strongly typed build): {counts} | Q/DQ left unfused: {unfused}"]
        fp32 = self.fp32_compute(weighted_only=True)
        if fp32:
            names = ", ".join(e.node for e in fp32[:limit]) + (f" ... (+{len(fp32) - limit})"
                                                               if len(fp32) > limit else "")
            lines.append(f"FP32 Conv/Gemm/MatMul: {len(fp32)} ({names})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready form (what ``onnx-qat check --precision-map`` writes)."""
        return {"format": "onnx-qat-precision-map", "version": 1, "build": "strongly-typed",
                "counts": self.counts(), "nodes": [e.to_dict() for e in self.nodes],
                "unfused_qdq": [e.to_dict() for e in self.unfused]}

    def save(self, path) -> None:
        """Write [`to_dict`][onnx_qat.check.precision.PrecisionMap.to_dict] as JSON, atomically."""
        from ..io.files import write_json

        write_json(path, self.to_dict())

    def __str__(self) -> str:
        return self.summary()


# -- building the map ----------------------------------------------------------------------------------
def _attr_int(attrs, name: str, default: int) -> int:
    for attr in attrs:
        if attr.name == name:
            return attr.i
    return default


class _Types:
    """Element types of one graph's tensors, propagated forward from the declared graph inputs and
    outputs, the constants and the ops that set a type (Cast, Q/DQ...), without shape inference: one
    type per node (its outputs'), read from the protobuf only for the few ops that set one."""

    def __init__(self, g, parent: Optional["_Types"]):
        self.g, self.parent = g, parent
        self.declared: Dict[str, int] = {}
        for part in (g.graph.input, g.graph.output):
            for vi in part:
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    self.declared[vi.name] = vi.type.tensor_type.elem_type
        self.node_type: List[int] = []
        for i, op in enumerate(g.ops):
            self.node_type.append(self._infer(i, op))

    def type_of(self, tensor: str) -> int:
        """The element type of ``tensor`` (0 when unknown)."""
        found = self.declared.get(tensor)
        if found:
            return found
        g = self.g
        proto = g.constants.get(tensor)
        if proto is not None:
            return proto.data_type
        idx = g.producer.get(tensor)
        if idx is not None:
            return self.node_type[idx] if idx < len(self.node_type) else 0
        return self.parent.type_of(tensor) if self.parent is not None else 0

    def _infer(self, i: int, op: str) -> int:
        g, inputs = self.g, self.g.node_inputs[i]
        if op in _SETS_TYPE:
            record = g.qdq_at.get(i)
            if record is not None:  # Q/DQ: the index holds their attributes
                chosen = _attr_int(record.attrs, "output_dtype", 0) if record.attrs else 0
                if record.is_q:
                    return chosen or (self.type_of(record.zp) if record.zp else 2)
                return chosen or self.type_of(record.scale) or 1
            node = g.graph.node[i]
            if op == "Cast":
                return _attr_int(node.attribute, "to", 0)
            return next((a.t.data_type for a in node.attribute if a.name == "value"), 1)  # ConstantOfShape
        if op in _INT64_OUT:
            return 7
        if op in _BOOL_OUT:
            return 9
        first = 0
        for t in inputs:
            if t:
                dtype = self.type_of(t)
                if dtype in _FLOATS:
                    return dtype
                first = first or dtype
        return first


def _dq_source(g, tensor: str):
    """The DequantizeLinear record producing ``tensor`` directly or through data-movement ops, or None."""
    for _ in range(16):
        idx = g.producer.get(tensor)
        if idx is None:
            return None
        record = g.qdq_at.get(idx)
        if record is not None:
            return None if record.is_q else record
        if g.ops[idx] not in _DATA_MOVEMENT:
            return None
        tensor = _input(g.node_inputs[idx], 0)
    return None


def _quant_name(g, types: _Types, dq) -> Optional[str]:
    """``int8``/``fp8``/``int4`` for a DequantizeLinear record (its data's type), else None."""
    return _QUANT_NAMES.get(types.type_of(dq.data))


class _Builder:
    """Decides each node's precision in one graph (see the module docstring). ``escaping``: the tensors
    of the graph that a body nested in it reads (`_read_by_bodies`), stored for that body as a graph
    output is: a fusion that would keep one inside a kernel does not happen."""

    def __init__(self, g, types: _Types, escaping: FrozenSet[str] = frozenset()):
        self.g, self.types, self.escaping = g, types, escaping
        self.precision: Dict[int, Tuple[str, str]] = {}
        self.counts = Counter(chain.from_iterable(g.node_inputs))  # readers per tensor (C-level count)
        self._readers: Optional[Dict[str, List[int]]] = None

    def readers(self, tensor: str) -> List[int]:
        """Indices of the nodes reading ``tensor`` (all listed once, on first use: few nodes ask)."""
        if self._readers is None:
            self._readers = {}
            for i, inputs in enumerate(self.g.node_inputs):
                for t in inputs:
                    if t:
                        self._readers.setdefault(t, []).append(i)
        return self._readers.get(tensor, [])

    def float_inputs(self, i: int) -> List[str]:
        type_of = self.types.type_of
        return [t for t in self.g.node_inputs[i] if t and type_of(t) in _FLOATS]

    def float_type(self, tensors) -> str:
        for t in tensors:
            dtype = self.types.type_of(t)
            if dtype in _FLOATS:
                return _FLOAT_NAMES[dtype]
        return "fp32"

    def decide(self, i: int) -> Optional[Tuple[str, str]]:
        g, op = self.g, self.g.ops[i]
        if op in _NOT_COMPUTE:
            return None
        floats = self.float_inputs(i)
        if not floats:
            return None
        if op in WEIGHTED_OPS:
            return self._weighted(i, floats)
        fused = self._fused_epilogue(i, floats)
        if fused is not None:
            return fused
        sources = [_dq_source(g, t) for t in floats]
        if all(sources):
            quant = _quant_name(g, self.types, sources[0])
            if quant and op in _DATA_MOVEMENT:
                return quant, "commutes with the DequantizeLinear before it (DQ propagation)"
            if quant and self._read_only_by_q(i):
                return quant, "fused with its input DequantizeLinear and output QuantizeLinear nodes"
        return self.float_type(floats), "float inputs"

    def _weighted(self, i: int, floats) -> Tuple[str, str]:
        g = self.g
        weight = _weight_input(g, i)
        inputs = g.node_inputs[i]
        acts = [k for k in range(min(len(inputs), 2)) if k != weight and inputs[k]]
        act_dq = [_dq_source(g, inputs[k]) for k in acts]
        if act_dq and all(act_dq):
            quant = _quant_name(g, self.types, act_dq[0])
            if quant and quant != "int4":
                return quant, "activation and weight inputs dequantized from " + quant
        if weight is not None:
            wdq = _dq_source(g, inputs[weight])
            if wdq is not None and self.types.type_of(wdq.data) in _FOUR_BIT:
                return "int4", "4-bit weight, float activation (weight-only)"
        act_tensors = [inputs[k] for k in acts] or floats
        return self.float_type(act_tensors), "float activation input"

    def _fused_epilogue(self, i: int, floats) -> Optional[Tuple[str, str]]:
        """An activation/BatchNormalization or a bias Add reading a quantized weighted op's output alone,
        or a residual Add of such an output and a DQ output: fused into the weighted op."""
        g, op = self.g, self.g.ops[i]
        data = [t for t in floats if not g.is_constant(t)]
        if not data:
            return None
        if op in _EPILOGUE or op == "Add" and len(data) == 1 and len(g.node_inputs[i]) == 2:
            owner = self._owner(data[0], alone=True)
        elif op in ("Add", "Sum") and len(data) == 2 and any(_dq_source(g, t) for t in data):
            owner = next((o for o in (self._owner(t, alone=True) for t in data) if o is not None), None)
        else:
            return None
        return None if owner is None else (owner[0], f"fused into {owner[1]}")

    def _owner(self, tensor: str, alone: bool) -> Optional[Tuple[str, str]]:
        """``(precision, weighted op name)`` when ``tensor`` comes from a quantized weighted op or a node
        already fused into one, and (with ``alone``) nobody else reads it."""
        g = self.g
        src = g.producer.get(tensor)
        if src is None or src not in self.precision or alone and self.counts[tensor] > 1:
            return None
        precision, reason = self.precision[src]
        if precision not in QUANTIZED or tensor in g.outputs or tensor in self.escaping:
            return None
        if g.ops[src] in WEIGHTED_OPS:
            return precision, repr(g.name(src))
        if reason.startswith("fused into "):
            return precision, reason[len("fused into "):]
        return None

    def _read_only_by_q(self, i: int) -> bool:
        g = self.g
        outputs = [o for o in g.graph.node[i].output if o]
        if not outputs or any(o in g.outputs or o in self.escaping for o in outputs):
            return False
        for out in outputs:
            for r in self.readers(out):
                record = g.qdq_at.get(r)
                if record is None or not record.is_q:
                    return False
            if not self.readers(out):
                return False
        return True


def _unfused(g, builder: _Builder, is_main: bool) -> Iterator[UnfusedQDQ]:
    graph_inputs = {vi.name for vi in g.graph.input} - set(g.constants) if is_main else set()
    for record in g.qdq:
        name = g.name(record.pos)
        if record.is_q:
            if record.data in graph_inputs:
                yield UnfusedQDQ(name, "QuantizeLinear", "U1",
                                 f"quantizes graph input {record.data!r}: no layer before it to fuse into")
            continue
        if g.is_constant(record.data):
            continue  # a weight DQ: folded into the weighted op
        reader = _float_reader(g, builder, record.out)
        if reader:
            yield UnfusedQDQ(name, "DequantizeLinear", "U2", reader)


def _float_reader(g, builder: _Builder, tensor: str, depth: int = 0) -> str:
    """Why the DQ output ``tensor`` must be dequantized for someone (``""`` when every reader runs
    quantized), following data-movement ops."""
    if tensor in g.outputs:
        return f"output {tensor!r} is a graph output (dequantized for it)"
    if tensor in builder.escaping:
        return f"output {tensor!r} is read by a nested If/Loop/Scan body (dequantized for it)"
    for r in (g.readers(tensor) if depth == 0 else builder.readers(tensor)):
        decided = builder.precision.get(r)
        if g.ops[r] in _DATA_MOVEMENT and depth < 16:
            why = _float_reader(g, builder, _first_output(g, r), depth + 1)
            if why:
                return why
            continue
        if g.ops[r] in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if decided is None or decided[0] not in QUANTIZED:
            return f"read by {g.ops[r]} {g.name(r)!r}, which runs in {decided[0] if decided else 'float'}"
    return ""


def _first_output(g, i: int) -> str:
    outputs = g.graph.node[i].output
    return outputs[0] if outputs else ""


def build_precision_map(model, graphs) -> PrecisionMap:
    """The [`PrecisionMap`][onnx_qat.check.precision.PrecisionMap] of ``model`` from the check's per-graph
    index ``graphs``."""
    nodes: List[NodePrecision] = []
    unfused: List[UnfusedQDQ] = []
    for number, g, builder in _decided(graphs):
        nodes.extend(NodePrecision(g.name(i), g.ops[i], precision, reason)
                     for i, (precision, reason) in builder.precision.items())
        unfused.extend(_unfused(g, builder, number == 0))
    return PrecisionMap(tuple(nodes), tuple(unfused))


def _decided(graphs) -> Iterator[Tuple[int, object, _Builder]]:
    """``(number, graph, builder)`` for each graph of ``graphs`` (`_all_graphs`' list), its builder
    holding every node's decided precision in node order: the one pass `build_precision_map` and
    `fused_tensors` share. A body's types continue its enclosing graph's; a tensor a nested body reads
    (at any depth) is stored for it, as a graph output is (`_read_by_bodies`)."""
    parents = _parents(graphs)
    escaping = _read_by_bodies(graphs, parents)
    types: List[_Types] = []
    for number, g in enumerate(graphs):
        parent = parents[number]
        types.append(_Types(g, types[parent] if parent is not None else None))
        builder = _Builder(g, types[number], frozenset(escaping[number]))
        for i in range(len(g.ops)):
            decided = builder.decide(i)
            if decided is None:
                continue
            precision, reason = decided
            kept = _kept_reason(g.graph.node[i]) if precision == "fp32" else None
            if kept:
                reason = f"kept FP32 by the conversion: {kept}"
            builder.precision[i] = (precision, reason)
        yield number, g, builder


#: Precisions whose kernels take quantized inputs and accumulate in INT32/FP32, requantizing their
#: output in the epilogue when a QuantizeLinear follows (INT4 is weight-only: float activations).
_QUANT_KERNELS = frozenset({"int8", "fp8"})


def fused_tensors(model) -> FrozenSet[str]:
    """The float tensors of ``model`` TensorRT computes inside a fused INT8/FP8 kernel and never stores
    in a float type, in the main graph and in every If/Loop/Scan body: a main-graph tensor by its name,
    a body's as ``parent/attribute/tensor`` (the prefix `onnx-qat check` names the body's nodes with;
    sibling bodies, such as an If's two branches, may use the same tensor names).

    A tensor is one when its producer runs quantized (an INT8/FP8 Conv/Gemm/MatMul, an op fused into
    one, a quantizable op fused with its DQ and Q nodes, a data-movement op on quantized data, or a
    DequantizeLinear that is not left standalone by rule U2) and every reader of it is a
    QuantizeLinear or runs quantized too, and it leaves its graph by no path: it is no output of its
    graph (of its body, for a body's tensor) and no body nested in its graph reads it (a body's reads
    from enclosing graphs are stored for it, as graph inputs are). Such a kernel reads the INT8/FP8
    data, accumulates in INT32/FP32 and, when a QuantizeLinear follows, writes INT8/FP8 directly: the
    DQ outputs, the accumulator, the fused BatchNormalization/activation/residual Add results between
    them never exist as FP16/BF16 tensors ([TRT-EQ], "Q/DQ Layer-Placement Recommendations": when the
    output of a fused convolution is quantized, the trailing Q layer is fused with it and its output
    is INT8; a quantizable op is fused with its input DQ and output Q nodes). The same rules hold in
    each body, whose tensors read from enclosing graphs count as its graph inputs.
    """
    from ..io.models import cyclic_gc_paused, default_opset
    from .index import _all_graphs

    found = set()
    with cyclic_gc_paused():
        for number, g, builder in _decided(_all_graphs(model, default_opset(model), None)):
            found.update(g.prefix + t for t in _fused_in(g, builder, number == 0))
    return frozenset(found)


def _parents(graphs) -> List[Optional[int]]:
    """The place in ``graphs`` (`_all_graphs`' list: depth first, each body after its enclosing graph)
    of each graph's enclosing graph (None for the main graph): the nearest one before it whose prefix
    starts its own."""
    parents: List[Optional[int]] = []
    open_graphs: List[int] = []  # the graphs enclosing the one at hand, innermost last
    for number, g in enumerate(graphs):
        while open_graphs and not (g.prefix.startswith(graphs[open_graphs[-1]].prefix)
                                   and graphs[open_graphs[-1]].prefix != g.prefix):
            open_graphs.pop()
        parents.append(open_graphs[-1] if open_graphs else None)
        open_graphs.append(number)
    return parents


def _read_by_bodies(graphs, parents) -> List[set]:
    """For each graph of ``graphs``, the names the bodies nested in it (at any depth) read or return
    from outside themselves: the tensors of enclosing graphs a body uses."""
    reads: List[set] = [set() for _ in graphs]
    for number in range(len(graphs) - 1, 0, -1):  # each body before the graph enclosing it
        g = graphs[number]
        used = set(chain.from_iterable(g.node_inputs)) | g.outputs | reads[number]
        own = set(g.producer) | {vi.name for vi in g.graph.input} | {t.name for t in g.graph.initializer}
        reads[parents[number]] |= used - own
    return reads


def _fused_in(g, builder: _Builder, is_main: bool) -> Iterator[str]:
    """The tensors of one graph `fused_tensors` lists (unprefixed), from its decided ``builder``."""
    escaping = builder.escaping
    standalone = {u.node for u in _unfused(g, builder, is_main)}
    quantized = set()
    for i in range(len(g.ops)):
        record = g.qdq_at.get(i)
        if record is not None and not record.is_q:
            data_type = _quant_name(g, builder.types, record)
            if data_type in _QUANT_KERNELS and g.name(i) not in standalone:
                quantized.add(i)
        elif builder.precision.get(i, ("",))[0] in _QUANT_KERNELS:
            quantized.add(i)
    for i in quantized:
        for out in g.graph.node[i].output:
            readers = builder.readers(out)
            if not out or out in g.outputs or out in escaping or not readers:
                continue
            if all(r in quantized or getattr(g.qdq_at.get(r), "is_q", False) for r in readers):
                yield out


def _kept_reason(node) -> Optional[str]:
    reason = kept_fp32_reason(node)
    return None if reason is None else reason or "no reason given"


def computes_in_reduced_float(graphs) -> bool:
    """Whether the model holds FP16/BF16 data at all (a constant, a declared input or output, a Cast
    to it), read without building the map: a model without any cannot compute in FP16/BF16."""
    reduced = (10, 16)
    for g in graphs:
        constants, stored = g.constants, g._stored  # a type stored already (`_Graph.data_type`), in short
        types = set(map(itemgetter(0), filter(None, stored.values())))
        types.update(map(attrgetter("data_type"), map(constants.__getitem__,
                                                      filterfalse(stored.__contains__, constants))))
        if not types.isdisjoint(reduced):
            return True
        for part in (g.graph.input, g.graph.output):
            if any(vi.type.tensor_type.elem_type in reduced for vi in part
                   if vi.type.HasField("tensor_type")):
                return True
        for i in g.indices_of(("Cast",)):
            if _attr_int(g.graph.node[i].attribute, "to", 0) in reduced:
                return True
    return False


def lazy_precision_map(model, opset):
    """A function that builds the [`PrecisionMap`][onnx_qat.check.precision.PrecisionMap] of ``model`` when
    first called (it indexes the model again): [`onnx_qat.check`][onnx_qat.check.check] leaves the map to
        whoever asks for it, since it costs
    about half a check on large models."""
    def build() -> PrecisionMap:
        from ..io.models import cyclic_gc_paused
        from .index import _all_graphs

        with cyclic_gc_paused():
            return build_precision_map(model, _all_graphs(model, opset, None))
    return build


def precision_map_of(model, graphs) -> PrecisionMap:
    """`build_precision_map`, built once per check (kept with the main graph's index)."""
    memo = graphs[0]._memo.setdefault("precision_map", {}) if graphs else {}
    if "map" not in memo:
        memo["map"] = build_precision_map(model, graphs) if graphs else PrecisionMap()
    return memo["map"]


__all__ = ["PrecisionMap", "NodePrecision", "UnfusedQDQ", "PRECISIONS",
           "build_precision_map", "precision_map_of", "lazy_precision_map", "computes_in_reduced_float",
           "fused_tensors"]
