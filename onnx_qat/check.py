"""check(model) -> CheckReport: TensorRT-readiness linter for Q/DQ models from any tool.

The rules read a model exported by any tool (this project, onnxruntime's
``quantize_static``, PyTorch quantization toolkits...) and report what TensorRT's
explicit-quantization INT8 path will refuse (``error``) or run slower than it
could (``warning``). Each rule is one small function ``rule_cN_...`` with its
source in the docstring; :data:`RULES` is the table that :func:`check` runs.

Sources cited by the rules:

* [TRT-EQ] TensorRT Developer Guide, "Explicit Quantization" (Q/DQ layers,
  symmetric signed INT8, constant scales, per-tensor activations and per-channel
  weights).
* [TRT-PL] TensorRT Developer Guide, "Q/DQ Layer-Placement Recommendations"
  (quantize the inputs of weighted ops, residual Add fusion, commuting ops).
* [ONNX-TRT] onnx-tensorrt ``docs/operators.md`` (QuantizeLinear/DequantizeLinear
  need opset >= 13 for per-axis scales, zero point 0; QLinear* and *Integer ops are
  not supported).

The checker only reads the model: a ``ModelProto`` given by the caller is never
modified (shape inference runs on a copy).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from itertools import compress
from sys import intern
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

from .errors import ModelError

_UINT8 = 2  # onnx.TensorProto.UINT8: what a QuantizeLinear without a zero point writes

logger = logging.getLogger(__name__)

ERROR = "error"
WARNING = "warning"
MODEL_NODE = "(model)"

#: Ops that TensorRT's ONNX parser does not import, or that mean a non-Q/DQ integer format.
FORBIDDEN_OPS = frozenset({
    "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear", "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul", "DynamicQuantizeLSTM", "QGemm", "QAttention",
})
WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
#: Ops that move data without changing values; Q/DQ commutes with them ([TRT-PL]).
_DATA_MOVEMENT = frozenset({
    "Pad", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Slice", "MaxPool",
})
_CONST_PASS = frozenset({"Identity", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Cast", "Flatten"})


# -- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One problem found by one rule.

    Attributes:
        rule: rule id, ``"C1"`` ... (see :data:`RULES` and docs/check-rules.md).
        severity: ``"error"`` (TensorRT refuses it or computes something else) or
            ``"warning"`` (it builds, but slower or less accurately than it could).
        node: name of the offending node (``"(model)"`` for model-level findings).
        message: one sentence saying what is wrong and what to do.
    """

    rule: str
    severity: str
    node: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity.upper():7} {self.rule:<4} {self.node}: {self.message}"

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"rule": self.rule, "severity": self.severity, "node": self.node, "message": self.message}


@dataclass(frozen=True)
class CheckReport:
    """What :func:`check` found. ``bool(report)`` is True when there is no error.

    Attributes:
        findings: every finding, ordered by rule id then node order in the graph.
        num_q: number of QuantizeLinear nodes (all graphs, subgraphs included).
        num_dq: number of DequantizeLinear nodes.
        model: the model's path when given one, else ``""``.
        opset: the default-domain opset version (None when the model imports none).
    """

    findings: Tuple[Finding, ...] = ()
    num_q: int = 0
    num_dq: int = 0
    model: str = ""
    opset: Optional[int] = None

    @property
    def errors(self) -> Tuple[Finding, ...]:
        """Findings of severity ``"error"``."""
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def warnings(self) -> Tuple[Finding, ...]:
        """Findings of severity ``"warning"``."""
        return tuple(f for f in self.findings if f.severity == WARNING)

    @property
    def passed(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors

    def __bool__(self) -> bool:
        return self.passed

    def rules(self) -> Tuple[str, ...]:
        """The ids of the rules that found something (sorted, unique)."""
        return tuple(sorted({f.rule for f in self.findings}, key=_rule_key))

    def summary(self) -> str:
        """One line: verdict, counts of errors/warnings, counts of Q and DQ nodes."""
        verdict = "PASSED" if self.passed else "FAILED"
        where = f" | {self.model}" if self.model else ""
        n_err, n_warn = len(self.errors), len(self.warnings)
        return (f"{verdict}{where} | {n_err} error{'s' if n_err != 1 else ''}, "
                f"{n_warn} warning{'s' if n_warn != 1 else ''} | "
                f"{self.num_q} QuantizeLinear, {self.num_dq} DequantizeLinear")

    def __str__(self) -> str:
        return "\n".join([str(f) for f in self.findings] + [self.summary()])

    def to_dict(self) -> dict:
        """JSON-ready form (what ``onnx-qat check --json`` prints)."""
        return {
            "passed": self.passed,
            "model": self.model,
            "opset": self.opset,
            "num_q": self.num_q,
            "num_dq": self.num_dq,
            "num_errors": len(self.errors),
            "num_warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
        }


def _rule_key(rule: str):
    return (len(rule), rule)


# -- a read-only index of one graph --------------------------------------------------------------
class _Types:
    """Declared and (on demand) inferred element types and shapes of one graph's tensors.

    Declared value infos (graph inputs, outputs, ``value_info``) are read when first asked
    for; onnx shape inference runs only when a rule asks about a tensor whose declaration
    is missing or incomplete (no element type, or a shape with unknown dimensions), and
    then at most once. A complete declaration is trusted as it is.
    """

    def __init__(self, graph, infer: Optional[Callable[[], list]]):
        self._graph = graph
        self._infer = infer
        self._declared: Optional[dict] = None
        self._inferred: Optional[dict] = None
        self._elem_types: Dict[str, Optional[int]] = {}

    def _find(self, tensor: str, complete: Callable) -> Optional[object]:
        """The tensor type of ``tensor``: the declared one when ``complete`` accepts it, else the
        inferred one, else the declared one (or None)."""
        if self._declared is None:
            g = self._graph
            self._declared = {vi.name: vi for part in (g.input, g.output, g.value_info) for vi in part}
        declared = _tensor_type(self._declared.get(tensor))
        if declared is not None and complete(declared):
            return declared
        if self._inferred is None:
            self._inferred = {vi.name: vi for vi in self._infer()} if self._infer is not None else {}
        inferred = _tensor_type(self._inferred.get(tensor))
        return inferred if inferred is not None and complete(inferred) else declared or inferred

    def elem_type(self, tensor: str) -> Optional[int]:
        if tensor not in self._elem_types:  # rules C3 and C4 ask about every DQ input
            tt = self._find(tensor, _has_elem_type)
            self._elem_types[tensor] = tt.elem_type if tt is not None and tt.elem_type else None
        return self._elem_types[tensor]

    def shape(self, tensor: str) -> Optional[Tuple[Optional[int], ...]]:
        tt = self._find(tensor, lambda t: t.HasField("shape") and all(d.HasField("dim_value")
                                                                       for d in t.shape.dim))
        if tt is None or not tt.HasField("shape"):
            return None
        return tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)


