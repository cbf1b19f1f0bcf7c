"""The per-graph index every rule reads (`_Graph`, built once per graph and
subgraph by `_all_graphs`) and the small helpers the rules share.

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import and_, eq, is_, is_not, itemgetter, methodcaller, not_
from sys import intern
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from ..graph.constants import CONSTANT_PASS_OPS, MAX_CONSTANT_HOPS
from ..graph.ops import WEIGHTED_OPS


_NOT_STORED = (None, None)  # `_Graph.stored_all` of a name that is no constant
_UNREAD = (None,)  # a name `_Graph.stored` has not read yet
_UINT8 = 2  # onnx.TensorProto.UINT8: what a QuantizeLinear without a zero point writes
#: Ops that move data without changing values; Q/DQ commutes with them ([TRT-PL]).
_DATA_MOVEMENT = frozenset({
    "Pad", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Slice", "MaxPool",
})


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
    than all the rules that read them. Only the Q/DQ nodes get a record (`_QDQ`), since
    they are what most rules visit. Node names are read when a finding names a node (`name`).
    """

    graph: object                         # the onnx.GraphProto
    prefix: str                           # of node names: ``parent/attribute/`` inside subgraphs
    ops: List[str]
    node_inputs: List[List[str]]
    producer: Dict[str, int]
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
    _weighted: Optional["_Weighted"] = None
    _qdq_readers: Optional[Dict[str, List[int]]] = None
    _dims: Dict[str, Tuple[int, ...]] = field(default_factory=dict)  # constant name -> its dims, when known
    _scalars: Dict[str, object] = field(default_factory=dict)  # names of constants known to be scalars: their
    # dims are () (an edit's new initializers absent from `_dims`; only the keys are read)
    _made_by: Dict[object, frozenset] = field(default_factory=dict)
    _columns: Dict[str, list] = field(default_factory=dict)
    _of_constants: Optional[frozenset] = None
    _indices: Dict[object, List[int]] = field(default_factory=dict)
    node_outputs: List[List[str]] = field(default_factory=list)  # each node's output names, by position
    _ssa: Optional[bool] = None
    _op_codes: Optional[tuple] = None

    def column(self, name: str) -> list:
        """Field ``name`` of every record of `qdq` (``"pos"``, ``"is_q"``, ``"data"``, ``"scale"``,
        ``"zp"``, ``"out"``, ``"domain"``, ``"attrs"``), in graph order: one C-level pass, made once, so
        that rules sift the Q/DQ nodes a column at a time (set and dict lookups mapped over it) and visit
        one by one only those a lookup leaves undecided."""
        found = self._columns.get(name)
        if found is None:
            found = self._columns[name] = list(map(itemgetter(_QDQ._fields.index(name)), self.qdq))
        return found

    def made_by(self, ops) -> frozenset:
        """The tensors whose producer (`producer`) is a node of one of the op types ``ops`` (an op type, or a
        hashable collection of them), made once per ``ops`` from those nodes' outputs (`indices_of`)."""
        found = self._made_by.get(ops)
        if found is None:
            where = self.indices_of((ops,) if isinstance(ops, str) else ops)
            outputs = list(map(self.node_outputs.__getitem__, where))
            if set(map(len, outputs)) == {1}:  # one output each, as usual
                outputs = list(map(itemgetter(0), outputs))
            else:
                where = [i for i, names in zip(where, outputs) for _ in names]
                outputs = list(chain.from_iterable(outputs))
            if self._single_writers():
                found = frozenset(outputs).difference(("",))
            else:  # an output written again by a later node (no valid graph does that) is that node's
                found = frozenset(compress(outputs, map(eq, map(self.producer.get, outputs), where)))
            self._made_by[ops] = found
        return found

    def _single_writers(self) -> bool:
        """Whether no tensor is the output of two nodes (`producer` then names every node's outputs)."""
        if self._ssa is None:
            outputs = self.node_outputs
            written = sum(map(len, outputs)) - sum(map(methodcaller("count", ""), outputs))
            self._ssa = len(self.producer) == written
        return self._ssa

    def constant_flags(self, tensors: List[str]) -> List[bool]:
        """Whether each of ``tensors`` is a name of `constants` (an absent input, ``""``, is none), in one
        C-level pass."""
        constants = self.constants
        found = list(map(constants.__contains__, tensors))
        if "" in constants:  # an initializer without a name (onnx.checker refuses it): no input's value
            found = list(map(and_, map(bool, tensors), found))
        return found

    def of_constants(self) -> frozenset:
        """The outputs of the Q/DQ nodes whose data input is a constant (initializer or Constant output):
        the quantized weights, the usual "constant source" of `is_constant_source` after a constant."""
        found = self._of_constants
        if found is None:
            keep = self.constant_flags(self.column("data"))
            outs, positions = list(compress(self.column("out"), keep)), compress(self.column("pos"), keep)
            if self._single_writers():
                found = frozenset(outs).difference(("",))
            else:  # an output written again by a later node is that node's
                found = frozenset(compress(outs, map(eq, map(self.producer.get, outs), positions)))
            self._of_constants = found
        return found

    def dims(self, name: str) -> Tuple[int, ...]:
        """The ``dims`` of constant ``name`` (known, or read from its protobuf)."""
        found = self._dims.get(name)
        if found is None:
            return () if name in self._scalars else tuple(self.constants[name].dims[:])
        return found

    def data_type(self, name: str) -> int:
        """The element type of constant ``name`` (as read by `stored`, else from its protobuf)."""
        info = self._stored.get(name)
        return info[0] if info is not None else self.constants[name].data_type

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

    def prejudge(self, infos, data_type: int, dtype: str, accept: Callable) -> List[bool]:
        """For each of ``infos`` (``(element type, raw bytes)`` of a Q/DQ node's scale or zero point,
        `stored_column`), whether it is a constant of element type ``data_type`` stored as raw bytes of
        NumPy ``dtype`` whose elements all pass ``accept`` (a vectorized test), judged in one NumPy pass
        over all of them. A rule gives such a node its no-finding verdict at once and leaves the others to
        its own per-tensor judgement, which gives that verdict for exactly the tensors accepted here.

        The raw bytes are judged without reading the tensor's dims (a costly field on many small
        tensors): the per-tensor judgement reads the same bytes as an array of these dims, or
        finds them unreadable (a length that does not match the dims) and then also gives the
        no-finding verdict; so a tensor whose every element passes gets it either way."""
        import numpy as np

        itemsize = np.dtype(dtype).itemsize
        settled = np.zeros(len(infos), dtype=bool)
        where = np.flatnonzero(np.fromiter(map(eq, map(itemgetter(0), infos), repeat(data_type)), dtype=bool,
                                           count=len(infos)))
        raws = list(map(itemgetter(1), map(infos.__getitem__, where.tolist())))
        given = np.fromiter(map(bool, raws), dtype=bool, count=len(raws))  # raw bytes, not empty
        raws, where = list(compress(raws, given.tolist())), where[given]
        lengths = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
        whole = lengths % itemsize == 0  # whole elements
        raws, where, counts = list(compress(raws, whole.tolist())), where[whole], lengths[whole] // itemsize
        if raws:
            passed = accept(np.frombuffer(b"".join(raws), dtype=dtype))
            starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            settled[where] = np.logical_and.reduceat(passed, starts)
        return settled.tolist()

    def stored_column(self, name: str) -> list:
        """`stored_all` of `column` ``name`` (``"scale"``, ``"zp"``, ``"data"``), made once; ``(None, None)``
        for an absent input."""
        key = "stored " + name
        found = self._columns.get(key)
        if found is None:
            names = self.column(name)
            found = self.stored_all(names)
            if "" in self.constants:  # an initializer without a name (onnx.checker refuses it): no input's
                found = [info if tensor else _NOT_STORED for tensor, info in zip(names, found)]
            self._columns[key] = found
        return found

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

    def stored_all(self, names: List[str]) -> List[Tuple[Optional[int], Optional[bytes]]]:
        """`stored` of each of ``names``, a column at a time (those not read yet read one by one), with
        ``(None, None)`` for a name that is no constant."""
        stored = self._stored
        infos = list(map(stored.get, names, repeat(_UNREAD)))
        for k in compress(range(len(infos)), map(is_, infos, repeat(_UNREAD))):
            infos[k] = self.stored(names[k])
        for k in compress(range(len(infos)), map(is_, infos, repeat(None))):
            infos[k] = _NOT_STORED
        return infos

    def value_shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """The shape of constant ``name``'s value, None when it is no constant or cannot be read:
        its dims when its raw bytes are well formed (no array built), else the array's shape."""
        proto = self.constants.get(name)
        if proto is None:
            return None
        dims, (data_type, raw) = self.dims(name), self.stored(name)
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
        dims say, so `value_shape` is a one-element shape or None."""
        import numpy as np

        sizes, names = _itemsizes(), list(tensors)
        infos, known = self.stored_all(names), list(map(self._dims.get, names))
        # Raw bytes of the size their known dims give, more than one element: those dims, told in NumPy.
        count = len(names)
        size = np.fromiter(map(sizes.get, map(itemgetter(0), infos), repeat(0)), dtype=np.int64, count=count)
        length, elements = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)  # 0: unknown
        raws = list(map(itemgetter(1), infos))
        for values, column, measure in ((length, raws, len), (elements, known, math.prod)):
            given = list(map(is_not, column, repeat(None)))
            values[np.flatnonzero(given)] = np.fromiter(map(measure, compress(column, given)), dtype=np.int64)
        fast = ((size > 0) & (elements > 1) & (length == elements * size)).tolist()
        shapes = dict(zip(compress(names, fast), compress(known, fast)))
        for name, (data_type, raw), dims in compress(zip(names, infos, known), map(not_, fast)):
            if data_type is None:  # no constant
                continue
            size = sizes.get(data_type)
            if size and raw is not None and len(raw) == size:
                continue
            if dims is None:
                dims = self.dims(name)
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

        Only the rules about Q/DQ outputs ask who reads a tensor: rule C7 about the Q outputs a set
        lookup leaves in doubt (`quantized_reads`), C12 and C14 about the DQ outputs after some Q nodes
        (after a Pad or a weighted op: none in most models). So the readers of every Q/DQ output are
        listed, in one pass over the node inputs, only when first asked for."""
        if self._qdq_readers is None:
            self._qdq_readers = _readers_of({node.out for node in self.qdq if node.out}, self.node_inputs)
        return self._qdq_readers.get(tensor, [])

    def quantized_reads(self) -> Tuple[bool, bool]:
        """``(every QuantizeLinear output is read by a DequantizeLinear's data input, none is read by
        another op)``, found with set operations (the non-DequantizeLinear nodes' inputs looked up in
        one C-level pass) instead of listing each output's readers (`readers`)."""
        quantize = self.column("is_q")
        outs = set(compress(self.column("out"), quantize))
        outs.discard("")
        ops, dequantize = self.ops, _DEQUANTIZE
        read = not outs.difference(compress(self.column("data"), map(not_, quantize)))
        others = compress(self.node_inputs, map(dequantize.__ne__, ops))
        return read, outs.isdisjoint(chain.from_iterable(others))

    def producer_op(self, tensor: str) -> Optional[str]:
        idx = self.producer.get(tensor)
        return None if idx is None else self.ops[idx]

    def name_of_producer(self, tensor: str) -> str:
        idx = self.producer.get(tensor)
        return "" if idx is None else self.name(idx)

    def is_constant(self, tensor: str) -> bool:
        """Initializer or Constant output, possibly through the ops of
        `CONSTANT_PASS_OPS` (Transpose, Cast...): the one meaning of
        "constant" (`onnx_qat.graph.constants`)."""
        constants, producer = self.constants, self.producer
        seen = 0
        while tensor and seen < MAX_CONSTANT_HOPS:
            if tensor in constants:
                return True
            idx = producer.get(tensor)
            if idx is None or self.ops[idx] not in CONSTANT_PASS_OPS:
                return False
            inputs = self.node_inputs[idx]
            if any(i and i not in constants and not self.is_constant(i) for i in inputs[1:]):
                return False
            tensor, seen = (inputs[0] if inputs else ""), seen + 1
        return False

    def are_constant(self, tensors: List[str]) -> List[bool]:
        """`is_constant` of each of ``tensors``, a column at a time: only a tensor that is no constant
        but is written by one of `CONSTANT_PASS_OPS` is followed back one by one."""
        found = self.constant_flags(tensors)
        passed = self.made_by(CONSTANT_PASS_OPS)
        for k in compress(range(len(found)), map(passed.__contains__, tensors)):
            found[k] = self.is_constant(tensors[k])
        return found

    def is_constant_source(self, tensor: str) -> bool:
        """A constant, or a Q/DQ chain whose data input is a constant (a quantized weight)."""
        if tensor and tensor in self.constants or tensor in self.of_constants():  # the usual cases in short:
            return True  # a constant, a Q/DQ of a constant
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
        if tensor in self.constants:
            return self.data_type(tensor)
        known = self._qdq_output_type(tensor)
        return known if known is not None else self.types.elem_type(tensor)

    def elem_types(self, tensors: List[str]) -> List[Optional[int]]:
        """`elem_type` of each of ``tensors``, a column at a time: a constant's type read already
        (`stored`) and the type a QuantizeLinear gives its output (`_quantized_outputs`) looked up at once;
        the other tensors asked one by one."""
        stored, constants = self._stored, self.constants
        found = [info[0] if info else None for info in map(stored.get, tensors)]  # a stored None: no constant
        known = self._quantized_outputs()
        for k in compress(range(len(found)), map(is_, found, repeat(None))):
            name = tensors[k]
            dtype = None if name in constants else known.get(name)
            found[k] = dtype if dtype is not None else self.elem_type(name)
        return found

    def _quantized_outputs(self) -> Dict[str, int]:
        """QuantizeLinear output -> its element type, as `_qdq_output_type` reads it (its zero point's, from
        `stored_column`), for the QuantizeLinear nodes of the default domain without ``output_dtype`` whose
        zero point is a constant; found a column at a time, once."""
        known = self._memo.get("quantized outputs")
        if known is None:
            quantize, column = self.column("is_q"), self.column
            attrs = list(compress(column("attrs"), quantize))
            told = {key: not found or not any(a.name == "output_dtype" for a in found)
                    for key, found in dict(zip(map(id, attrs), attrs)).items()}  # once per attributes' tuple
            keep = list(map(and_, map(_DEFAULT_DOMAINS.__contains__, compress(column("domain"), quantize)),
                            map(told.__getitem__, map(id, attrs))))
            outs = list(compress(compress(column("out"), quantize), keep))
            types = compress(map(itemgetter(0), compress(self.stored_column("zp"), quantize)), keep)
            if self._single_writers():
                known = dict(zip(outs, types))
            else:  # an output written again by a later node is that node's
                positions = compress(compress(column("pos"), quantize), keep)
                known = {out: dtype for out, dtype, pos in zip(outs, types, positions)
                         if self.producer.get(out) == pos}
            known.pop("", None)
            self._memo["quantized outputs"] = known
        return known

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
        if source not in self.constants:
            return _UINT8 if node.is_q and not source else None
        return self.data_type(source)

    def shape(self, tensor: str) -> Optional[Tuple[Optional[int], ...]]:
        if tensor in self.constants:
            return self.dims(tensor)
        return self.types.shape(tensor)

    def indices_of(self, ops) -> List[int]:
        """Indices of the nodes whose op type is among ``ops`` (a hashable collection), in graph order: the
        op types are coded as small integers once (one C-level pass), each such list found with NumPy and
        kept (the rules ask for a few, some more than once; callers do not change it)."""
        found = self._indices.get(ops)
        if found is None:
            import numpy as np

            if self._op_codes is None:
                codes = {op: k for k, op in enumerate(set(self.ops))}
                self._op_codes = (codes, np.fromiter(map(codes.__getitem__, self.ops), dtype=np.int32,
                                                     count=len(self.ops)))
            codes, column = self._op_codes
            wanted = [codes[op] for op in frozenset(ops) if op in codes]
            found = self._indices[ops] = np.flatnonzero(np.isin(column, wanted)).tolist() if wanted else []
        return found

    def residual_adds(self) -> List[int]:
        """Indices of the residual joins: Add nodes with two non-constant inputs, and Sum nodes whose
        first two inputs are non-constant (TensorRT imports a Sum as a chain of sums whose first link
        adds inputs 0 and 1; rules C10 and C11 both visit them and look at those two inputs)."""
        if self._residual_adds is None:
            ops, node_inputs = self.ops, self.node_inputs
            joins = [i for i in self.indices_of(("Add", "Sum")) if len(node_inputs[i]) == 2
                     or len(node_inputs[i]) > 2 and ops[i] == "Sum"]
            pairs = list(zip(_inputs_at(self, joins, 0), _inputs_at(self, joins, 1)))
            constant = self.are_constant(list(chain.from_iterable(pairs)))  # first and second addends in turn
            self._residual_adds = [i for i, (a, b), c, d in zip(joins, pairs, constant[0::2], constant[1::2])
                                   if a and b and not c and not d]
        return self._residual_adds


