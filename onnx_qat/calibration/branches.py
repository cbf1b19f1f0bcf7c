"""Observing tensors inside If branches and Loop/Scan bodies, which onnxruntime cannot return as graph
outputs.

`BranchRunner` answers ``run(names, feed)`` like an onnxruntime session. Tensors of the main
graph are fetched as extra outputs. For tensors inside the branches of an If, it first runs the
model to read the If's condition on this batch, then runs a copy of the model in which that If is
replaced by the branch it takes (`onnx_qat.graph.subgraphs.inline_branches`); there the branch's
tensors are main-graph tensors. Nested Ifs are resolved the same way, one level per copy. Copies
are made once per combination of conditions met, so a dataset that always takes one branch costs
one copy. Only the branch that really runs is observed on each batch, as it would run in
deployment; a branch no batch takes gets no range (quantize then names the tensors without one).

A tensor of a Loop or Scan body takes one value per iteration. The runner fetches it from a copy of
the model in which it is an extra scan output of the body
(`onnx_qat.graph.subgraphs.expose_iterations`): the values of every iteration, stacked, so
every calibration method sees all iterations. A body whose tensor shapes change across iterations
cannot be exposed so (onnxruntime refuses the copy): its tensors, like those of an If inside a body,
come back as None and get no range. A name that is no tensor of the model is a ModelError.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx

from ..errors import ModelError, brief
from ..graph.index import subgraphs_of
from ..graph.subgraphs import LOOP_OPS, expose_iterations

logger = logging.getLogger(__name__)


def _defined_inside(node: onnx.NodeProto) -> set:
    """Every tensor name the subgraphs of ``node`` (nested ones too) define (a body's inputs too)."""
    names = set()
    stack = [g for _, _, g in subgraphs_of(node)]
    while stack:
        graph = stack.pop()
        names.update(t.name for t in graph.initializer)
        names.update(i.name for i in graph.input)
        for inner in graph.node:
            names.update(o for o in inner.output if o)
            if inner.attribute:
                stack.extend(g for _, _, g in subgraphs_of(inner))
    return names


#: Main graphs of more nodes than this are observed piece by piece (`make_runner`).
CHUNKED_NODES = 8000


def make_runner(model: onnx.ModelProto, names: Sequence[str], threads: Optional[int] = None,
                batch_axis: Optional[Mapping[str, int]] = None):
    """An onnxruntime session fetching ``names`` as extra outputs when all are main-graph tensors
    (``threads``: its intra-op threads, None for onnxruntime's default), else a `BranchRunner`
    (``model`` is then copied, never changed).

    A main graph of more than `CHUNKED_NODES` nodes is run piece by piece
    (`onnx_qat.runtime.chunked.ChunkedSession`, the graph outputs fetchable too; ``batch_axis``:
    ``{input: axis}`` of the inputs whose batch axis is not the first, the one axis its pieces
    declare symbolic): onnxruntime's
    build of one session with that many extra outputs grows much faster than the graph (measured on
    the benchmark's residual nets, in CPU time: 2.0 s at 5,000 nodes, 5.7 s at 10,000, and `max`
    calibration at 50,000 nodes 674 s of which most was that build), while the pieces' sessions grow
    linearly (0.5 s and 1.1 s with their run; the same values bit for bit on those nets: their graph
    optimisations are off, and a float Conv, Relu and Add compute the same either way)."""
    from ..runtime.sessions import make_session

    if in_main_graph(model, names):
        if len(model.graph.node) > CHUNKED_NODES:
            from ..runtime import chunked

            fetched = list(dict.fromkeys(list(names) + [o.name for o in model.graph.output]))
            return chunked.ChunkedSession(model, fetched, chunk_nodes=chunked.CHUNK_NODES, threads=threads,
                                          batch_axis=batch_axis)
        return make_session(model, extra_outputs=names, threads=threads)  # the model is not changed
    return BranchRunner(model, names)


def in_main_graph(model: onnx.ModelProto, names: Sequence[str]) -> bool:
    """True when every one of ``names`` is a tensor of ``model``'s main graph (no If branch or
    Loop/Scan body to observe)."""
    from ..runtime.sessions import _tensor_names

    main = _tensor_names(model.graph)
    return all(n in main for n in names)


class BranchRunner:
    """Runs ``model`` so that ``names`` (main-graph tensors, tensors of If branches and of Loop/Scan
    bodies) can be fetched.

    Args:
        model: a float ModelProto (not changed).
        names: the tensors `run` will be asked for.

    Raises:
        ModelError: a name is not a tensor of the model (in no graph, nor in any subgraph).

    A tensor of a Loop/Scan body comes back as its values of every iteration stacked on a new first
    axis (`onnx_qat.graph.subgraphs.expose_iterations`). A body whose tensor shape changes across
    iterations cannot give them (onnxruntime refuses the copy): that node's tensors then join
    `unobservable` and come back as None, like a tensor of an If inside a Loop/Scan body.
    """

    def __init__(self, model: onnx.ModelProto, names: Sequence[str]):
        from ..runtime.sessions import _tensor_names

        main = _tensor_names(model.graph)
        self.main = [n for n in names if n in main]
        inner = [n for n in names if n not in main]
        self.ifs: List[Tuple[int, str]] = []  # (position, condition) of each If holding a wanted tensor
        self.loops: Dict[str, List[str]] = {}  # Loop/Scan node -> wanted tensors of its body
        found = set()
        for position, node in enumerate(model.graph.node):
            if not node.attribute:
                continue
            inside = _defined_inside(node) & set(inner)
            if node.op_type == "If" and inside:
                self.ifs.append((position, node.input[0]))
                found |= inside
            elif node.op_type in LOOP_OPS and inside:
                self.loops[node.name or f"{node.op_type}_{position}"] = sorted(inside)
                found |= inside
        lost = [n for n in inner if n not in found]
        if lost:
            raise ModelError(f"tensor {lost[0]!r} is not a tensor of the model (neither in its main graph "
                             "nor in an If branch or a Loop/Scan body)")
        self.model = model
        looped = {n for group in self.loops.values() for n in group}
        self.inner = [n for n in inner if n not in looped]
        #: tensors no run can give (a body whose shapes change across iterations, an If inside a body)
        self.unobservable: set = set()
        self.conditions = [c for _, c in self.ifs]
        self._build(sorted(looped))
        self.variants: Dict[Tuple[bool, ...], "BranchRunner"] = {}

    def _build(self, looped: Sequence[str]) -> None:
        """The session over a copy of the model with the body tensors ``looped`` exposed."""
        import onnxruntime as ort

        from ..runtime.sessions import make_session

        exposed_model, self.exposed = expose_iterations(self.model, looped)
        # a failure of the exposed copy is handled here (_recover): onnxruntime need not log it too
        self.quiet = ort.RunOptions()
        self.quiet.log_severity_level = 4
        self.unobservable |= set(looped) - set(self.exposed)  # e.g. in an If inside a body
        self.fetch = list(dict.fromkeys(self.main + self.conditions + list(self.exposed.values())))
        self.session = make_session(exposed_model, extra_outputs=self.fetch, copy=False)

    def _recover(self, feed: Dict[str, np.ndarray], error: Exception) -> None:
        """After onnxruntime failed on the copy with body tensors exposed: keep the Loop/Scan nodes
        whose tensors it can give on ``feed``, one node at a time; the others' tensors become
        `unobservable`. Raises ``error`` again when the failure is not theirs."""
        kept: List[str] = []
        self._build([])
        try:
            self.session.run(self.fetch, feed, self.quiet)
        except Exception:
            raise error from None
        for node, group in self.loops.items():
            wanted = [n for n in group if n not in self.unobservable]
            if not wanted:
                continue
            try:
                self._build(kept + wanted)
                self.session.run(self.fetch, feed, self.quiet)
                kept.extend(wanted)
            except Exception as exc:
                self.unobservable |= set(wanted)
                logger.warning("%s node %r: its body's tensors cannot be observed per iteration (%s); "
                               "they get no range", _op_of(self.model, node), node, brief(exc, 160))
        self._build(kept)

    def run(self, names: Sequence[str], feed: Dict[str, np.ndarray]) -> List[Optional[np.ndarray]]:
        """The values of ``names`` (among those given at construction) on one batch: a Loop/Scan
        body's tensor stacked over its iterations; None for the tensors of a branch this batch
        does not take and for `unobservable` ones."""
        from ..graph.subgraphs import inline_branches

        try:
            fetched = self.session.run(self.fetch, feed, self.quiet if self.exposed else None)
        except Exception as exc:
            if not self.exposed:
                raise
            self._recover(feed, exc)
            fetched = self.session.run(self.fetch, feed)
        values = dict(zip(self.fetch, fetched))
        for name, holder in self.exposed.items():
            value = values[holder]
            values[name] = value if value is not None and np.asarray(value).size else None  # 0 iterations
        if self.inner:
            choice = tuple(bool(np.asarray(values[c]).reshape(-1)[0]) for c in self.conditions)
            variant = self.variants.get(choice)
            if variant is None:
                inlined = inline_branches(self.model, {p: c for (p, _), c in zip(self.ifs, choice)})
                # tensors of the branch not taken are no longer in the model: ask for the rest
                taken = _tensor_names_deep(inlined)
                variant = self.variants[choice] = BranchRunner(inlined, [n for n in self.inner if n in taken])
            wanted = [n for n in self.inner if n in variant.names]
            if wanted:
                values.update(zip(wanted, variant.run(wanted, feed)))
            self.unobservable |= variant.unobservable
        return [None if n in self.unobservable else values.get(n) for n in names]

    @property
    def names(self) -> set:
        """The tensors this runner can be asked for."""
        return set(self.main) | set(self.inner) | {n for group in self.loops.values() for n in group}


def _op_of(model: onnx.ModelProto, name: str) -> str:
    return next((n.op_type for n in model.graph.node if n.name == name), "Loop/Scan")


def _tensor_names_deep(model: onnx.ModelProto) -> set:
    """Every tensor name defined in ``model``'s main graph and (nested) subgraphs."""
    from ..runtime.sessions import _tensor_names

    names = _tensor_names(model.graph)
    for node in model.graph.node:
        if node.attribute:
            names |= _defined_inside(node)
    return names


__all__ = ["BranchRunner", "make_runner"]