def _has_elem_type(tensor_type) -> bool:
    return tensor_type.elem_type != 0


def _tensor_type(value_info):
    if value_info is None or not value_info.type.HasField("tensor_type"):
        return None
    return value_info.type.tensor_type


class _QDQ(NamedTuple):
    """One QuantizeLinear/DequantizeLinear node with the fields the rules read, taken from the
    protobuf once by the index: most rules visit every Q/DQ node, and each protobuf field read
    builds new Python objects. Absent inputs and outputs are ``""``."""

    pos: int        # position in the graph's node list
    is_q: bool      # QuantizeLinear (else DequantizeLinear)
    data: str       # input 0
    scale: str      # input 1
    zp: str         # input 2
    out: str        # output 0
    domain: str
    attrs: tuple    # the node's AttributeProto messages


_QUANTIZE, _DEQUANTIZE = "QuantizeLinear", "DequantizeLinear"
_DEFAULT_DOMAINS = ("", "ai.onnx")
_INT, _GRAPH, _GRAPHS = 2, 5, 10  # onnx.AttributeProto.INT / GRAPH / GRAPHS


@dataclass
class _Graph:
    """Producers, consumers, constants and types of one (sub)graph, read from the protobuf.

    Nodes are held as parallel lists indexed by their position (op type, input names), not as
    one object per node: on a 10^5-node model the per-node objects cost more to build and to free
    than all the rules that read them. Only the Q/DQ nodes get a record (:class:`_QDQ`), since
    they are what most rules visit. Node names are read when a finding names a node (:meth:`name`).
    """

    graph: object                         # the onnx.GraphProto
    prefix: str                           # of node names: ``parent/attribute/`` inside subgraphs
    ops: List[str]
    node_inputs: List[List[str]]
    producer: Dict[str, int]
    #: node indices reading each QuantizeLinear output (one entry per reading input), see :meth:`readers`
    q_readers: Dict[str, List[int]]
    constants: Dict[str, object]          # name -> onnx.TensorProto (converted lazily)
    types: _Types
    outputs: frozenset
    opset: Optional[int]
    qdq: List[_QDQ] = field(default_factory=list)   # every Q/DQ node, in graph order
    qdq_at: Dict[int, _QDQ] = field(default_factory=dict)  # node index -> its Q/DQ record
    _arrays: Dict[str, object] = field(default_factory=dict)
    _memo: Dict[str, dict] = field(default_factory=dict)
    _stored: Dict[str, Tuple[int, Optional[bytes]]] = field(default_factory=dict)
    _residual_adds: Optional[List[int]] = None
    _weight_inputs: Dict[int, Optional[int]] = field(default_factory=dict)
    _qdq_readers: Optional[Dict[str, List[int]]] = None

    def array(self, name: str):
        """The numpy value of a constant tensor, or None."""
        if name not in self.constants:
            return None
        if name not in self._arrays:
            self._arrays[name] = _to_array(self.constants[name])
        return self._arrays[name]

    def memo(self, key: str, tensor: str, judge: Callable):
        """``judge(self.array(tensor))``, computed once per ``(key, tensor)``: a Q and its DQ
        share their scale and zero point, and a rule judges each constant once."""
        cache = self._memo.setdefault(key, {})
        if tensor not in cache:
            cache[tensor] = judge(self.array(tensor))
        return cache[tensor]

    def prejudge(self, key: str, tensors, data_type: int, dtype: str, accept: Callable, verdict) -> frozenset:
        """Settle :meth:`memo` ``(key, tensor)`` as ``verdict`` for every tensor among ``tensors``
        (constants of element type ``data_type``, NumPy ``dtype``, stored as raw bytes) whose
        elements all pass ``accept`` (a vectorized test), in one NumPy pass over all of them, and
        return the names so settled. The others are left to the rule's own per-tensor judgement,
        which gives ``verdict`` for exactly the tensors accepted here.

        The raw bytes are judged without reading the tensor's dims (a costly field on many small
        tensors): the per-tensor judgement reads the same bytes as an array of these dims, or
        finds them unreadable (a length that does not match the dims) and then also gives
        ``verdict``; so a tensor whose every element passes gets ``verdict`` either way."""
        import numpy as np

        cache = self._memo.setdefault(key, {})
        itemsize = np.dtype(dtype).itemsize
        stored = self._stored
        names, raws = [], []
        for tensor in dict.fromkeys(tensors):
            if tensor in cache:
                continue
            info = stored[tensor] if tensor in stored else self.stored(tensor)
            if info is None or info[0] != data_type:
                continue
            raw = info[1]
            if raw and not len(raw) % itemsize:  # raw bytes, not empty, whole elements
                names.append(tensor)
                raws.append(raw)
        if not names:
            return frozenset()
        passed = accept(np.frombuffer(b"".join(raws), dtype=dtype))
        counts = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws)) // itemsize
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        settled = frozenset(compress(names, np.logical_and.reduceat(passed, starts).tolist()))
        cache.update(dict.fromkeys(settled, verdict))
        return settled

    def stored(self, name: str) -> Optional[Tuple[int, Optional[bytes]]]:
        """``(element type, raw bytes)`` of constant ``name``, read once (a Q and its DQ share their
        scale and zero point, and rules C4, C5 and C6 read them); the bytes are None when the value
        is stored otherwise (typed fields, external data). None when ``name`` is no constant."""
        if name in self._stored:
            return self._stored[name]
        proto = self.constants.get(name)
        info = None
        if proto is not None:
            raw = None
            if not proto.data_location:
                raw = proto.raw_data
                if not raw and not proto.HasField("raw_data"):
                    raw = None
            info = (proto.data_type, raw)
        self._stored[name] = info
        return info

    def value_shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """The shape of constant ``name``'s value, None when it is no constant or cannot be read:
        its dims when its raw bytes are well formed (no array built), else the array's shape."""
        proto = self.constants.get(name)
        if proto is None:
            return None
        dims, (data_type, raw) = tuple(proto.dims[:]), self.stored(name)
        size = _itemsizes().get(data_type)
        if size and raw is not None and len(raw) == math.prod(dims) * size:
            return dims
        value = self.array(name)
        return None if value is None else tuple(value.shape)

    def multi_element_shapes(self, tensors) -> Dict[str, Tuple[int, ...]]:
        """``name -> value_shape(name)`` for the constants among ``tensors`` whose declared dims and
        value both hold more than one element (rule C6's per-channel scales), each read once.

        Raw bytes of exactly one element are passed over without reading the dims (a costly field
        on many small tensors): the value then has one element, or cannot be read, whatever the
        dims say, so :meth:`value_shape` is a one-element shape or None."""
        sizes, stored = _itemsizes(), self._stored
        shapes = {}
        for name in tensors:
            info = stored[name] if name in stored else self.stored(name)
            if info is None:
                continue
            data_type, raw = info
            size = sizes.get(data_type)
            if size and raw is not None and len(raw) == size:
                continue
            dims = tuple(self.constants[name].dims[:])
            count = math.prod(dims)
            if count <= 1:
                continue
            if size and raw is not None and len(raw) == count * size:
                shapes[name] = dims  # what value_shape gives, without reading the fields again
                continue
            shape = self.value_shape(name)
            if shape is not None and math.prod(shape) > 1:
                shapes[name] = shape
        return shapes

    def name(self, idx: int) -> str:
        """Display name of node ``idx``: its name (``<Op #i>`` when unnamed), prefixed inside subgraphs."""
        return self.prefix + (self.graph.node[idx].name or f"<{self.ops[idx]} #{idx}>")

    def readers(self, tensor: str) -> List[int]:
        """Indices of the nodes reading ``tensor``, a Q/DQ output (once per reading input).

        Only the rules about Q/DQ outputs ask who reads a tensor: rule C7 about every Q output
        (listed by the index), C12 and C14 about the DQ outputs after some Q nodes (after a Pad or
        a weighted op: none in most models). So the readers of the DQ outputs are listed, in one
        more pass over the node inputs, only when first asked for."""
        found = self.q_readers.get(tensor)
        if found is None:
            if self._qdq_readers is None:
                self._qdq_readers = _readers_of({node.out for node in self.qdq if node.out}, self.node_inputs)
            found = self._qdq_readers.get(tensor, [])
        return found

    def producer_op(self, tensor: str) -> Optional[str]:
        idx = self.producer.get(tensor)
        return None if idx is None else self.ops[idx]

    def name_of_producer(self, tensor: str) -> str:
        idx = self.producer.get(tensor)
        return "" if idx is None else self.name(idx)

    def is_constant(self, tensor: str) -> bool:
        """Initializer or Constant output, possibly through shape-only ops (Transpose, Cast...)."""
        constants, producer = self.constants, self.producer
        seen = 0
        while tensor and seen < 16:
            if tensor in constants:
                return True
            idx = producer.get(tensor)
            if idx is None or self.ops[idx] not in _CONST_PASS:
                return False
            inputs = self.node_inputs[idx]
            if any(i and i not in constants for i in inputs[1:]):
                return False
            tensor, seen = (inputs[0] if inputs else ""), seen + 1
        return False

    def is_constant_source(self, tensor: str) -> bool:
        """A constant, or a Q/DQ chain whose data input is a constant (a quantized weight)."""
        constants = self.constants
        if tensor and tensor in constants:  # the usual cases first, in short: a constant,
            return True
        idx = self.producer.get(tensor)
        if idx is not None and self.ops[idx] in (_QUANTIZE, _DEQUANTIZE):  # a Q/DQ of a constant
            inputs = self.node_inputs[idx]
            if inputs and inputs[0] and inputs[0] in constants:
                return True
        for _ in range(4):
            if self.is_constant(tensor):
                return True
            idx = self.producer.get(tensor)
            if idx is None or self.ops[idx] not in (_QUANTIZE, _DEQUANTIZE):
                return False
            inputs = self.node_inputs[idx]
            tensor = inputs[0] if inputs else ""
        return False

    def elem_type(self, tensor: str) -> Optional[int]:
        proto = self.constants.get(tensor)
        if proto is not None:
            return proto.data_type
        known = self._qdq_output_type(tensor)
        return known if known is not None else self.types.elem_type(tensor)

    def _qdq_output_type(self, tensor: str) -> Optional[int]:
        """The element type of a QuantizeLinear / DequantizeLinear output, read from the node itself
        (ONNX: a QuantizeLinear writes its zero point's type, a DequantizeLinear its scale's, unless an
        ``output_dtype`` attribute says otherwise), so a model without value_info needs no shape
        inference for the rules asking about Q/DQ tensors. None when the node does not tell."""
        node = self.qdq_at.get(self.producer.get(tensor, -1))
        if node is None or node.domain not in _DEFAULT_DOMAINS or not node.out or node.out != tensor:
            return None
        if node.attrs and any(a.name == "output_dtype" for a in node.attrs):
            return None  # opset 21+: leave it to the declared or inferred type
        source = node.zp if node.is_q else node.scale
        proto = self.constants.get(source)
        if proto is None:
            return _UINT8 if node.is_q and not source else None
        return proto.data_type

    def shape(self, tensor: str) -> Optional[Tuple[Optional[int], ...]]:
        proto = self.constants.get(tensor)
        if proto is not None:
            return tuple(proto.dims[:])
        return self.types.shape(tensor)

    def indices_of(self, ops) -> List[int]:
        """Indices of the nodes whose op type is among ``ops``, in graph order (one C-level pass)."""
        return list(compress(range(len(self.ops)), map(frozenset(ops).__contains__, self.ops)))

    def residual_adds(self) -> List[int]:
        """Indices of the Add nodes with two non-constant inputs (rules C10 and C11 both visit them)."""
        if self._residual_adds is None:
            adds = []
            for i in self.indices_of(("Add",)):
                inputs = self.node_inputs[i]
                if len(inputs) == 2 and not self.is_constant(inputs[0]) and not self.is_constant(inputs[1]):
                    adds.append(i)
            self._residual_adds = adds
        return self._residual_adds


