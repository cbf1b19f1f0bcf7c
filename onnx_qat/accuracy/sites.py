"""Sites: what placement quantizes together, read from a [`Placement`][onnx_qat.placement.marks.Placement].

A site is one node placement decided to quantize (``Decision.action == "quantize"``) with the
inputs it reads through a DequantizeLinear:

* ``weighted`` (rule 4): a Conv/ConvTranspose/Gemm/MatMul with its activation and weight Q/DQ
  (with ``precision="int4"``, rule W4: a MatMul/Gemm with its one blockwise weight DequantizeLinear);
* ``residual`` (rule 6): the skip input of a residual Add;
* ``pooling`` (rule 7): the input of an AveragePool/GlobalAveragePool;
* ``concat`` (rule 7): every input of a Concat (one shared scale);
* ``attention`` (rule 9, ``include_attention``): both inputs of an activation MatMul.

Leaving a site in float is an exclusion of its node (`site_exclusions`), fed back to the same
placement, which then resolves the neighbours (a residual Add whose weighted branch went float is
no longer a fusable residual; a Concat that feeds nothing quantized stays float).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from ..placement.marks import Placement

#: Decision rule -> site kind (W4: an INT4 weight-only MatMul/Gemm, its one blockwise weight DQ).
_KINDS = {"R4": "weighted", "R6": "residual", "R9": "attention", "W4": "weighted"}


@dataclass(frozen=True)
class Site:
    """One group placement quantizes together.

    Attributes:
        name: the node placement decided to quantize (an exclusion of this name leaves the site float).
        op_type: its ONNX op type.
        kind: ``weighted``, ``residual``, ``pooling``, ``concat`` or ``attention``.
        activations: activation tensors quantized for this site.
        weights: weight initializers quantized for this site.
        edges: ``(node, input index)`` pairs that read a DequantizeLinear output for this site
            (the node itself, or the Pad before it under rule 8).
        partners: sites that go float together with this one. A residual Add left float must
            take the weighted ops it fuses into with it (else TensorRT gets a quantized Conv whose
            Add cannot fuse: ``check`` rule C10); other sites have none.
    """

    name: str
    op_type: str
    kind: str
    activations: Tuple[str, ...]
    weights: Tuple[str, ...]
    edges: Tuple[Tuple[str, int], ...]
    partners: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready form (edges left out)."""
        out = {"name": self.name, "op_type": self.op_type, "kind": self.kind,
               "activations": list(self.activations), "weights": list(self.weights)}
        if self.partners:
            out["partners"] = list(self.partners)
        return out


def _kind(op_type: str, rule: str) -> str:
    if rule == "R7":
        return "concat" if op_type == "Concat" else "pooling"
    return _KINDS.get(rule, "other")


def sites_of(placement: Placement, index=None) -> Tuple[Site, ...]:
    """The sites of ``placement``, in graph order.

    ``index``: the `GraphIndex` placement ran on. It finds
    the weighted op a Pad serves (rule 8) and the partners of residual sites; without it a Pad's
    edge goes to the site its mark's reason names, and no site has partners.
    """
    quantized = {d.node: d for d in placement.decisions if d.action == "quantize"}
    edges: Dict[str, List[Tuple[str, int]]] = {name: [] for name in quantized}
    acts: Dict[str, List[str]] = {name: [] for name in quantized}
    consumers_of = None if index is None else (
        lambda node: [c.name for t in index.by_name[node].outputs for c, _ in index.consumers(t)])
    for mark in placement.activations:
        for node, position in mark.consumers:
            owner = node if node in quantized else _owner_after(node, mark.reason, quantized, consumers_of)
            if owner is None:
                continue
            edges[owner].append((node, position))
            if mark.tensor not in acts[owner]:
                acts[owner].append(mark.tensor)
    weights: Dict[str, List[str]] = {name: [] for name in quantized}
    for mark in placement.weights:
        if mark.node in quantized:
            edges[mark.node].append((mark.node, mark.input_index))
            weights[mark.node].append(mark.tensor)
    weighted = {name for name, found in weights.items() if found}
    return tuple(Site(name, d.op_type, _kind(d.op_type, d.rule), tuple(acts[name]), tuple(weights[name]),
                      tuple(edges[name]), _partners(name, d, weighted, index))
                 for name, d in quantized.items())


def _partners(name: str, decision, weighted, index) -> Tuple[str, ...]:
    """The quantized weighted ops a residual Add's inputs come from (through the epilogue ops rule 6
    walks: the same walk, `onnx_qat.placement.handlers._through_epilogue`)."""
    if index is None or _kind(decision.op_type, decision.rule) != "residual":
        return ()
    from ..config import QuantizeConfig
    from ..placement.handlers import PlacementContext, _through_epilogue

    ctx = PlacementContext(index, QuantizeConfig(), quantized_weighted=set(weighted))
    found = [_through_epilogue(t, ctx) for t in index.by_name[name].inputs]
    return tuple(dict.fromkeys(n.name for n in found if n is not None))


def _owner_after(node: str, reason: str, quantized, consumers_of) -> "str | None":
    """The site node a non-site consumer (a Pad under rule 8) serves."""
    if consumers_of is not None:
        for following in consumers_of(node):
            if following in quantized:
                return following
    for name in quantized:  # the handler's reason names its node: "activation input of Conv 'c1'"
        if f"{name!r}" in reason:
            return name
    return None


def with_partners(sites: Sequence[Site], chosen: Iterable[int]) -> Tuple[int, ...]:
    """Site indices ``chosen`` and their partners (see `Site.partners`), sorted."""
    position = {s.name: k for k, s in enumerate(sites)}
    out = set(chosen)
    for k in list(out):
        out.update(position[p] for p in sites[k].partners if p in position)
    return tuple(sorted(out))


def tensors_to_calibrate(placement: Placement, sites: Sequence[Site], index) -> Tuple[str, ...]:
    """The activation tensors any set of float sites can make placement quantize: those of
    ``placement``, and both activation inputs of each residual Add (with one of its weighted ops in
    float, rule 6 may pick the other input as the skip)."""
    extra = [t for s in sites if s.kind == "residual" for t in index.by_name[s.name].inputs
             if t and not index.is_constant(t)]
    return tuple(dict.fromkeys(placement.activation_tensors() + tuple(extra)))


def site_exclusions(names: Iterable[str]) -> Tuple[str, ...]:
    """``exclude_nodes`` patterns that leave exactly these site nodes in float."""
    return tuple(re.escape(name) for name in sorted(set(names)))


__all__ = ["Site", "sites_of", "site_exclusions", "with_partners", "tensors_to_calibrate"]
