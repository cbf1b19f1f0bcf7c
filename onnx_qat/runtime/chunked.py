"""Running a large model as consecutive pieces, each its own onnxruntime session.

onnxruntime's session creation grows faster than the graph: on the benchmark's residual graphs
(``tools/bench/models.residual_net``) a session of 10,000 float nodes took 0.9 s and one of 50,000
about 17 times as long, and a Q/DQ model of 25,000 nodes 12-15 times as long as one of 5,000 (graph
optimisations off; with them on, onnxruntime's QDQ transformers took 566 s on the 25,000-node model).
`ChunkedSession` cuts the node list (which ONNX keeps in topological order) into runs of
about `CHUNK_NODES` nodes and runs them one after the other: each piece's inputs are the
tensors it reads from before it (graph inputs, earlier pieces' outputs, names its If/Loop/Scan
bodies read from the outer scope), its outputs the tensors later pieces or the caller read. The
cost of the sessions then grows linearly with the graph, and a tensor lives only until its last
reader has run. The arithmetic is the whole model's: every node computes the same values from
the same inputs (graph optimisations off, so no fusion differs between the pieces and the whole).
"""
from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import helper

#: Nodes per piece: small enough for onnxruntime's session creation to stay fast (about 0.1 s for
#: 2,000 float nodes), large enough that the per-piece overhead of a run stays small.
CHUNK_NODES = 2000


#: How `ChunkedSession` marks each axis of a tensor: the batch axis (declared symbolic, ``N``), a
#: fixed size, or unknown (onnxruntime's shape inference lost it: symbolic when it equals the batch).
BATCH, FIXED, UNKNOWN = "N", "fixed", "?"


class _Piece:
    __slots__ = ("nodes", "inputs", "outputs", "initializers", "sessions", "marks", "fed", "bound", "shaped",
                 "bindings")

    def __init__(self, nodes, inputs, outputs, initializers):
        self.nodes, self.inputs, self.outputs, self.initializers = nodes, inputs, outputs, initializers
        self.sessions: Dict[tuple, object] = {}
        self.marks: Dict[tuple, Dict[str, tuple]] = {}  # session key -> {output: its axes' marks}
        self.fed, self.bound = inputs, ()  # inputs fed at each run; inputs held by `ChunkedSession.bind`
        self.shaped = inputs  # the inputs whose shapes may tell sessions apart (held scalars never do)
        self.bindings: Dict[tuple, list] = {}  # session key -> [IOBinding, the `bind` call it holds]