_ITEMSIZES: Dict[int, int] = {}


def _itemsizes() -> Dict[int, int]:
    """Element type -> bytes per element, for the types whose raw bytes :func:`_to_array` reads in
    place (``model_io.tensor_array``); built on first use (``model_io`` imports onnx)."""
    if not _ITEMSIZES:
        from .model_io import _RAW_DTYPES
        _ITEMSIZES.update({data_type: int(dtype[-1]) for data_type, dtype in _RAW_DTYPES.items()})  # "<f4": 4
    return _ITEMSIZES


def _to_array(tensor):
    """A TensorProto's value as a numpy array, or None when it cannot be read (external data
    not loaded, corrupt tensor...)."""
    from .model_io import tensor_array
    try:
        return tensor_array(tensor)
    except Exception:  # external data not loaded, corrupt tensor...
        return None


def _constant_tensor(node):
    """The TensorProto a Constant node produces, or None for exotic forms."""
    from onnx import helper
    for attr in node.attribute:
        if attr.name == "value":
            return attr.t
        if attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
            import numpy as np
            value = helper.get_attribute_value(attr)
            dtype = np.float32 if "float" in attr.name else np.int64
            from onnx import numpy_helper
            return numpy_helper.from_array(np.asarray(value, dtype=dtype))
    return None