_ITEMSIZES: Dict[int, int] = {}


def _itemsizes() -> Dict[int, int]:
    """Element type -> bytes per element, for the types whose raw bytes `_to_array` reads in
    place (``model_io.tensor_array``); built on first use (``model_io`` imports onnx)."""
    if not _ITEMSIZES:
        from ..io.models import _RAW_DTYPES
        _ITEMSIZES.update({data_type: int(dtype[-1]) for data_type, dtype in _RAW_DTYPES.items()})  # "<f4": 4
    return _ITEMSIZES


def _to_array(tensor):
    """A TensorProto's value as a numpy array, or None when it cannot be read (external data
    not loaded, corrupt tensor...)."""
    from ..io.models import tensor_array
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
    """One pass over ``graph``'s nodes: op types, inputs, producers, constants, Q/DQ nodes. Also returns
    ``(node index, attribute)`` of every graph-valued attribute, in node and attribute order, for `_walk`.

    Each node's fields are read from the protobuf once (``[:]`` of a repeated string field is the
    cheapest copy). Every node's attributes are looked at, since any node may carry a subgraph;
    those of Q/DQ nodes are kept for the rules (``axis``, ``output_dtype``)."""
    constants = dict(outer_constants)
    for init in graph.initializer:
        constants[init.name] = init
    ops, node_inputs, node_outputs, producer, qdq, subgraphs = [], [], [], {}, [], []
    new_record = tuple.__new__  # _QDQ(*fields) without the Python-level __new__ of a named tuple
    for i, proto in enumerate(graph.node):
        op = intern(proto.op_type)  # one string per op type: less to keep, compared by identity
        inputs = proto.input[:]
        outputs = proto.output[:]
        ops.append(op)
        node_inputs.append(inputs)
        node_outputs.append(outputs)
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
    index = _Graph(graph, prefix, ops, node_inputs, producer, constants, _Types(graph, infer),
                   frozenset(o.name for o in graph.output), opset, qdq, {node.pos: node for node in qdq},
                   node_outputs=node_outputs)
    return index, subgraphs