class ChunkedSession:
    """Runs ``model`` piece by piece (see the module docstring); answers ``run(outputs, feed)`` like an
    onnxruntime session.

    Args:
        model: a ``ModelProto`` (not changed; the pieces hold copies of its nodes and initializers).
        outputs: the tensors `run` may be asked for (default: the graph outputs).
        chunk_nodes: nodes per piece.
        threads: intra-op threads of each piece's session (None: onnxruntime's default).
        batch_axis: ``{graph input: its batch axis}`` for inputs whose batch axis is not the first
            (as ``load_data``'s ``batch_axis`` and ``--batch-axis`` declare it); every other graph
            input has it first.

    `bind` holds inputs that stay the same over many runs (the scales of a table judged on many
    samples): each piece's session gets them once, through onnxruntime's IOBinding, instead of
    with every run (onnxruntime converts each fed array at each run: a piece reading 500 scalars ran
    2-3 times slower fed than bound).

    A piece's session is built when values first reach it, its inputs declared with their dtypes
    and shapes, and the batch axis alone as the symbolic dimension ``N``: onnxruntime builds a
    session of known shapes several times faster than one whose input shapes are unknown, and one
    session then serves batches of every size (a smaller last batch). The batch axis of a graph input
    is the declared one (``batch_axis``; none where the model fixes that dimension, e.g. a batch of
    1); that of a tensor an earlier piece made is where onnxruntime's shape inference, in that
    piece's session, carried ``N`` (an axis whose size it could not infer counts as the batch axis
    when it equals the batch size). A fixed dimension that happens to equal the batch size stays
    fixed: values of another fixed shape get a session of their own.
    """

    def __init__(self, model: onnx.ModelProto, outputs: Optional[Sequence[str]] = None, *,
                 chunk_nodes: int = CHUNK_NODES, threads: Optional[int] = None,
                 batch_axis: Optional[Mapping[str, int]] = None):
        from ..graph.edit import subgraph_names

        self.threads = threads
        self.batch_axis = dict(batch_axis or {})
        # each graph input's declared dimensions (an int where the model fixes it, else None)
        self._declared = {i.name: tuple(d.dim_value if d.HasField("dim_value") else None
                                        for d in i.type.tensor_type.shape.dim)
                          if i.type.tensor_type.HasField("shape") else None for i in model.graph.input}
        #: seconds spent building the pieces' sessions so far (they are built on the first run)
        self.build_seconds = 0.0
        graph = model.graph
        self.model_info = (list(model.opset_import), model.ir_version, list(model.functions))
        self.outputs = tuple(o.name for o in graph.output) if outputs is None else tuple(outputs)
        initializers = {t.name: t for t in graph.initializer}
        nodes = list(graph.node)
        produced: Dict[str, int] = {}
        bounds = list(range(0, len(nodes), max(1, int(chunk_nodes)))) + [len(nodes)]
        reads: List[List[str]] = []
        for k in range(len(bounds) - 1):
            part = nodes[bounds[k]:bounds[k + 1]]
            names: Dict[str, None] = {}
            for node in part:
                names.update(dict.fromkeys(t for t in node.input if t))
            holders = [n for n in part if n.attribute and any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)]
            if holders:  # outer-scope names the bodies read: known before the piece
                known = set(produced) | set(initializers) | {i.name for i in graph.input}
                names.update(dict.fromkeys(sorted(subgraph_names(holders) & known)))
            reads.append(list(names))
            for node in part:
                for t in node.output:
                    if t:
                        produced[t] = k
        last: Dict[str, int] = {}
        for k, names in enumerate(reads):
            for t in names:
                last[t] = k
        count = len(reads)
        for t in self.outputs:
            last[t] = count
        self.pieces: List[_Piece] = []
        for k, names in enumerate(reads):
            part = nodes[bounds[k]:bounds[k + 1]]
            inside = {t for node in part for t in node.output if t}
            inputs = [t for t in names if t not in inside and t not in initializers]
            inits = [initializers[t] for t in names if t in initializers and t not in inside]
            outputs_k = [t for t in dict.fromkeys(t for node in part for t in node.output if t)
                         if last.get(t, -1) > k]
            self.pieces.append(_Piece(part, inputs, outputs_k, inits))
        #: after piece k, the tensors of earlier pieces no later piece (nor the caller) reads (the
        #: others never enter the values a run keeps: a piece's own tensors, and the feed's)
        self.dead: List[List[str]] = [[] for _ in range(count)]
        for t, k in last.items():
            if k < count and t in produced and produced[t] < k:
                self.dead[k].append(t)
        self._constants: Dict[str, np.ndarray] = {}
        self._constant_marks: Dict[str, tuple] = {}  # `FIXED` on every axis of each held input
        self._binds = 0  # `bind` calls so far

    def _input_marks(self, feed: Mapping[str, np.ndarray]) -> Dict[str, tuple]:
        """The marks (`BATCH`, `FIXED`) of every axis of the graph inputs in ``feed`` and of the inputs
        held by `bind` (all fixed): each fed input's declared batch axis (`batch_axis`, else the
        first) is `BATCH` unless the model fixes that dimension."""
        marks = dict(self._constant_marks)
        for t, value in feed.items():
            axis, declared = self.batch_axis.get(t, 0), self._declared.get(t)
            fixed = declared is not None and axis < len(declared) and declared[axis] is not None
            marks[t] = tuple(BATCH if k == axis and not fixed else FIXED for k in range(np.ndim(value)))
        return marks

    @staticmethod
    def _dims(shape, marks: Optional[tuple], batch: Optional[int]) -> tuple:
        """``shape`` with ``N`` for the size ``batch`` on its batch axis (by ``marks``, its axes'
        marks) and on axes of unknown mark (all of them when ``marks`` does not fit ``shape``)."""
        if marks is None or len(marks) != len(shape):
            marks = (UNKNOWN,) * len(shape)
        return tuple("N" if d == batch and m != FIXED else d for d, m in zip(shape, marks))

    def _session(self, piece: _Piece, live: Mapping[str, np.ndarray], marks: Mapping[str, tuple],
                 batch: Optional[int]):
        """``(session, {output: its axes' marks})`` of ``piece`` for the values ``live``."""
        from .sessions import make_session

        # scalars (e.g. scales fed as inputs) keep the dtype they first came with: only the shapes of
        # the others tell sessions apart
        key = tuple(self._dims(np.shape(live[t]), marks.get(t), batch)
                    for t in piece.shaped if np.ndim(live[t]))
        session = piece.sessions.get(key)
        if session is not None:
            return session, piece.marks[key]
        opsets, ir_version, functions = self.model_info
        inputs = [helper.make_tensor_value_info(
            t, helper.np_dtype_to_tensor_dtype(np.asarray(live[t]).dtype),
            list(self._dims(np.shape(live[t]), marks.get(t), batch))) for t in piece.inputs]
        graph = helper.make_graph(piece.nodes, "piece", inputs,
                                  [onnx.ValueInfoProto(name=t) for t in piece.outputs], piece.initializers)
        model = helper.make_model(graph, opset_imports=opsets, functions=functions)
        model.ir_version = ir_version
        # no spinning: the pieces run one after the other, with Python work in between, so a piece's
        # threads waiting for work would only take the cores the next piece needs
        started = time.perf_counter()
        session = piece.sessions[key] = make_session(model, optimize=False, copy=False, spin=False,
                                                     threads=self.threads)
        self.build_seconds += time.perf_counter() - started
        # where onnxruntime's shape inference carried the batch axis into the piece's outputs
        made = piece.marks[key] = {
            o.name: tuple(BATCH if d == "N" else FIXED if isinstance(d, int) else UNKNOWN for d in o.shape)
            for o in session.get_outputs() if isinstance(o.shape, list)}
        return session, made

    def bind(self, constants: Mapping[str, np.ndarray]) -> None:
        """Hold ``constants`` (graph input name -> array, e.g. a table's scales) as inputs of every
        following `run`, in place of those held before; a run's feed need not repeat them. Each
        piece's sessions receive them once (onnxruntime's IOBinding), not with every run."""
        # np.require keeps a scalar a scalar (np.ascontiguousarray makes it an array of one value, whose
        # shape every run would then compare to tell the pieces' sessions apart)
        self._constants = {name: np.require(value, requirements="C") for name, value in constants.items()}
        self._constant_marks = {t: (FIXED,) * np.ndim(v) for t, v in self._constants.items()}
        self._binds += 1
        for piece in self.pieces:
            piece.bound = tuple(t for t in piece.inputs if t in self._constants)
            held = set(piece.bound)
            piece.fed = [t for t in piece.inputs if t not in held]
            piece.shaped = piece.fed + [t for t in piece.bound if np.ndim(self._constants[t])]

    def run(self, outputs: Optional[Sequence[str]], feed: Mapping[str, np.ndarray], run_options=None) -> list:
        """The values of ``outputs`` (None: those given at construction) on ``feed`` (and the inputs
        held by `bind`)."""
        wanted = self.outputs if outputs is None else tuple(outputs)
        live = {**self._constants, **feed} if self._constants else dict(feed)
        marks = self._input_marks(feed)
        batch = next((np.shape(value)[marks[t].index(BATCH)] for t, value in feed.items()
                      if BATCH in marks[t]), None)
        for piece, dead in zip(self.pieces, self.dead):
            if piece.outputs:
                session, made = self._session(piece, live, marks, batch)
                marks.update(made)
                if piece.bound:
                    values = self._run_bound(piece, session, live, run_options)
                else:
                    values = session.run(piece.outputs, {t: live[t] for t in piece.inputs}, run_options)
                live.update(zip(piece.outputs, values))
            for t in dead:
                live.pop(t, None)
        return [live[t] for t in wanted]

    def _run_bound(self, piece: _Piece, session, live: Mapping[str, np.ndarray], run_options) -> list:
        """One run of ``piece``'s ``session`` through its IOBinding: the held inputs bound once per
        `bind` call, the others at each run."""
        found = piece.bindings.get(id(session))
        if found is None:
            found = piece.bindings[id(session)] = [session.io_binding(), 0]
        binding = found[0]
        if found[1] != self._binds:  # the constants changed (or were never bound here)
            for t in piece.bound:
                binding.bind_cpu_input(t, self._constants[t])
            found[1] = self._binds
        for t in piece.fed:
            binding.bind_cpu_input(t, np.ascontiguousarray(live[t]))
        for t in piece.outputs:  # unallocated each run: a binding keeps the last run's outputs, and
            binding.bind_output(t)  # onnxruntime refuses them as buffers for a batch of another size
        session.run_with_iobinding(binding, run_options)
        return binding.copy_outputs_to_cpu()


__all__ = ["ChunkedSession", "CHUNK_NODES", "BATCH", "FIXED", "UNKNOWN"]