def _index_graph(graph, infer, outer_constants, opset, prefix) -> Tuple[_Graph, list]:
    """One pass over ``graph``'s nodes: op types, inputs, producers, constants, Q/DQ nodes; then
    the readers of the QuantizeLinear outputs. Also returns ``(node index, attribute)`` of every
    graph-valued attribute, in node and attribute order, for :func:`_walk`.

    Each node's fields are read from the protobuf once (``[:]`` of a repeated string field is the
    cheapest copy). Every node's attributes are looked at, since any node may carry a subgraph;
    those of Q/DQ nodes are kept for the rules (``axis``, ``output_dtype``)."""
    constants = dict(outer_constants)
    for init in graph.initializer:
        constants[init.name] = init
    ops, node_inputs, producer, qdq, subgraphs = [], [], {}, [], []
    new_record = tuple.__new__  # _QDQ(*fields) without the Python-level __new__ of a named tuple
    for i, proto in enumerate(graph.node):
        op = intern(proto.op_type)  # one string per op type: less to keep, compared by identity
        inputs = proto.input[:]
        outputs = proto.output[:]
        ops.append(op)
        node_inputs.append(inputs)
        for out in outputs:
            producer[out] = i
        attrs = proto.attribute
        if op == _QUANTIZE or op == _DEQUANTIZE:
            attrs = tuple(attrs) if attrs else ()
            n = len(inputs)
            qdq.append(new_record(_QDQ, (i, op == _QUANTIZE, inputs[0] if n else "",
                                         inputs[1] if n > 1 else "", inputs[2] if n > 2 else "",
                                         outputs[0] if outputs else "", proto.domain, attrs)))
        elif op == "Constant" and outputs and proto.domain in _DEFAULT_DOMAINS:
            tensor = _constant_tensor(proto)
            if tensor is not None:
                constants[outputs[0]] = tensor
        if attrs:
            for attr in attrs:
                kind = attr.type
                if kind == _GRAPH or kind == _GRAPHS:
                    subgraphs.append((i, attr))
    producer.pop("", None)  # an absent output is nobody's tensor
    q_readers = _readers_of({node.out for node in qdq if node.out and node.is_q}, node_inputs)
    index = _Graph(graph, prefix, ops, node_inputs, producer, q_readers, constants, _Types(graph, infer),
                   frozenset(o.name for o in graph.output), opset, qdq, {node.pos: node for node in qdq})
    return index, subgraphs


def _readers_of(tensors, node_inputs) -> Dict[str, List[int]]:
    """``tensor -> indices of the nodes reading it`` (once per reading input) for each of ``tensors``."""
    readers: Dict[str, List[int]] = {tensor: [] for tensor in tensors}
    if readers:
        for i, inputs in enumerate(node_inputs):
            for inp in inputs:
                if inp in readers:
                    readers[inp].append(i)
    return readers


def _all_graphs(model, opset, infer) -> List[_Graph]:
    """The main graph and every If/Loop/Scan body, each indexed, outer constants visible inside
    (``infer``: shape inference of the main graph, run only if a rule needs it)."""
    result: List[_Graph] = []
    _walk(model.graph, {}, "", opset, infer, result)
    return result


def _walk(graph, outer, prefix, opset, infer, result) -> None:
    """Index ``graph`` into ``result``, then its subgraphs (depth first, in node and attribute order).

    A module-level function, not a closure: a recursive closure is a reference cycle that would keep
    the whole index alive until the next cyclic collection."""
    index, subgraphs = _index_graph(graph, infer if not prefix else None, outer, opset, prefix)
    result.append(index)
    for i, attr in subgraphs:
        subs = [attr.g] if attr.type == _GRAPH else list(attr.graphs)
        for sub in subs:
            _walk(sub, index.constants, f"{index.name(i)}/{attr.name}/", opset, None, result)


# -- helpers shared by rules ---------------------------------------------------------------------
def _attr(attrs, name, default=None):
    """Attribute ``name`` among ``attrs`` (AttributeProto messages); ``default`` when absent,
    None when unreadable."""
    for attr in attrs:
        if attr.name == name:
            if attr.type == _INT and not attr.ref_attr_name:
                return attr.i  # what onnx.helper.get_attribute_value returns for it
            from onnx import helper
            try:
                return helper.get_attribute_value(attr)
            except Exception:  # an attribute without a valid type
                return None
    return default


def _int_attr(attrs, name, default):
    """An integer attribute, ``default`` when absent, None when it is not an integer."""
    value = _attr(attrs, name, default) if attrs else default
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _input(inputs, k: int) -> str:
    """Input name ``k`` of a node's ``inputs``, or ``""`` when absent (also for malformed nodes)."""
    return inputs[k] if len(inputs) > k else ""


def _qdq_nodes(g: _Graph) -> List[_QDQ]:
    """Every QuantizeLinear/DequantizeLinear node of ``g``, in graph order."""
    return g.qdq


def _fed_by_dq(g: _Graph, tensor: str, through_movement: bool = False) -> bool:
    """True when ``tensor`` is a DequantizeLinear output (optionally through data-movement ops)."""
    producer, ops = g.producer, g.ops
    for _ in range(16):
        idx = producer.get(tensor)
        if idx is None:
            return False
        op = ops[idx]
        if op == _DEQUANTIZE:
            return True
        if not through_movement or op not in _DATA_MOVEMENT:
            return False
        tensor = _input(g.node_inputs[idx], 0)
    return False


def _weight_input(g: _Graph, idx: int) -> Optional[int]:
    """Index of the constant weight input of weighted op ``idx`` (a node index), or None when it has
    none (computed once per node: rules C9, C10, C11 and C14 ask)."""
    known = g._weight_inputs
    if idx in known:
        return known[idx]
    op, inputs = g.ops[idx], g.node_inputs[idx]
    weight = None
    if op in ("Conv", "ConvTranspose"):
        weight = 1 if g.is_constant_source(_input(inputs, 1)) else None
    elif op in ("Gemm", "MatMul"):
        weight = next((k for k in (1, 0) if g.is_constant_source(_input(inputs, k))), None)
    known[idx] = weight
    return weight


def _weighted_producer(g: _Graph, tensor: str) -> Optional[int]:
    """Node index of the weighted op producing ``tensor`` directly or through one
    BatchNormalization, or None."""
    idx = g.producer.get(tensor)
    if idx is not None and g.ops[idx] == "BatchNormalization":
        idx = g.producer.get(_input(g.node_inputs[idx], 0))
    if idx is None:
        return None
    if g.ops[idx] in WEIGHTED_OPS and _weight_input(g, idx) is not None:
        return idx
    return None


_TYPE_NAMES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
               10: "float16", 11: "float64", 16: "bfloat16", 17: "float8e4m3fn", 21: "uint4", 22: "int4"}


def _type_name(elem_type) -> str:
    return _TYPE_NAMES.get(elem_type, f"type {elem_type}")