def _readers_of(tensors, node_inputs) -> Dict[str, List[int]]:
    """``tensor -> indices of the nodes reading it`` (once per reading input) for each of ``tensors``.

    Every node's inputs are looked up in one C-level pass over all of them in a row; only the inputs
    found are placed (a NumPy binary search of the running input counts gives each one's node)."""
    readers: Dict[str, List[int]] = {tensor: [] for tensor in tensors}
    if readers:
        flat = list(chain.from_iterable(node_inputs))
        found = list(compress(range(len(flat)), map(readers.__contains__, flat)))
        if found:
            import numpy as np

            ends = np.cumsum(np.fromiter(map(len, node_inputs), dtype=np.int64, count=len(node_inputs)))
            nodes = np.searchsorted(ends, found, side="right").tolist()  # node i's inputs end before ends[i]
            for tensor, node in zip(map(flat.__getitem__, found), nodes):
                readers[tensor].append(node)
    return readers


def _all_graphs(model, opset, infer, nodes=None) -> List[_Graph]:
    """The main graph and every If/Loop/Scan body, each indexed, outer constants visible inside
    (``infer``: shape inference of the main graph, run only if a rule needs it). ``nodes``: the
    `onnx_qat.graph.delta.ResultNodes` of ``model``'s main graph as an edit wrote it (no subgraphs):
    the index is then built from them (`_index_written`)."""
    if nodes is not None:
        return [_index_written(model.graph, infer, opset, nodes)]
    result: List[_Graph] = []
    _walk(model.graph, {}, "", opset, infer, result)
    return result


