"""Observing tensors inside If branches, which onnxruntime cannot return as graph outputs.

:class:`BranchRunner` answers ``run(names, feed)`` like an onnxruntime session. Tensors of the main
graph are fetched as extra outputs. For tensors inside the branches of an If, it first runs the
model to read the If's condition on this batch, then runs a copy of the model in which that If is
replaced by the branch it takes (:func:`onnx_qat.subgraphs.inline_branches`); there the branch's
tensors are main-graph tensors. Nested Ifs are resolved the same way, one level per copy. Copies
are made once per combination of conditions met, so a dataset that always takes one branch costs
one copy. Only the branch that really runs is observed on each batch, as it would run in
deployment; a branch no batch takes gets no range (quantize then names the tensors without one).

Tensors inside Loop or Scan bodies cannot be observed (one value per iteration): asking for one is
a ModelError.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnx

from ..errors import ModelError
from ..placement.graph_index import subgraphs_of


def _defined_inside(node: onnx.NodeProto) -> set:
    """Every tensor name the subgraphs of ``node`` (nested ones too) define."""
    names = set()
    stack = [g for _, _, g in subgraphs_of(node)]
    while stack:
        graph = stack.pop()
        names.update(t.name for t in graph.initializer)
        for inner in graph.node:
            names.update(o for o in inner.output if o)
            if inner.attribute:
                stack.extend(g for _, _, g in subgraphs_of(inner))
    return names


def make_runner(model: onnx.ModelProto, names: Sequence[str]):
    """An onnxruntime session fetching ``names`` as extra outputs when all are main-graph tensors,
    else a :class:`BranchRunner` (``model`` is then copied, never changed)."""
    from ..runtime import _tensor_names, make_session

    main = _tensor_names(model.graph)
    if all(n in main for n in names):
        return make_session(model, extra_outputs=names, copy=False)
    return BranchRunner(model, names)


class BranchRunner:
    """Runs ``model`` so that ``names`` (main-graph tensors and tensors of If branches) can be fetched.

    Args:
        model: a float ModelProto (not changed).
        names: the tensors :meth:`run` will be asked for.

    Raises:
        ModelError: a name is neither a main-graph tensor nor defined inside an If branch.
    """

    def __init__(self, model: onnx.ModelProto, names: Sequence[str]):
        from ..runtime import _tensor_names, make_session

        main = _tensor_names(model.graph)
        self.main = [n for n in names if n in main]
        inner = [n for n in names if n not in main]
        self.ifs: List[Tuple[int, str]] = []  # (position, condition) of each If holding a wanted tensor
        found = set()
        for position, node in enumerate(model.graph.node):
            if node.op_type == "If" and node.attribute:
                inside = _defined_inside(node) & set(inner)
                if inside:
                    self.ifs.append((position, node.input[0]))
                    found |= inside
        lost = [n for n in inner if n not in found]
        if lost:
            raise ModelError(f"tensor {lost[0]!r} is neither in the main graph nor in an If branch "
                             "(tensors of Loop/Scan bodies cannot be observed)")
        self.model = model
        self.inner = inner
        conditions = [c for _, c in self.ifs]
        self.session = make_session(model, extra_outputs=self.main + conditions, copy=True)
        self.fetch = self.main + [c for c in conditions if c not in self.main]
        self.variants: Dict[Tuple[bool, ...], "BranchRunner"] = {}

    def run(self, names: Sequence[str], feed: Dict[str, np.ndarray]) -> List[Optional[np.ndarray]]:
        """The values of ``names`` (among those given at construction) on one batch, None for the
        tensors of a branch this batch does not take."""
        from ..subgraphs import inline_branches

        values = dict(zip(self.fetch, self.session.run(self.fetch, feed)))
        if self.inner:
            choice = tuple(bool(np.asarray(values[c]).reshape(-1)[0]) for _, c in self.ifs)
            variant = self.variants.get(choice)
            if variant is None:
                inlined = inline_branches(self.model, {p: c for (p, _), c in zip(self.ifs, choice)})
                # tensors of the branch not taken are no longer in the model: ask for the rest
                taken = _tensor_names_deep(inlined)
                variant = self.variants[choice] = BranchRunner(inlined, [n for n in self.inner if n in taken])
            wanted = [n for n in self.inner if n in variant.names]
            if wanted:
                values.update(zip(wanted, variant.run(wanted, feed)))
        return [values.get(n) for n in names]

    @property
    def names(self) -> set:
        """The tensors this runner can return."""
        return set(self.main) | set(self.inner)


def _tensor_names_deep(model: onnx.ModelProto) -> set:
    """Every tensor name defined in ``model``'s main graph and (nested) subgraphs."""
    from ..runtime import _tensor_names

    names = _tensor_names(model.graph)
    for node in model.graph.node:
        if node.op_type == "If" and node.attribute:
            names |= _defined_inside(node)
    return names


__all__ = ["BranchRunner", "make_runner"]