# -- the rules ----------------------------------------------------------------------------------------
def rule_c1_opset(model, graphs) -> Iterator[Finding]:
    """C1 (error): the default-domain opset must be >= 13.

    Per-axis QuantizeLinear/DequantizeLinear (the ``axis`` attribute) exist from
    opset 13; TensorRT's ONNX parser imports Q/DQ only from there.
    Source: [ONNX-TRT] operator support for QuantizeLinear/DequantizeLinear; [TRT-EQ].
    """
    opset = graphs[0].opset
    if opset is None:
        yield Finding("C1", ERROR, MODEL_NODE, "the model imports no default-domain opset")
    elif opset < 13:
        yield Finding("C1", ERROR, MODEL_NODE,
                      f"opset {opset} is below 13; upgrade it (onnx.version_converter) before quantizing")


def _is_forbidden(op: str) -> bool:
    return op.startswith("QLinear") or op in FORBIDDEN_OPS


def rule_c2_forbidden_ops(model, graphs) -> Iterator[Finding]:
    """C2 (error): no QLinear*, ConvInteger, MatMulInteger, DynamicQuantizeLinear (or kin).

    These are onnxruntime's integer-operator formats; TensorRT imports only
    default-domain QuantizeLinear/DequantizeLinear pairs around float ops (not the
    ``com.microsoft`` Q/DQ contrib ops).
    Source: [TRT-EQ] "ONNX Support"; [ONNX-TRT] operator support list.
    """
    for g in graphs:
        if any(_is_forbidden(op) for op in set(g.ops)):
            visits = [(i, op, g.qdq_at.get(i)) for i, op in enumerate(g.ops)]
        else:  # only a Q/DQ node outside the default domain can be reported
            visits = [(node.pos, _QUANTIZE if node.is_q else _DEQUANTIZE, node) for node in g.qdq
                      if node.domain not in _DEFAULT_DOMAINS]
        for i, op, node in visits:
            if _is_forbidden(op):
                yield Finding("C2", ERROR, g.name(i),
                              f"{op} is not supported by TensorRT; export QuantizeLinear/"
                              "DequantizeLinear (QDQ format) instead")
            elif node is not None and node.domain not in _DEFAULT_DOMAINS:
                yield Finding("C2", ERROR, g.name(i),
                              f"{op} of domain {node.domain!r} is not the ONNX operator TensorRT "
                              "imports; use the default-domain op")


def rule_c3_int32_bias(model, graphs) -> Iterator[Finding]:
    """C3 (error): no DequantizeLinear of an int32 tensor (quantized bias).

    TensorRT quantizes only activations and weights to INT8 and keeps biases in
    float; an int32 bias DQ is onnxruntime's QDQ bias form.
    Source: [TRT-EQ] (INT8 Q/DQ only); [ONNX-TRT] DequantizeLinear input types.
    """
    int32 = 6  # onnx.TensorProto.INT32
    for g in graphs:
        constants = g.constants
        for node in _qdq_nodes(g):
            if node.is_q:
                continue
            proto = constants.get(node.data)  # a constant (a weight, a bias): its type, in short
            if (proto.data_type if proto is not None else g.elem_type(node.data)) == int32:
                yield Finding("C3", ERROR, g.name(node.pos),
                              f"dequantizes int32 tensor {node.data!r} (a quantized bias); "
                              "keep biases in float for TensorRT")


def rule_c4_zero_points(model, graphs) -> Iterator[Finding]:
    """C4 (error): zero points must be constant int8 zeros (symmetric signed INT8).

    A QuantizeLinear without a zero point (and no ``output_dtype``) produces uint8.
    Source: [TRT-EQ] "TensorRT supports only symmetric ... signed INT8", zero point 0;
    [ONNX-TRT] QuantizeLinear/DequantizeLinear: "zero point must be 0".
    """
    from onnx import TensorProto
    for g in graphs:
        # A constant int8 all-zero zero point is fine whatever else the node is: judged in one batch.
        zero_points = [node.zp for node in _qdq_nodes(g) if node.zp]
        good = g.prejudge("C4", zero_points, TensorProto.INT8, "i1", _is_zero, None)
        for node in _qdq_nodes(g):
            zp = node.zp
            if zp in good:
                continue
            name = g.name(node.pos)
            if not node.is_q and g.elem_type(node.data) == TensorProto.INT32:
                continue  # a quantized bias: rule C3 reports it
            if not zp:
                dtype = (_int_attr(node.attrs, "output_dtype", 0) or TensorProto.UINT8) if node.is_q \
                    else g.elem_type(node.data)
                if dtype not in (None, TensorProto.INT8):
                    yield Finding("C4", ERROR, name, f"has no zero point, so its integer type is "
                                  f"{_type_name(dtype)}; TensorRT needs an int8 zero point of 0")
                continue
            if not g.is_constant(zp):
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not a constant")
                continue
            dtype = g.elem_type(zp)
            if dtype != TensorProto.INT8:
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is {_type_name(dtype)}; "
                              "TensorRT needs int8 (symmetric quantization, zero point 0)")
                continue
            nonzero = g.memo("C4", zp, _first_nonzero)
            if nonzero is not None:
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not all zero (e.g. {nonzero}); "
                              "TensorRT needs symmetric quantization")


def _is_zero(values):
    return values == 0


def _finite_positive(values):
    import numpy as np
    return np.isfinite(values) & (values > 0)


def _first_nonzero(values) -> Optional[int]:
    """The first non-zero value of a zero-point array, or None (also for an unreadable one)."""
    if values is None or not values.size:
        return None
    flat = values.reshape(-1)
    if flat.size == 1:
        value = int(flat[0])
        return value if value else None
    nonzero = flat != 0
    return int(flat[nonzero.argmax()]) if nonzero.any() else None


def rule_c4_ort_cpu_zero_points(model, graphs) -> Iterator[Finding]:
    """C4 for the ``ort-cpu`` target (error): zero points constant, int8 zeros or uint8 0 / 128.

    The ort-cpu form (:mod:`onnx_qat.ort_cpu`) stores activations as uint8 with zero point 128 (or 0
    where they are non-negative) and some weights as uint8 ``q + 128``: the same values as int8 with
    zero point 0. Any other zero point is not a form that target writes.
    """
    import numpy as np
    from onnx import TensorProto
    for g in graphs:
        zero_points = [node.zp for node in _qdq_nodes(g) if node.zp]
        good = g.prejudge("C4-ort-cpu", zero_points, TensorProto.INT8, "i1", _is_zero, False) | \
            g.prejudge("C4-ort-cpu", zero_points, TensorProto.UINT8, "u1", _is_zero_or_128, False)
        for node in _qdq_nodes(g):
            zp = node.zp
            if zp in good:
                continue  # a constant of an allowed type and values: no finding, whatever the node
            name = g.name(node.pos)
            if (not node.is_q and g.elem_type(node.data) == TensorProto.INT32) or not zp:
                continue  # C3 reports a quantized bias; no zero point means uint8 zero point 0
            if not g.is_constant(zp):
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not a constant")
                continue
            allowed = _ORT_CPU_ZERO_POINTS.get(g.elem_type(zp))
            if allowed is None or g.memo("C4-ort-cpu", zp, lambda values: values is not None
                                         and not np.isin(values, allowed).all()):
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not int8 0 or uint8 0/128, "
                              "the zero points of the ort-cpu form")