def _index_written(graph, infer, opset, nodes) -> _Graph:
    """What `_index_graph` makes of a main graph without subgraphs, from the `ResultNodes` of the edit
    that wrote it instead of every node's protobuf fields: op types, inputs and outputs as the edit holds
    them; a new node's domain and attributes its form's (one node of each form read); an original
    QuantizeLinear, DequantizeLinear or Constant node read from its protobuf; the new initializers' element
    types and raw bytes (`_Graph.stored`) as the edit made them. The same index (tests/conftest.py has
    every such check compare the two, `same_index`)."""
    constants = dict(zip(nodes.initializers, graph.initializer))
    ops = nodes.ops  # compared by value: the new nodes' op types are one string each already
    node_inputs, outputs, forms = nodes.inputs, nodes.outputs, nodes.forms
    if set(map(len, outputs)) == {1}:  # one output each, as usual: paired in C
        producer = dict(zip(map(itemgetter(0), outputs), range(len(outputs))))
    else:
        producer = {out: i for i, outs in enumerate(outputs) for out in outs}
    producer.pop("", None)  # an absent output is nobody's tensor
    samples = {}  # form -> (domain, attributes) of its nodes
    protos = graph.node
    qdq = []
    new_record = tuple.__new__
    wanted = frozenset((_QUANTIZE, _DEQUANTIZE, "Constant"))
    for i in compress(range(len(ops)), map(wanted.__contains__, ops)):
        op, form = ops[i], forms[i]
        if form is None:
            proto = protos[i]
            domain, attrs = proto.domain, proto.attribute
            attrs = tuple(attrs) if attrs else ()
        else:
            found = samples.get(form)
            if found is None:
                sample = nodes.samples[form]
                sample = sample.proto() if hasattr(sample, "encoded") else sample
                found = samples[form] = (sample.domain, tuple(sample.attribute))
            domain, attrs = found
        inputs = node_inputs[i]
        if op == "Constant":
            outs = outputs[i]
            if outs and domain in _DEFAULT_DOMAINS:
                tensor = _constant_tensor(protos[i])
                if tensor is not None:
                    constants[outs[0]] = tensor
            continue
        n, outs = len(inputs), outputs[i]
        qdq.append(new_record(_QDQ, (i, op == _QUANTIZE, inputs[0] if n else "", inputs[1] if n > 1 else "",
                                     inputs[2] if n > 2 else "", outs[0] if outs else "", domain, attrs)))
    index = _Graph(graph, "", ops, node_inputs, producer, constants, _Types(graph, infer),
                   frozenset(o.name for o in graph.output), opset, qdq, {node.pos: node for node in qdq},
                   node_outputs=outputs)
    index._stored = nodes.stored.copy()  # every one of them an initializer of the result (``constants``)
    index._dims, index._scalars = nodes.dims, nodes.stored  # scalars, unless in dims (both read, not changed)
    index._ssa = True  # `EditEvidence.nodes_of` gives nodes only where the structural pass found no name
    # written twice
    return index


