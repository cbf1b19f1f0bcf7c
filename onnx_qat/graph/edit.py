"""One editing session over a model's main graph, done on its protobuf.

The rewrite of a model is a set of local edits: new QuantizeLinear/DequantizeLinear nodes,
consumers pointed at their outputs, float weights replaced by integer initializers, and (for
the ``ort-cpu`` form) a few nodes folded away. `GraphEdit` makes these edits on the
``onnx.ModelProto`` the caller owns, with lookups built once, and `GraphEdit.commit`
writes the result as a new ModelProto in one pass:

* every new node goes just before the first node that reads its output (the order of the
  original nodes is kept, so a topologically sorted graph stays sorted and the output is
  deterministic);
* nodes removed by the edit are left out, and so are the initializers and the Constant /
  Identity nodes whose value an edit replaced once nothing reads them any more (a tensor read
  inside a subgraph or listed as a graph output or input counts as read). Initializers the input
  model had without readers are kept as they were;
* graph inputs, outputs, value_info (less the entries of tensors no node makes any more) and
  every model-level field are copied unchanged.

Working on the protobuf directly costs a fraction of importing the graph into an object model
and exporting it again (measured on a 50,000-node model: 3.3 s against 11.3 s for
onnx-graphsurgeon import, insertion and export); see docs/changelog.md (rewrite speed).
"""
from __future__ import annotations

import itertools
from itertools import compress
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx

from ..io.models import element_size, target_ir_version, tensor_array
from .constants import CONSTANT_PASS_OPS, MAX_CONSTANT_HOPS, fold_chain
from .delta import EditEvidence, ResultNodes, structure_clean, structure_problem, tensor_forms
from .index import DEFAULT_DOMAINS
from .wire import GRAPH_INITIALIZER, GRAPH_NODE, EncodedNode, EncodedTensor, encode_tensor, framed
from .wire import tensor as tensor_bytes

_NP_TO_ONNX = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.int8): onnx.TensorProto.INT8,
               np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(np.int32): onnx.TensorProto.INT32,
               np.dtype(np.int64): onnx.TensorProto.INT64, np.dtype(np.float64): onnx.TensorProto.DOUBLE,
               np.dtype(np.float16): onnx.TensorProto.FLOAT16}
_GRAPH_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def make_tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    """A TensorProto holding ``values`` as little-endian raw bytes (types of `_NP_TO_ONNX`)."""
    values = np.asarray(values)
    dtype = values.dtype
    data_type = _NP_TO_ONNX.get(dtype)
    if data_type is None:
        return onnx.numpy_helper.from_array(values, name)
    if dtype.byteorder == ">":
        values = values.astype(dtype.newbyteorder("<"))
    return onnx.TensorProto(name=name, data_type=data_type, dims=values.shape, raw_data=values.tobytes())


def make_node(op_type: str, name: str, inputs: Sequence[str], outputs: Sequence[str],
              axis: Optional[int] = None) -> onnx.NodeProto:
    """A default-domain NodeProto, with an ``axis`` attribute when one is given."""
    node = onnx.NodeProto(op_type=op_type, name=name, input=list(inputs), output=list(outputs))
    if axis is not None:
        node.attribute.append(onnx.AttributeProto(name="axis", type=onnx.AttributeProto.INT, i=int(axis)))
    return node


def onnx_type(dtype) -> int:
    """The ONNX element type of a NumPy type of `_NP_TO_ONNX`; an ``int`` (already an element type) as is."""
    return dtype if isinstance(dtype, int) else _NP_TO_ONNX[np.dtype(dtype)]