#: Element type -> the zero-point values the ort-cpu form writes (int8 0; uint8 0 or 128).
_ORT_CPU_ZERO_POINTS = {3: (0,), 2: (0, 128)}


def _is_zero_or_128(values):
    return (values == 0) | (values == 128)


#: Rules the ``ort-cpu`` target replaces (rule function) or leaves out (None), with the reason.
ORT_CPU_RULES: Dict[str, Tuple[Optional[Callable], str]] = {
    "C4": (rule_c4_ort_cpu_zero_points, "uint8 activations with zero point 128 or 0 (same values)"),
    "C11": (None, "the Conv output feeding a residual Add is a requantization point (CPU1): "
                  "onnxruntime forms QLinearConv only with a QuantizeLinear on the Conv output"),
    "C14": (None, "a Q/DQ between Conv and Relu is a requantization point (CPU1), for QLinearConv"),
}


def rule_c5_scales(model, graphs) -> Iterator[Finding]:
    """C5 (error): scales must be constants (initializer or Constant), finite and > 0.

    Source: [TRT-EQ] "the scale must be a build-time constant"; [ONNX-TRT]
    QuantizeLinear/DequantizeLinear: scale must be an initializer or constant.
    """
    from onnx import TensorProto
    for g in graphs:
        scales = [node.scale for node in _qdq_nodes(g) if node.scale]
        good = g.prejudge("C5", scales, TensorProto.FLOAT, "<f4", _finite_positive, "")
        for node in _qdq_nodes(g):
            scale = node.scale
            if scale in good:
                continue  # a constant, finite and > 0
            if not scale or not g.is_constant(scale):
                yield Finding("C5", ERROR, g.name(node.pos), f"scale {scale!r} is not a constant "
                              "(initializer or Constant node); TensorRT needs build-time scales")
                continue
            problem = g.memo("C5", scale, _scale_problem)
            if problem:
                yield Finding("C5", ERROR, g.name(node.pos), f"scale {scale!r} {problem}")


def _scale_problem(values) -> str:
    """What is wrong with a scale array (``""`` when it is finite and > 0, or unreadable)."""
    import numpy as np
    if values is None:
        return ""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 1:
        value = float(values.reshape(-1)[0])
        if math.isfinite(value) and value > 0:
            return ""
    if not np.isfinite(values).all():
        return "holds a NaN or infinite value"
    if (values <= 0).any():
        return f"holds a value <= 0 (min {values.min():.3g}); scales must be > 0"
    return ""


def _quantized_source(g: _Graph, node: _QDQ) -> str:
    """The float tensor a Q/DQ node stands for (the Q input for a DQ fed by a Q)."""
    if not node.is_q:
        idx = g.producer.get(node.data)
        if idx is not None and g.ops[idx] == _QUANTIZE:
            return _input(g.node_inputs[idx], 0)
    return node.data


def rule_c6_per_channel(model, graphs) -> Iterator[Finding]:
    """C6 (error): per-channel scales need an axis in range and one scale per channel.

    Also warns about per-channel quantization of an activation: TensorRT quantizes
    activations per tensor and weights per channel.
    Source: [TRT-EQ] "per-tensor quantization for activations, per-channel for weights";
    [ONNX-TRT] QuantizeLinear/DequantizeLinear ``axis``.
    """
    for g in graphs:
        # Per-tensor scales (one element) need no further look: the shapes are judged once per scale.
        scale_shapes = g.multi_element_shapes({node.scale for node in _qdq_nodes(g)})
        for node in _qdq_nodes(g):
            scale_shape = scale_shapes.get(node.scale)
            if scale_shape is None:
                continue
            scale_size = math.prod(scale_shape)
            data = node.data
            shape = g.shape(data) or g.shape(_quantized_source(g, node))
            axis = _int_attr(node.attrs, "axis", 1)
            if axis is None:
                yield Finding("C6", ERROR, g.name(node.pos), "its axis attribute is not an integer")
                continue
            zp = node.zp
            zp_shape = g.shape(zp) if zp else None
            if zp_shape is not None and tuple(zp_shape) != scale_shape:
                yield Finding("C6", ERROR, g.name(node.pos), f"zero point shape {list(zp_shape)} differs "
                              f"from scale shape {list(scale_shape)}")
            if shape is not None:
                rank = len(shape)
                if not -rank <= axis < rank:
                    yield Finding("C6", ERROR, g.name(node.pos),
                                  f"axis {axis} is out of range for {data!r} of rank {rank}")
                    continue
                channels = shape[axis]
                if channels is not None and channels != scale_size:
                    yield Finding("C6", ERROR, g.name(node.pos), f"{scale_size} scales for {channels} "
                                  f"channels of {data!r} on axis {axis}")
            if not g.is_constant_source(data):
                yield Finding("C6", WARNING, g.name(node.pos), f"activation {data!r} is quantized per "
                              f"channel ({scale_size} scales); TensorRT quantizes activations per tensor")


def rule_c7_q_without_dq(model, graphs) -> Iterator[Finding]:
    """C7 (error): every QuantizeLinear output must be read by DequantizeLinear only.

    An int8 tensor reaching a float op or a graph output is not the explicit
    Q -> DQ pair TensorRT fuses; the network would compute on int8 values.
    Source: [TRT-EQ] "Q/DQ layers are processed in pairs" and Q/DQ propagation.
    """
    for g in graphs:
        ops = g.ops
        for node in _qdq_nodes(g):
            out = node.out
            if not node.is_q or not out:
                continue
            readers = g.readers(out)
            others = [i for i in readers if ops[i] != _DEQUANTIZE]
            if out in g.outputs:
                yield Finding("C7", ERROR, g.name(node.pos),
                              f"its int8 output {out!r} is a graph output; add a DequantizeLinear")
            if others:
                others = sorted({g.name(i) for i in others})
                yield Finding("C7", ERROR, g.name(node.pos), f"its int8 output {out!r} feeds "
                              f"{', '.join(others)} without a DequantizeLinear")
            if not readers and out not in g.outputs:
                yield Finding("C7", WARNING, g.name(node.pos), f"its output {out!r} is never used")