def same_index(written: _Graph, read: _Graph) -> Optional[str]:
    """What differs between an index built by `_index_written` and one `_index_graph` read from the same
    graph's protobuf (None when nothing does): the check that the two give the same findings."""
    if written.ops != read.ops:
        return "op types"
    if list(map(list, written.node_inputs)) != list(map(list, read.node_inputs)):
        return "node inputs"
    if written.producer != read.producer:
        return "producers"
    if any(written.readers(node.out) != read.readers(node.out) for node in read.qdq) \
            or written.quantized_reads() != read.quantized_reads():
        return "readers of QuantizeLinear/DequantizeLinear outputs"
    if list(written.constants) != list(read.constants) or any(
            written.constants[k] != read.constants[k] for k in read.constants):
        return "constants"
    if written.qdq != read.qdq:
        return "QuantizeLinear/DequantizeLinear records"
    for name, info in written._stored.items():
        if read.stored(name) != info:
            return f"stored value of {name!r}"
    for name in chain(written._dims, written._scalars):
        if tuple(read.constants[name].dims) != written.dims(name):
            return f"dims of {name!r}"
    return None


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
    if tensor in g.made_by(_DEQUANTIZE):
        return True
    if not through_movement:
        return False
    producer, ops = g.producer, g.ops
    for _ in range(16):
        idx = producer.get(tensor)
        if idx is None:
            return False
        op = ops[idx]
        if op == _DEQUANTIZE:
            return True
        if op not in _DATA_MOVEMENT:
            return False
        tensor = _input(g.node_inputs[idx], 0)
    return False


