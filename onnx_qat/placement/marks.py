"""What placement decides, as plain immutable records (no graph objects).

Handlers only produce these marks; `onnx_qat.insertion.inserter` is the one place
that turns marks plus a ScaleTable into QuantizeLinear/DequantizeLinear nodes.

The records made once per node or per mark (`ActivationMark`, `WeightMark`,
`Decision`) are frozen dataclasses with a written-out ``__init__`` that stores the fields
straight into the new instance's ``__dict__``. It makes the same object as the generated one,
which calls ``object.__setattr__`` once per field (the price of ``frozen``) and takes twice as
long; a 50,000-node model makes ~10^5 of these records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class ActivationMark:
    """Quantize activation ``tensor`` once (per tensor) for the listed consumers.

    Attributes:
        tensor: the ONNX tensor name to quantize.
        consumers: ``(node name, input index)`` pairs that read the DequantizeLinear output;
            other consumers keep reading the float tensor.
        rule: the docs/placement.md rule number that asked for it, e.g. ``"R4"``.
        reason: one human-readable sentence.
        scale_group: tensors with the same non-None group share one scale (Concat, rule 7).
    """

    tensor: str
    consumers: Tuple[Tuple[str, int], ...]
    rule: str
    reason: str
    scale_group: Optional[str] = None

    def __init__(self, tensor: str, consumers: Tuple[Tuple[str, int], ...], rule: str, reason: str,
                 scale_group: Optional[str] = None):
        fields = self.__dict__  # see the module docstring
        fields["tensor"] = tensor
        fields["consumers"] = consumers
        fields["rule"] = rule
        fields["reason"] = reason
        fields["scale_group"] = scale_group


@dataclass(frozen=True)
class WeightMark:
    """Quantize constant weight ``tensor`` of ``node`` (input ``input_index``).

    ``axis`` is the per-channel axis, or None for per-tensor.
    """

    tensor: str
    node: str
    input_index: int
    axis: Optional[int]
    rule: str
    reason: str

    def __init__(self, tensor: str, node: str, input_index: int, axis: Optional[int], rule: str, reason: str):
        fields = self.__dict__  # see the module docstring
        fields["tensor"] = tensor
        fields["node"] = node
        fields["input_index"] = input_index
        fields["axis"] = axis
        fields["rule"] = rule
        fields["reason"] = reason


@dataclass(frozen=True)
class Decision:
    """The placement decision for one node, for ``onnx-qat inspect`` and debug logs.

    ``action`` is one of ``"quantize"``, ``"skip"``, ``"none"`` (commuting or not
    quantizable op, nothing to do).
    """

    node: str
    op_type: str
    action: str
    rule: str
    reason: str

    def __init__(self, node: str, op_type: str, action: str, rule: str, reason: str):
        fields = self.__dict__  # see the module docstring
        fields["node"] = node
        fields["op_type"] = op_type
        fields["action"] = action
        fields["rule"] = rule
        fields["reason"] = reason


def group_by_tensor(marks, into: Dict[str, List[ActivationMark]]) -> None:
    """Append each activation mark to ``into[mark.tensor]`` (the marks asked for each tensor, in
    the order given)."""
    for mark in marks:
        found = into.get(mark.tensor)
        if found is None:
            into[mark.tensor] = [mark]
        else:
            found.append(mark)


@dataclass(frozen=True)
class Placement:
    """The full placement decided for a graph, before any node is inserted.

    ``subgraphs`` holds the placement of each subgraph quantized in place (the branches of an If),
    each a `SubgraphPlacement` whose marks name nodes and tensors of that subgraph. The
    ``activations``, ``weights`` and ``decisions`` fields are this graph's own; the ``all_*``
    methods, [`activation_tensors`][onnx_qat.placement.marks.Placement.activation_tensors],
    [`empty`][onnx_qat.placement.marks.Placement.empty], [`counts`][onnx_qat.placement.marks.Placement.counts]
    and [`decision_for`][onnx_qat.placement.marks.Placement.decision_for] include the subgraphs.
    """

    activations: Tuple[ActivationMark, ...] = ()
    weights: Tuple[WeightMark, ...] = ()
    decisions: Tuple[Decision, ...] = ()
    notes: Tuple[str, ...] = field(default=())
    subgraphs: Tuple["SubgraphPlacement", ...] = field(default=())

    def nested(self) -> Tuple["Placement", ...]:
        """This placement and those of its subgraphs (depth first)."""
        found = [self]
        for sub in self.subgraphs:
            found.extend(sub.placement.nested())
        return tuple(found)

    def all_activations(self) -> Tuple[ActivationMark, ...]:
        """The activation marks of this graph and of every subgraph."""
        return tuple(m for p in self.nested() for m in p.activations)

    def all_weights(self) -> Tuple[WeightMark, ...]:
        """The weight marks of this graph and of every subgraph."""
        return tuple(m for p in self.nested() for m in p.weights)

    def all_decisions(self) -> Tuple[Decision, ...]:
        """The decisions of this graph and of every subgraph."""
        return tuple(d for p in self.nested() for d in p.decisions)

    def activation_tensors(self) -> Tuple[str, ...]:
        """Names of the activation tensors to quantize (sorted, unique), subgraphs included."""
        return tuple(sorted({m.tensor for m in self.all_activations()}))

    def weight_tensors(self) -> Tuple[str, ...]:
        """The weight initializers of this graph to quantize, sorted, each once."""
        return tuple(sorted({m.tensor for m in self.weights}))

    @property
    def empty(self) -> bool:
        """Nothing is quantized (no activation and no weight mark, in any subgraph either)."""
        return not self.activations and not self.weights and all(s.placement.empty for s in self.subgraphs)

    def counts(self) -> dict:
        """Numbers for summaries: marks, and decisions by action (subgraphs included)."""
        actions = {"quantize": 0, "skip": 0, "none": 0}
        decisions = self.all_decisions()
        for d in decisions:
            actions[d.action] = actions.get(d.action, 0) + 1
        counts = {"activations": len(self.all_activations()), "weights": len(self.all_weights()),
                  "nodes": len(decisions)}
        counts.update({f"nodes_{k}": v for k, v in sorted(actions.items())})
        return counts

    def decision_for(self, node: str) -> Optional[Decision]:
        """The decision taken for ``node`` (None when no graph has such a node; a subgraph's node is
        found when this graph has no node of that name)."""
        for d in self.all_decisions():
            if d.node == node:
                return d
        return None

    def table(self, *, all_nodes: bool = True) -> str:
        """A plain-text table of every decision (``onnx-qat inspect``), then the Q/DQ list and notes.

        With ``all_nodes=False`` the ``none`` decisions (commuting or not-quantized ops) are left out.
        """
        rows = [(d.node, d.op_type, d.action, d.rule, d.reason) for d in self.decisions
                if all_nodes or d.action != "none"]
        head = ("node", "op", "action", "rule", "reason")
        widths = [min(max([len(head[i])] + [len(r[i]) for r in rows]), 40) for i in range(4)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths), "-" * 6)]
        lines += [fmt.format(*r) for r in rows]
        lines.append("")
        lines.append(f"{len(self.activations)} activation Q/DQ pair(s), "
                     f"{len(self.weights)} weight(s) quantized")
        for m in self.activations:
            group = f" [scale group {m.scale_group}]" if m.scale_group else ""
            users = ", ".join(f"{n}:{i}" for n, i in m.consumers)
            lines.append(f"  activation {m.tensor} -> {users} ({m.rule}){group}")
        for w in self.weights:
            axis = "per tensor" if w.axis is None else f"axis {w.axis}"
            lines.append(f"  weight {w.tensor} of {w.node} ({axis}, {w.rule})")
        lines += [f"note: {n}" for n in self.notes]
        for sub in self.subgraphs:
            lines += ["", f"== subgraph {sub.attribute} of {sub.node} =="]
            lines.append(sub.placement.table(all_nodes=all_nodes))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready form: marks, decisions and notes."""
        return {
            "activations": [{"tensor": m.tensor, "consumers": [f"{n}:{i}" for n, i in m.consumers],
                             "rule": m.rule, "reason": m.reason, "scale_group": m.scale_group}
                            for m in self.activations],
            "weights": [{"tensor": w.tensor, "node": w.node, "input_index": w.input_index, "axis": w.axis,
                         "rule": w.rule, "reason": w.reason} for w in self.weights],
            "decisions": [{"node": d.node, "op_type": d.op_type, "action": d.action, "rule": d.rule,
                           "reason": d.reason} for d in self.decisions],
            "notes": list(self.notes),
            "subgraphs": [{"node": sub.node, "attribute": sub.attribute, "position": sub.position,
                           "placement": sub.placement.to_dict()} for sub in self.subgraphs],
        }


@dataclass(frozen=True)
class SubgraphPlacement:
    """The placement of one subgraph: graph ``position`` of attribute ``attribute`` (e.g.
    ``then_branch``) of node ``node`` (in the graph holding it)."""

    node: str
    attribute: str
    position: int
    placement: Placement