def rule_c8_dq_source(model, graphs) -> Iterator[Finding]:
    """C8 (warning): a DequantizeLinear should be fed by a QuantizeLinear or an int8 constant.

    A DQ of another tensor (an int8 graph input, the output of another op) is
    accepted by TensorRT only for int8 network inputs; everywhere else it means a
    broken pair. Warning, not error, because int8 inputs are legitimate.
    Source: [TRT-EQ] Q/DQ pairs and quantized weights ("an IDequantizeLayer is
    required between the weights and the linear operator").
    """
    for g in graphs:
        for node in _qdq_nodes(g):
            if node.is_q:
                continue
            data = node.data
            if data and data in g.constants:  # is_constant(data), in short
                continue
            idx = g.producer.get(data)
            if (idx is not None and g.ops[idx] == _QUANTIZE) or g.is_constant(data):
                continue
            origin = f"node {g.name(idx)!r}" if idx is not None else "a graph input"
            yield Finding("C8", WARNING, g.name(node.pos), f"dequantizes {data!r} from {origin}, not from a "
                          "QuantizeLinear or an int8 constant")


def rule_c9_weighted_ops(model, graphs) -> Iterator[Finding]:
    """C9 (error): Conv, ConvTranspose, Gemm, MatMul (constant weight): both or neither input quantized.

    TensorRT runs a weighted op in INT8 only when its activation and weight both
    come through Q/DQ; with one side alone it falls back to float around a useless
    Q/DQ (and some versions refuse the network).
    Source: [TRT-PL] "quantize all inputs of weighted operations (Convolution,
    Transposed Convolution and GEMM)".
    """
    for g in graphs:
        for i in g.indices_of(WEIGHTED_OPS):
            w = _weight_input(g, i)
            if w is None:
                continue
            inputs = g.node_inputs[i]
            act = 1 - w if g.ops[i] in ("Gemm", "MatMul") else 0
            act_q = _fed_by_dq(g, _input(inputs, act), through_movement=True)
            w_q = _fed_by_dq(g, _input(inputs, w), through_movement=True)
            if act_q != w_q:
                which, other = ("weight", "activation") if w_q else ("activation", "weight")
                tensor = _input(inputs, act if w_q else w)
                yield Finding("C9", ERROR, g.name(i), f"only its {which} is quantized; quantize the "
                              f"{other} {tensor!r} too, or neither")


def _is_quantized_op(g: _Graph, idx: int) -> bool:
    act = 0 if g.ops[idx] in ("Conv", "ConvTranspose") else 1 - _weight_input(g, idx)
    return _fed_by_dq(g, _input(g.node_inputs[idx], act), through_movement=True)


def rule_c10_residual_float_skip(model, graphs) -> Iterator[Finding]:
    """C10 (warning): a residual Add fed by a quantized weighted op should get a quantized skip input.

    TensorRT fuses ``Conv + Add`` into one INT8 kernel when the other (skip)
    input comes through Q/DQ; with both inputs float the Add runs separately in
    float and the Conv writes float output.
    Source: [TRT-PL] "Q/DQ placement for residual (element-wise addition) fusion".
    """
    for g in graphs:
        for i in g.residual_adds():
            inputs = g.node_inputs[i]  # two of them
            if _fed_by_dq(g, inputs[0]) or _fed_by_dq(g, inputs[1]):
                continue
            convs = [_weighted_producer(g, t) for t in inputs]
            convs = [c for c in convs if c is not None and _is_quantized_op(g, c)]
            if convs:
                skip = [t for t in inputs if _weighted_producer(g, t) is None] or [inputs[1]]
                conv = convs[0]
                yield Finding("C10", WARNING, g.name(i), f"both inputs are float; quantize the skip input "
                              f"{skip[0]!r} so TensorRT can fuse the Add into {g.ops[conv]} {g.name(conv)!r}")


def rule_c11_residual_conv_branch_quantized(model, graphs) -> Iterator[Finding]:
    """C11 (warning): a residual Add with both inputs quantized, one straight from a weighted op.

    The Q/DQ on the branch coming from the Conv stops TensorRT from fusing the
    Add into that Conv; leave that branch float and quantize only the skip input.
    Source: [TRT-PL] residual-add fusion ("do not quantize the output of the
    convolution that feeds the element-wise addition").
    """
    for g in graphs:
        for i in g.residual_adds():
            inputs = g.node_inputs[i]
            if not all(_fed_by_dq(g, t) for t in inputs):
                continue
            for t in inputs:
                dq = g.producer[t]  # a DequantizeLinear: every input is fed by one
                q = g.producer.get(_input(g.node_inputs[dq], 0))
                source = _input(g.node_inputs[q], 0) if q is not None and g.ops[q] == _QUANTIZE else None
                conv = _weighted_producer(g, source) if source else None
                if conv is not None:
                    yield Finding("C11", WARNING, g.name(i), f"both inputs are quantized and {t!r} comes "
                                  f"straight from {g.ops[conv]} {g.name(conv)!r}; leave that input float "
                                  "so TensorRT can fuse the Add into it")
                    break


def _dq_readers(g: _Graph, tensor: str) -> List[_QDQ]:
    """The DequantizeLinear nodes reading Q/DQ output ``tensor`` (once per reading input)."""
    return [g.qdq_at[i] for i in g.readers(tensor) if g.ops[i] == _DEQUANTIZE]


def rule_c12_pad_conv(model, graphs) -> Iterator[Finding]:
    """C12 (error): no Q/DQ between Pad and Conv.

    TensorRT fuses Pad into the following Conv; a Q/DQ pair in between blocks the
    fusion and pads in float. Quantize the Pad's input instead (Q/DQ commute with Pad).
    Source: [TRT-PL] commuting layers; DESIGN rule 8.
    """
    for g in graphs:
        for node in _qdq_nodes(g):
            if not node.is_q or g.producer_op(node.data) != "Pad" or not node.out:
                continue
            for dq in _dq_readers(g, node.out):
                if dq.out and any(g.ops[c] in ("Conv", "ConvTranspose") for c in g.readers(dq.out)):
                    yield Finding("C12", ERROR, g.name(node.pos), f"quantizes the output of Pad "
                                  f"{g.name_of_producer(node.data)!r} feeding a Conv; put the Q/DQ "
                                  "before the Pad")
                    break


_FUSIBLE_AFTER_WEIGHTED = frozenset({
    "BatchNormalization", "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "Tanh", "Elu", "Selu",
    "HardSigmoid", "HardSwish",
})
_WEIGHTED_OR_BN = frozenset(WEIGHTED_OPS + ("BatchNormalization",))