def _fed_by_dq_all(g: _Graph, tensors: List[str], through_movement: bool = False) -> List[bool]:
    """`_fed_by_dq` of each of ``tensors``, a column at a time: a DequantizeLinear output is looked up in
    one C-level pass, and only a tensor a data-movement op writes is followed back one by one."""
    fed = list(map(g.made_by(_DEQUANTIZE).__contains__, tensors))
    if through_movement:
        moved = g.made_by(_DATA_MOVEMENT)
        for k in compress(range(len(fed)), map(moved.__contains__, tensors)):
            fed[k] = _fed_by_dq(g, tensors[k], through_movement=True)
    return fed


def _inputs_at(g: _Graph, indices: List[int], k: int) -> List[str]:
    """Input ``k`` (`_input`) of each node of ``indices``."""
    lists = list(map(g.node_inputs.__getitem__, indices))
    if lists and min(map(len, lists)) > k:
        return list(map(itemgetter(k), lists))
    return [_input(inputs, k) for inputs in lists]


def _constant_sources(g: _Graph, tensors: List[str]) -> List[bool]:
    """`_Graph.is_constant_source` of each of ``tensors``: a constant or a Q/DQ output of one (a quantized
    weight) looked up a column at a time, the others followed one by one."""
    found = g.constant_flags(tensors)
    rest = list(compress(range(len(found)), map(not_, found)))
    if rest:  # a Q/DQ output of a constant, in short
        quantized, names = g.of_constants(), list(map(tensors.__getitem__, rest))
        for k, name, hit in zip(rest, names, map(quantized.__contains__, names)):
            found[k] = hit or g.is_constant_source(name)
    return found