class GraphEdit:
    """Edits of ``model``'s main graph, applied by `commit`.

    Args:
        model: an ``onnx.ModelProto`` the caller owns, with unique node names (as
            `onnx_qat.graph.index.assign_node_names` gives). Its nodes are changed
            in place by the edits (inputs rewired, attributes set); `commit` builds the
            result as a new ModelProto, so the caller can free ``model`` afterwards.
        names: for the edit of a subgraph (wrapped in a ModelProto): a set of every name used in
            the whole model, shared by the edits of all its graphs; new names are added to it, so
            no two graphs create the same name.
        outer_constants: for the edit of a subgraph: name -> TensorProto of the constants of the
            enclosing graphs (initializers and Constant values), read by `constant`.
        encoded: new nodes and initializers may be held as wire bytes (`onnx_qat.graph.wire`:
            `EncodedNode`, `EncodedTensor`), and `commit` then builds the result's graph by parsing
            it once from bytes. The inserter makes its nodes that way when this is set, and
            `add_initializers` / `add_scalar_initializers` their initializers. Only for an edit
            whose new nodes are not changed after they are queued (the ``tensorrt`` form; the
            ``ort-cpu`` form's folds edit them). The result is the same model either way.
        index: a `onnx_qat.graph.index.GraphIndex` of ``model``'s main graph as it is now (no node or
            initializer changed since it was built, node names unique as `assign_node_names` leaves them):
            the edit's lookups are then built from its tables instead of reading every node's fields
            from the protobuf once more.
        checked: with ``encoded`` and ``index``: the `onnx_qat.io.models.CheckedForm` under which
            ``onnx.checker`` passed ``model`` in full before any change (as loaded). `commit` then leaves
            `evidence` (`onnx_qat.graph.delta.EditEvidence`) to validate the result with, unless a new
            node came without its form (`insert`), a new initializer's raw bytes do not fit its shape,
            or the graph holds subgraphs.
    """

    def __init__(self, model: onnx.ModelProto, *, names: Optional[Set[str]] = None,
                 outer_constants: Optional[Dict[str, onnx.TensorProto]] = None, encoded: bool = False,
                 index=None, checked=None):
        self.model = model
        self.encoded = encoded
        self.outer_constants = outer_constants or {}
        graph = model.graph
        self._index = index
        if index is not None:  # the index read every field once already
            infos = index.nodes
            self.nodes: List[onnx.NodeProto] = [n.proto for n in infos]
            self.by_name: Dict[str, onnx.NodeProto] = {n.name: n.proto for n in infos}
            self.initializers: Dict[str, onnx.TensorProto] = dict(index.initializers)
            self.producer: Dict[str, onnx.NodeProto] = {out: n.proto for out, n in index.producer.items()}
        else:
            self.nodes = list(graph.node)
            self.by_name = {n.name: n for n in self.nodes}
            self.initializers = {t.name: t for t in graph.initializer}
            self.producer = {}
            for node in self.nodes:
                for out in node.output:
                    if out:
                        self.producer[out] = node
        self.position: Dict[int, int] = {id(n): i for i, n in enumerate(self.nodes)}
        self.graph_outputs = frozenset(o.name for o in graph.output)
        self._used: Optional[Set[str]] = None
        self._subgraph_names: Optional[Set[str]] = None
        self._before: Dict[int, List[onnx.NodeProto]] = {}
        self._tail: List[onnx.NodeProto] = []
        self._removed: Set[int] = set()
        self._removed_new = False  # whether `remove` was given a queued new node
        self._new_initializers: Dict[str, onnx.TensorProto] = {}
        self._maybe_unread: List[str] = []
        self._maybe_dead: List[onnx.NodeProto] = []
        #: The result's evidence (`commit`); the new nodes' forms while it can still be given.
        self.evidence: Optional[EditEvidence] = None
        self._checked = checked if encoded and index is not None and not index.subgraph_nodes else None
        self._forms: Optional[Dict[tuple, object]] = {} if self._checked is not None else None
        #: While `_forms` is kept: each new node's form (by ``id``) and each new initializer made as bytes,
        #: ``name -> (element type, raw bytes)`` and, unless a scalar, ``name -> dims``, for the `ResultNodes`
        #: of the evidence.
        self._node_forms: Dict[int, tuple] = {}
        self._stored: Dict[str, Tuple[int, bytes]] = {}
        self._dims: Dict[str, Tuple[int, ...]] = {}
        self._released = False  # see release_lookups
        if names is not None:
            self._used = None
            names.update(self._names())
            self._used = names

    def release_lookups(self) -> None:
        """Drop the tables the edit reads while it inserts (the nodes by name, by output and by position, the
        names taken, the `GraphIndex` it was given) once only `commit` follows: `commit` reads none of them,
        and the memory they held is then free for the result it makes (on the 50,000-node benchmark graph,
        with the index released as well, `GraphIndex.release`: 70 MB less at the rewrite's peak and a tenth
        fewer page faults). Reading or inserting through the edit after this raises RuntimeError (a name
        would be taken twice); `commit` gives the same model as without."""
        self._inner_names()  # what the commit's read counts ask, kept
        self.by_name, self.producer, self.position = {}, {}, {}
        self._used, self._index, self._released = None, None, True

    # -- names ---------------------------------------------------------------------
    def _names(self) -> Set[str]:
        if self._released:
            raise RuntimeError("GraphEdit: its lookups were released (release_lookups): only commit may "
                               "follow")
        if self._used is None:
            graph = self.model.graph
            used = set(self.by_name)
            used.update(self.initializers)
            used.update([i.name for i in graph.input])
            used.update(o.name for o in graph.output)
            if self._index is not None:  # every node's inputs and outputs, joined in C
                infos = self._index.nodes
                used.update(itertools.chain.from_iterable([info.inputs for info in infos]))
                used.update(itertools.chain.from_iterable([info.outputs for info in infos]))
            else:
                for node in self.nodes:
                    used.update(node.input)
                    used.update(node.output)
            used.update(self._inner_names())
            self._used = used
        return self._used

    def _inner_names(self) -> Set[str]:
        """`subgraph_names` of the original nodes, walked once (edits never touch subgraphs)."""
        if self._subgraph_names is None:
            if self._index is not None:  # the nodes holding graphs, as the index knows them
                holders = [self.by_name[n] for n in self._index.subgraph_nodes]
                self._subgraph_names = subgraph_names(holders) if holders else set()
            else:
                self._subgraph_names = subgraph_names(self.nodes)
        return self._subgraph_names

    def fresh(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``... : a tensor/node name used nowhere in the model yet."""
        return fresh_name(base, self._used if self._used is not None else self._names())

    def fresh_names(self, bases: Sequence[str]) -> List[str]:
        """`fresh` of each of ``bases`` in turn (the same names, in the same order): one set operation
        when none of them is taken and no two are equal (a rewrite's usual case), one call per base
        otherwise."""
        used = self._used if self._used is not None else self._names()
        if used.isdisjoint(bases):
            size = len(used)
            used.update(bases)
            if len(used) - size == len(bases):  # no base twice
                return list(bases)
            used.difference_update(bases)  # none of them was used before: as it was
        return [fresh_name(base, used) for base in bases]

    # -- reading -------------------------------------------------------------------
    def node(self, name: str) -> onnx.NodeProto:
        """The node named ``name``; ValueError when the graph has none."""
        found = self.by_name.get(name)
        if found is None:
            if self._released:
                self._names()  # raises
            raise ValueError(f"placement names node {name!r}, which the graph does not have")
        return found

    def constant(self, tensor: str) -> Tuple[np.ndarray, onnx.TensorProto, List[onnx.NodeProto]]:
        """``(value, the source TensorProto, the nodes producing it)`` of a constant tensor (an
        initializer or a ``Constant`` output, possibly through the ops of
        `CONSTANT_PASS_OPS`, nearest ``tensor`` first); ValueError
        when ``tensor`` is not constant. Through Identity nodes only, the value is read in place (no
        copy of raw data); through a Transpose, Reshape... it is folded (a new array)."""
        index = self._index
        if index is not None and tensor not in self._new_initializers:  # an original initializer: its array
            proto = self.initializers.get(tensor)
            if proto is not None and index.initializers.get(tensor) is proto:
                return index.initializer_array(tensor), proto, []
        chain: List[onnx.NodeProto] = []
        name, source = tensor, None
        for _ in range(MAX_CONSTANT_HOPS):
            proto = self.initializer(name)
            if proto is not None:
                source = proto
                break
            producer = self.producer.get(name)
            if producer is None:
                break
            chain.append(producer)
            if producer.op_type == "Constant" and producer.domain in DEFAULT_DOMAINS:
                source = next((a.t for a in producer.attribute if a.name == "value"), None)
                break
            if producer.op_type not in CONSTANT_PASS_OPS or producer.domain not in DEFAULT_DOMAINS \
                    or not producer.input:
                break
            name = producer.input[0]
        if source is None and name and name not in self.producer:  # an outer-scope constant
            source = self.outer_constants.get(name)
        if source is None:
            raise ValueError(f"weight {tensor!r} is not a constant")
        passing = [n for n in chain if n.op_type != "Constant"]
        if all(n.op_type == "Identity" for n in passing):
            if index is not None and index.initializers.get(name) is source:  # an original initializer
                return index.initializer_array(name), source, chain
            return tensor_array(source), source, chain
        value = fold_chain(passing, np.asarray(tensor_array(source)), lambda t: self.constant(t)[0])
        return value, source, chain

    def initializer(self, name: str) -> Optional[onnx.TensorProto]:
        """The initializer (original or added by this edit) named ``name``, or None (an added one held as
        bytes is parsed: a new TensorProto, whose changes the edit does not see)."""
        found = self._new_initializers.get(name)
        if found is None:
            return self.initializers.get(name)
        return found.proto() if type(found) is EncodedTensor else found

    def readers(self) -> Dict[str, List[Tuple[onnx.NodeProto, int]]]:
        """Tensor -> ``(node, input index)`` of every live node reading it, as the graph is now."""
        found: Dict[str, List[Tuple[onnx.NodeProto, int]]] = {}
        for node in self.live_nodes():
            for i, tensor in enumerate(node.input):
                if tensor:
                    found.setdefault(tensor, []).append((node, i))
        return found

    def live_nodes(self) -> List[onnx.NodeProto]:
        """The nodes of the result, in order (queued new nodes before their first reader), as a new list
        (less the nodes `remove` left out, original or queued)."""
        before, removed = self._before, self._removed
        live: List[onnx.NodeProto] = []
        for node in self.nodes:
            key = id(node)
            if key in before:
                live.extend(before[key])
            if key not in removed:
                live.append(node)
        live.extend(self._tail)
        if self._removed_new:  # a queued node removed too: left out (one pass)
            live = [node for node in live if id(node) not in removed]
        return live

    # -- editing -------------------------------------------------------------------
    def add_initializer(self, base: str, values) -> str:
        """A new initializer with a fresh name from ``base``; returns its name."""
        name = self.fresh(base)
        self._new_initializers[name] = make_tensor(name, values)
        return name

    def add_raw_initializer(self, base: str, dtype: np.dtype, raw: bytes, dims: Sequence[int] = ()) -> str:
        """A new initializer of NumPy type ``dtype`` (one of `_NP_TO_ONNX`, or an ONNX element
        type number such as ``TensorProto.FLOAT8E4M3FN``, whose raw layout the caller made) and shape ``dims``
        holding ``raw``, its little-endian bytes, with a fresh name from ``base``; returns its name.
        For callers that made the bytes already (of many scalars at once, or shared by many
        initializers): `add_initializer` costs a NumPy array per call."""
        name = self.fresh(base)
        data_type = onnx_type(dtype)
        if self.encoded and len(raw) < PARSE_CHUNK:
            self._measure(data_type, raw, dims)
            self._new_initializers[name] = encode_tensor(name, data_type, raw, dims)
            if len(raw) <= STORED_MOST:
                self._stored[name] = (data_type, raw)
            if dims:
                self._dims[name] = tuple(map(int, dims))
            return name
        if dims:
            tensor = onnx.TensorProto(name=name, data_type=data_type, dims=dims, raw_data=raw)
        else:  # a scalar (most of them): an empty dims argument alone costs protobuf about half the call
            tensor = onnx.TensorProto(name=name, data_type=data_type, raw_data=raw)
        self._new_initializers[name] = tensor
        return name

    def add_initializers(self, names: Sequence[str], values: Sequence) -> None:
        """New initializers named ``names`` (from `fresh_names`: not made fresh here), each value either
        a ``(type, raw bytes, shape)`` tuple as `add_raw_initializer` takes or an array (stored as
        `add_initializer` stores it)."""
        new, make = self._new_initializers, onnx.TensorProto
        for name, value in zip(names, values):
            if isinstance(value, tuple):
                dtype, raw, dims = value
                if self.encoded and len(raw) < PARSE_CHUNK:
                    data_type = onnx_type(dtype)
                    if self._forms is not None:
                        self._measure(data_type, raw, dims)
                        if len(raw) <= STORED_MOST:
                            self._stored[name] = (data_type, raw)
                        if dims:
                            self._dims[name] = tuple(map(int, dims))
                    new[name] = encode_tensor(name, data_type, raw, dims)
                elif dims:
                    new[name] = make(name=name, data_type=onnx_type(dtype), dims=dims, raw_data=raw)
                else:
                    new[name] = make(name=name, data_type=onnx_type(dtype), raw_data=raw)
            else:
                new[name] = make_tensor(name, value)

    def add_scalar_initializers(self, names: Sequence[str], data_types: Sequence[int],
                                raws: Sequence[bytes]) -> None:
        """New scalar initializers, ``names[i]`` of ONNX element type ``data_types[i]`` holding ``raws[i]``
        (its little-endian bytes); the names come from `fresh_names` (they are not made fresh here)."""
        new = self._new_initializers
        if self.encoded:  # wire.tensor of a scalar, inlined: a rewrite makes two per activation pair
            if self._forms is not None and any(len(raw) != element_size(data_type)
                                               for data_type, raw in zip(data_types, raws)):
                self._forms = None  # a scalar of the wrong size: the result goes to onnx.checker whole
            stored = self._stored if self._forms is not None else None  # no dims: scalars
            new_tuple = tuple.__new__
            for name, data_type, raw in zip(names, data_types, raws):
                if stored is not None:
                    stored[name] = (data_type, raw)
                data = name.encode()
                if len(data) < 128 and len(raw) < 128 and 0 <= data_type < 128:
                    encoded = b"\x10%c\x42%c%s\x4a%c%s" % (data_type, len(data), data, len(raw), raw)
                else:
                    encoded = tensor_bytes(name, data_type, raw)
                new[name] = new_tuple(EncodedTensor, (name, data_type, encoded))
            return
        make = onnx.TensorProto
        for name, data_type, raw in zip(names, data_types, raws):
            new[name] = make(name=name, data_type=data_type, raw_data=raw)

    def add_encoded_initializers(self, tensors: Dict[str, EncodedTensor],
                                 raws: Optional[Sequence[bytes]] = None,
                                 dims: Optional[Dict[str, Tuple[int, ...]]] = None) -> None:
        """New initializers already held as wire bytes (``name -> EncodedTensor``, in the order to write
        them; names from `fresh_names`), made by a caller that formats many of a few fixed forms at once
        (the inserter's per-form templates) and has measured their raw lengths (`measure`).

        ``raws``: the raw bytes of each of ``tensors``, in the same order, and ``dims``: ``name -> dims``
        (a tuple) of each of them that is not a scalar, as the caller formatted them: for an edit with
        ``checked``, the evidence's `ResultNodes` then holds their facts (element type, raw bytes up to
        `STORED_MOST`, dims) as for the initializers `add_initializers` makes, and the check and the save
        of the result do not read them back. Without ``raws``, they are read back from the result."""
        self._new_initializers.update(tensors)
        if self._forms is None or raws is None:
            return
        facts = zip(tensors, zip([t.data_type for t in tensors.values()], raws))
        if raws and max(map(len, raws)) > STORED_MOST:  # a weight's bytes: read back where needed
            facts = compress(facts, [len(raw) <= STORED_MOST for raw in raws])
        self._stored.update(facts)
        if dims:
            self._dims.update(dims)

    def measure(self, data_type: int, raw_length: int, dims: Sequence[int] = ()) -> None:
        """For an edit with ``checked``: a new initializer of element type ``data_type`` and shape ``dims``
        made as bytes holds ``raw_length`` bytes of raw data; unless that is what its dims and type give
        (as ``onnx.checker`` requires), the result is left to ``onnx.checker`` (no `evidence`). A caller
        that makes many initializers as slices of one buffer measures one slice and the buffer."""
        if self._forms is not None:
            count = 1
            for d in dims:
                count *= int(d)
            if raw_length != count * element_size(data_type):
                self._forms = None

    def replace_initializer(self, name: str, values) -> None:
        """Give the initializer ``name`` new values (and type/shape)."""
        if name not in self._new_initializers and name not in self.initializers:
            raise ValueError(f"no initializer {name!r}")
        self._new_initializers[name] = make_tensor(name, values)
        self.initializers.pop(name, None)
        self._stored.pop(name, None)
        self._dims.pop(name, None)

    def _measure(self, data_type: int, raw: bytes, dims) -> None:
        """A new initializer made as bytes: its raw length must be what its dims and element type give
        (`measure`)."""
        if self._forms is not None:
            self.measure(data_type, len(raw), dims)

    def insert(self, nodes: Sequence[onnx.NodeProto], readers: Sequence[onnx.NodeProto],
               outputs: Optional[Sequence[str]] = None, forms: Optional[Sequence[tuple]] = None) -> None:
        """Queue new ``nodes`` just before the first of ``readers`` (at the end without readers).
        ``outputs``: the one output of each of ``nodes``, when the caller has them (spares reading
        them back from the protobuf). ``forms``: for an edit with ``checked``, the form of each of
        ``nodes``: a key that only nodes equal but for their names share (op type, domain, input and
        output counts, attribute bytes), one node of each form being checked by ``onnx.checker``
        (`onnx_qat.graph.delta`); without it the result is checked whole."""
        if self._forms is not None:
            if forms is None:
                self._forms = None
            else:
                node_forms = self._node_forms
                for node, form in zip(nodes, forms):
                    node_forms[id(node)] = form
                    if form not in self._forms:
                        self._forms[form] = node
        if outputs is None:
            for node in nodes:
                for out in node.output:
                    self.producer[out] = node
        else:
            for node, out in zip(nodes, outputs):
                self.producer[out] = node
        if not readers:
            self._tail.extend(nodes)
            return
        first = readers[0] if len(readers) == 1 else min(readers, key=lambda n: self.position[id(n)])
        self._before.setdefault(id(first), []).extend(nodes)

    def insert_many(self, items: Iterable[tuple], forms: Optional[Dict[tuple, object]] = None) -> None:
        """`insert` of each ``(nodes, readers, outputs)`` of ``items`` in turn (as `insert` takes them,
        ``readers`` not empty): the same queues, in one call for a batch of new nodes. ``forms``: for an edit
        with ``checked``, each form of the new nodes (`insert`) with one node of that form, in the order
        first made; None leaves the result to ``onnx.checker`` whole, as `insert` without forms does."""
        items = list(items)
        news = [item[0] for item in items]
        if self._forms is not None:
            if forms is None:
                self._forms = None
            else:
                for form, node in forms.items():
                    self._forms.setdefault(form, node)
                self._note_forms(news, forms)
        self.producer.update(zip(itertools.chain.from_iterable([item[2] for item in items]),
                                 itertools.chain.from_iterable(news)))
        position, before = self.position, self._before
        keys = [id(readers[0]) if len(readers) == 1 else id(min(readers, key=lambda n: position[id(n)]))
                for _, readers, _ in items]
        if before.keys().isdisjoint(keys) and len(set(keys)) == len(keys):  # one batch per reader, none yet
            before.update(zip(keys, map(list, news)))
            return
        for key, nodes in zip(keys, news):
            found = before.get(key)
            if found is None:
                before[key] = list(nodes)
            else:
                found.extend(nodes)

    def _note_forms(self, news: Sequence[Sequence], forms: Dict[tuple, object]) -> None:
        """Each node of ``news`` (`insert_many`'s batches) with its form, for the evidence's `ResultNodes`,
        where ``forms`` (every form of the batch, with one node of each) tells it by op type alone: an op type
        of one form in the batch is that form for all its nodes there. A node of an op type with several
        forms is left without (the check then reads its domain and attributes from the result)."""
        by_op: Dict[str, list] = {}
        for form, node in forms.items():
            by_op.setdefault(node.op_type, []).append(form)
        one = {op: found[0] for op, found in by_op.items() if len(found) == 1}
        node_forms = self._node_forms
        for nodes in news:
            for node in nodes:
                form = one.get(node.op_type)
                if form is not None:
                    node_forms[id(node)] = form

    def remove(self, node: onnx.NodeProto) -> None:
        """Leave ``node`` out of the result (an original node or a queued new one, `EncodedNode` too)."""
        self._removed.add(id(node))
        if id(node) not in self.position:
            self._removed_new = True
        for out in node.output:
            if self.producer.get(out) is node:
                del self.producer[out]

    def release_if_unread(self, initializers: Iterable[str] = (),
                          nodes: Iterable[onnx.NodeProto] = ()) -> None:
        """At `commit`, drop these initializers and Constant/Identity nodes if nothing reads
        them then (nodes are checked in the order given: list a chain from its reader's end)."""
        self._maybe_unread.extend(initializers)
        self._maybe_dead.extend(nodes)

    # -- result --------------------------------------------------------------------
    def commit(self) -> onnx.ModelProto:
        """The edited model as a new ModelProto (see the module docstring)."""
        live = self.live_nodes()
        columns = self._columns(live) if self._forms is not None else None
        reads = self._read_counts(live, columns)
        dead = set()
        for node in self._maybe_dead:
            if id(node) in self._removed or any(reads.get(o, 0) for o in node.output):
                continue
            self._removed.add(id(node))
            dead.add(id(node))
            for tensor in node.input:
                if tensor in reads:
                    reads[tensor] -= 1
        if dead:
            keep = [id(node) not in dead for node in live]
            live = list(compress(live, keep))
            if columns is not None:
                columns = tuple(list(compress(column, keep)) for column in columns)
        drop = {name for name in self._maybe_unread if not reads.get(name, 0)}
        source = self.model
        out = onnx.ModelProto()
        for descriptor, value in source.ListFields():
            if descriptor.name != "graph":
                _assign(out, descriptor, value)
        graph = out.graph
        for descriptor, value in source.graph.ListFields():
            if descriptor.name not in ("node", "initializer"):
                _assign(graph, descriptor, value)
        if columns is not None:  # a model onnx.checker passed: initializer names unique, in graph order
            kept_names = [name for name in self.initializers if name not in drop]
            kept = [self.initializers[name] for name in kept_names]
        else:
            kept_names = None
            kept = [t for t in source.graph.initializer if t.name not in drop and t.name in self.initializers]
        added = [t for name, t in self._new_initializers.items() if name not in drop]
        data_types = {t.data_type for t in kept} | {t.data_type for t in added}
        if self._forms is not None:
            self.evidence = self._evidence(live, columns, kept_names, added, out)
        if self.encoded:
            _parse_into(graph, live, kept, added)
        else:
            graph.node.extend(live)
            graph.initializer.extend(kept)
            graph.initializer.extend(added)
        if self._removed and graph.value_info:  # no value_info for tensors no node makes any more
            made = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
            made.update(t.name for t in graph.initializer)
            kept = [vi for vi in graph.value_info if vi.name in made]
            if len(kept) < len(graph.value_info):
                del graph.value_info[:]
                graph.value_info.extend(kept)
        out.ir_version = target_ir_version(out, data_types)  # the types read here, not in one more walk
        self._index = None  # its tables describe the graph before the edit
        return out

    def _columns(self, live) -> Tuple[list, list, list, list]:
        """``(op types, inputs, outputs, forms)`` of ``live`` (`live_nodes`), one list each: a new node's
        from its fields (`EncodedNode`), an original node's read from its protobuf once."""
        encoded = EncodedNode
        ops = [node.op_type for node in live]
        inputs = [node.input if type(node) is encoded else node.input[:] for node in live]
        outputs = [node.output if type(node) is encoded else node.output[:] for node in live]
        forms = list(map(self._node_forms.get, map(id, live)))
        return ops, inputs, outputs, forms

    def _evidence(self, live, columns, kept_names, added, out) -> EditEvidence:
        """`EditEvidence` of the result ``out`` (``live`` nodes, with ``columns`` from `_columns`, the
        initializers named ``kept_names`` and ``added``, as `commit` writes them): the structural pass over
        every node's inputs and outputs as written, and the `ResultNodes` the readiness check reads."""
        graph = self.model.graph
        names = list(kept_names)
        names += [t.name for t in added]
        names += [t.values.name for t in graph.sparse_initializer]
        graph_inputs, graph_outputs = [i.name for i in graph.input], [o.name for o in graph.output]
        ops, inputs, outputs, forms = columns
        problem = None
        if not structure_clean(graph_inputs, names, inputs, outputs, graph_outputs):  # its words:
            problem = structure_problem(graph_inputs, names, live, graph_outputs)
        nodes = None
        if not graph.sparse_initializer:
            stored, dims = self._stored, self._dims
            if len(added) < len(self._new_initializers):  # some dropped: theirs left out
                stored = {t.name: stored[t.name] for t in added if t.name in stored}
                dims = {t.name: dims[t.name] for t in added if t.name in dims}
            nodes = ResultNodes(ops, inputs, outputs, forms, dict(self._forms), names, stored, dims)
        return EditEvidence(self._checked, problem, list(self._forms.values()), tensor_forms(added), out,
                            nodes)

    def _read_counts(self, live: Sequence[onnx.NodeProto], columns=None) -> Dict[str, int]:
        """How often each tensor that `release_if_unread` asks about (and the inputs of the
        nodes it lists) is read by a live node (of ``live``, `live_nodes`; ``columns``: their `_columns`,
        when made), a graph output or a subgraph."""
        wanted = set(self._maybe_unread)
        for node in self._maybe_dead:
            wanted.update(node.output)
            wanted.update(node.input)
        wanted.discard("")
        counts = dict.fromkeys(wanted, 0)
        if not wanted:
            return counts
        if columns is not None:  # the nodes that read none of them passed over in one test each
            isdisjoint = wanted.isdisjoint
            for node_inputs in columns[1]:
                if not isdisjoint(node_inputs):
                    for tensor in node_inputs:
                        if tensor in counts:
                            counts[tensor] += 1
        else:
            for node in live:
                for tensor in node.input:
                    if tensor in counts:
                        counts[tensor] += 1
        inputs = {i.name for i in self.model.graph.input}  # an initializer also listed as an input stays
        for name in wanted & (self.graph_outputs | inputs | self._inner_names()):
            counts[name] += 1  # a graph output or input, or an outer-scope name a subgraph may read
        return counts


#: Raw bytes a new initializer holds at most for the edit to keep them for the `ResultNodes` of its evidence
#: (scales and zero points; a larger tensor, a weight, is read back from the result where the check needs it,
#: so its bytes are not held twice).
STORED_MOST = 1024

#: Bytes parsed at most in one call when the result's graph is parsed from bytes (protobuf refuses a
#: message over 2 GB); an initializer with more raw bytes than this is kept as a TensorProto.
PARSE_CHUNK = 1 << 30


def _parse_into(graph, nodes, kept, added) -> None:
    """Fill ``graph`` (its fields other than nodes and initializers already set) with ``nodes`` and the
    initializers ``kept`` then ``added`` (NodeProtos / TensorProtos, or `EncodedNode` / `EncodedTensor`),
    in that order, by parsing their bytes: the same messages as extending its lists with them. A
    list whose bytes stay under `PARSE_CHUNK` is parsed in one call (the usual case); a larger one
    in parts of at most that size (a model over 2 GB, saved with external data), a message too
    large to serialize being copied as it is (`_merge_in_parts`)."""
    _merge_in_parts(graph, GRAPH_NODE, graph.node, nodes)
    _merge_in_parts(graph, GRAPH_INITIALIZER, graph.initializer, list(kept) + list(added))


def _merge_in_parts(graph, tag: bytes, target, items) -> None:
    """`_parse_into` of one repeated field of ``graph`` (``target``, field ``tag``): its items' bytes
    parsed in as few calls as keep each under `PARSE_CHUNK` bytes (one, unless the field holds more);
    an item whose bytes alone are over that, or which cannot be serialized (over 2 GB), is appended
    as a message."""
    try:  # the usual case first: every item's bytes at once, all of them under the limit together
        datas = [item.encoded if type(item) is EncodedNode or type(item) is EncodedTensor
                 else item.SerializeToString() for item in items]
    except Exception:  # an item over 2 GB: the loop below
        datas = None
    if datas is not None and sum(map(len, datas)) <= PARSE_CHUNK and \
            (not datas or max(map(len, datas)) < PARSE_CHUNK):
        if datas:
            graph.MergeFromString(framed(tag, datas))
        return
    part: List[bytes] = []
    size = 0
    for item in items:
        if type(item) is EncodedNode or type(item) is EncodedTensor:
            data = item.encoded
        else:
            try:
                data = item.SerializeToString()
            except Exception:  # over 2 GB
                data = None
        if data is None or len(data) >= PARSE_CHUNK or size + len(data) > PARSE_CHUNK:
            if part:
                graph.MergeFromString(framed(tag, part))
                part, size = [], 0
            if data is None or len(data) >= PARSE_CHUNK:
                encoded = type(item) is EncodedNode or type(item) is EncodedTensor
                target.append(item.proto() if encoded else item)
                continue
        part.append(data)
        size += len(data)
    if part:
        graph.MergeFromString(framed(tag, part))


def _assign(message, descriptor, value) -> None:
    if _repeated(descriptor):
        getattr(message, descriptor.name).extend(value)
    elif descriptor.message_type is not None:
        getattr(message, descriptor.name).CopyFrom(value)
    else:
        setattr(message, descriptor.name, value)


def _repeated(descriptor) -> bool:
    repeated = getattr(descriptor, "is_repeated", None)  # protobuf >= 5; older ones have ``label``
    return bool(repeated) if repeated is not None else descriptor.label == descriptor.LABEL_REPEATED


def subgraph_names(nodes: Iterable[onnx.NodeProto]) -> Set[str]:
    """Tensor and node names used inside the subgraphs of ``nodes`` (If/Loop/Scan bodies, nested)."""
    names: Set[str] = set()
    stack = [a for n in nodes for a in n.attribute if a.type in _GRAPH_ATTRS]
    while stack:
        attr = stack.pop()
        for graph in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            names.update(t.name for t in graph.initializer)
            names.update(i.name for i in graph.input)
            names.update(o.name for o in graph.output)
            for node in graph.node:
                names.add(node.name)
                names.update(node.input)
                names.update(node.output)
                stack.extend(a for a in node.attribute if a.type in _GRAPH_ATTRS)
    return names


def fresh_name(base: str, used: Set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... : the first not in ``used``, which it is added to."""
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


__all__ = ["GraphEdit", "fresh_name", "make_tensor", "make_node", "onnx_type", "subgraph_names"]