def rule_c14_qdq_inside_fusion(model, graphs) -> Iterator[Finding]:
    """C14 (warning): no Q/DQ between a weighted op (or its BatchNormalization) and the
    BatchNormalization/activation that TensorRT fuses into it.

    TensorRT fuses Conv -> BatchNormalization -> Relu (and other pointwise
    activations) into one kernel; a Q/DQ pair inside the chain splits it and adds a
    rounding step the float model never had. Quantize weighted ops' inputs, not
    their outputs.
    Source: [TRT-PL] "quantize the inputs of weighted operations, not their outputs"
    and layer fusion; DESIGN rules 4 and 5.
    """
    for g in graphs:
        ops = g.ops
        for node in _qdq_nodes(g):
            if not node.is_q:
                continue
            source = g.producer.get(node.data)
            if source is None or ops[source] not in _WEIGHTED_OR_BN:
                continue
            if ops[source] != "BatchNormalization" and _weight_input(g, source) is None:
                continue
            dqs = _dq_readers(g, node.out) if node.out else []
            fused = sorted({ops[c] for dq in dqs if dq.out for c in g.readers(dq.out)
                            if ops[c] in _FUSIBLE_AFTER_WEIGHTED})
            if fused:
                yield Finding("C14", WARNING, g.name(node.pos), f"sits between {ops[source]} "
                              f"{g.name(source)!r} and {'/'.join(fused)}, which TensorRT fuses into it; "
                              "remove this Q/DQ")


def rule_c13_not_quantized(model, graphs) -> Iterator[Finding]:
    """C13 (warning): a model without any QuantizeLinear/DequantizeLinear is not quantized.

    TensorRT builds it in float (or implicit INT8 with a calibrator), not with explicit quantization.
    Source: [TRT-EQ] "When TensorRT detects Q/DQ layers in a network, it builds an
    engine using explicit quantization".
    """
    if not any(g.qdq for g in graphs):
        yield Finding("C13", WARNING, MODEL_NODE, "not quantized: the model has no QuantizeLinear/"
                      "DequantizeLinear nodes")


#: (rule id, severity it can report, one-line description, function) in the order they run.
RULES: Tuple[Tuple[str, str, str, Callable], ...] = (
    ("C1", ERROR, "default-domain opset >= 13", rule_c1_opset),
    ("C2", ERROR, "no QLinear*, ConvInteger, MatMulInteger, DynamicQuantizeLinear", rule_c2_forbidden_ops),
    ("C3", ERROR, "no int32 (bias) DequantizeLinear", rule_c3_int32_bias),
    ("C4", ERROR, "zero points constant, int8 and all zero", rule_c4_zero_points),
    ("C5", ERROR, "scales constant, finite and > 0", rule_c5_scales),
    ("C6", ERROR, "per-channel axis in range, one scale per channel (activations per tensor: warning)",
     rule_c6_per_channel),
    ("C7", ERROR, "QuantizeLinear output read only by DequantizeLinear", rule_c7_q_without_dq),
    ("C8", WARNING, "DequantizeLinear fed by QuantizeLinear or an int8 constant", rule_c8_dq_source),
    ("C9", ERROR, "weighted ops quantize both activation and weight, or neither", rule_c9_weighted_ops),
    ("C10", WARNING, "residual Add after a quantized weighted op has a quantized skip input",
     rule_c10_residual_float_skip),
    ("C11", WARNING, "residual Add: the branch straight from the weighted op stays float",
     rule_c11_residual_conv_branch_quantized),
    ("C12", ERROR, "no Q/DQ between Pad and Conv", rule_c12_pad_conv),
    ("C13", WARNING, "the model has Q/DQ nodes at all", rule_c13_not_quantized),
    ("C14", WARNING, "no Q/DQ inside a weighted op -> BatchNormalization/activation fusion",
     rule_c14_qdq_inside_fusion),
)


# -- entry point --------------------------------------------------------------------------------
def _load(model):
    """The ModelProto to read (never a caller's object modified) and its path label."""
    import os
    if isinstance(model, (str, os.PathLike)):
        from .model_io import load_model
        return load_model(model, upgrade_opset=False), str(model)
    import onnx
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"check() needs a model path or an onnx.ModelProto, got {type(model).__name__}")
    return model, ""


def _default_opset(model) -> Optional[int]:
    versions = [imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
    return max(versions) if versions else None


def _inferred_value_info(model):
    """Value infos from shape inference on a copy; empty when inference fails (big or odd models)."""
    import onnx
    try:
        return list(onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info)
    except Exception as exc:  # shape inference is best effort: rules fall back to declared types
        logger.debug("shape inference failed (%s); checking with declared shapes only", exc)
        return []


def _lazy_inference(model) -> Callable[[], list]:
    """:func:`_inferred_value_info` of ``model``, run the first time it is called (if ever)."""
    done: list = []

    def infer() -> list:
        if not done:
            done.append(_inferred_value_info(model))
        return done[0]

    return infer


def _rules_for(target) -> Tuple[Callable, ...]:
    """The rule functions :func:`check` runs for ``target`` (a target name, or None for tensorrt)."""
    from .targets import get_target

    name = get_target(target).name
    replaced = ORT_CPU_RULES if name == "ort-cpu" else {}
    rules = (replaced[rule_id][0] if rule_id in replaced else rule for rule_id, _, _, rule in RULES)
    return tuple(rule for rule in rules if rule is not None)


def check(model, *, target: Optional[str] = None, path=None) -> CheckReport:
    """Check a Q/DQ ONNX model for TensorRT explicit-quantization readiness.

    Args:
        model: a path (loaded without opset upgrade, so an old opset is reported)
            or an ``onnx.ModelProto`` (read only, never modified).
        target: ``None``/``"tensorrt"`` (every rule), or ``"ort-cpu"``: the rules that apply to
            that form, with :data:`ORT_CPU_RULES` replacing C4 and leaving out C11 and C14.
        path: the file an in-memory ``model`` was read from or written to, named in the
            report (:attr:`CheckReport.model`); default: ``model`` itself when it is a path.

    Returns:
        A :class:`CheckReport`; ``bool(report)`` is True when no rule found an
        error. The rules (C1-C14) are listed in :data:`RULES` and docs/check-rules.md.

    Raises:
        ModelError: the model cannot be read.
    """
    from .model_io import cyclic_gc_paused

    rules = _rules_for(target)
    proto, label = _load(model)
    if path is not None:
        label = str(path)
    opset = _default_opset(proto)
    findings = []
    with cyclic_gc_paused():  # the index of a large model is ~10^6 live objects, none of them garbage
        graphs = _all_graphs(proto, opset, _lazy_inference(proto))
        for rule in rules:
            findings.extend(rule(proto, graphs))
        num_q = sum(node.is_q for g in graphs for node in g.qdq)
        num_dq = sum(not node.is_q for g in graphs for node in g.qdq)
        del graphs  # freed by reference counting while the collector is paused
    for finding in findings:
        logger.debug("check %s", finding)
    return CheckReport(tuple(findings), num_q, num_dq, label, opset)


__all__ = ["check", "CheckReport", "Finding", "RULES", "ORT_CPU_RULES", "ERROR", "WARNING"]