def _weight_input(g: _Graph, idx: int) -> Optional[int]:
    """Index of the constant weight input of weighted op ``idx`` (a node index), or None when it has
    none, or when node ``idx`` is no Conv, ConvTranspose, Gemm or MatMul (found for all of them at once,
    `weighted_ops`: rules C9, C10, C11, C14 and C15 ask)."""
    return weighted_ops(g).weights.get(idx)


class _Weighted(NamedTuple):
    """The weighted ops of a graph (`weighted_ops`)."""

    weights: Dict[int, Optional[int]]  # every Conv/ConvTranspose/Gemm/MatMul -> `_weight_input`
    with_weight: List[int]             # those with a constant weight, in graph order
    activations: List[str]             # the activation input of each (input 1 - weight: 0 of a Conv)
    weight_tensors: List[str]          # the weight input of each


def weighted_ops(g: _Graph) -> _Weighted:
    """`_Weighted` of ``g``, found once: a Conv's or ConvTranspose's weight is input 1 when it is a constant
    source (`_Graph.is_constant_source`), a Gemm's or MatMul's the first of inputs 1 and 0 that is."""
    found = g._weighted
    if found is None:
        weights: Dict[int, Optional[int]] = {}
        convs = g.indices_of(("Conv", "ConvTranspose"))
        found_weights = _constant_sources(g, _inputs_at(g, convs, 1))
        weights.update(zip(convs, map(_ONE_OR_NONE.__getitem__, found_weights)))
        gemms = g.indices_of(("Gemm", "MatMul"))
        second = _constant_sources(g, _inputs_at(g, gemms, 1))
        rest = list(compress(gemms, map(not_, second)))
        first = dict(zip(rest, _constant_sources(g, _inputs_at(g, rest, 0))))
        weights.update((i, 1 if hit else 0 if first[i] else None) for i, hit in zip(gemms, second))
        weighted = g.indices_of(WEIGHTED_OPS)
        with_weight = list(compress(weighted, map(is_not, map(weights.get, weighted), repeat(None))))
        node_inputs = g.node_inputs
        activations = [_input(node_inputs[i], 1 - weights[i]) for i in with_weight]
        weight_tensors = [_input(node_inputs[i], weights[i]) for i in with_weight]
        found = g._weighted = _Weighted(weights, with_weight, activations, weight_tensors)
    return found


_ONE_OR_NONE = (None, 1)


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
