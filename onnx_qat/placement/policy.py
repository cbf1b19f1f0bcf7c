"""The TensorRT placement policy: a table from op type to handler, and ``place()``.

Placement is decided completely before anything is inserted: handlers return marks,
`rule10_merge` turns them into one ActivationMark per tensor, and the result is a
[`Placement`][onnx_qat.placement.marks.Placement] that `onnx_qat.insertion.inserter` consumes.
"""
from __future__ import annotations

import logging
from operator import attrgetter
from types import MappingProxyType
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import onnx

from ..config import QuantizeConfig
from .format_marks import adapt_placement
from ..graph.index import DEFAULT_DOMAINS, GraphIndex, NodeInfo
from ..graph.ops import WEIGHTED_OPS
from .handlers import (
    COMMUTING_OPS, FUSED_EPILOGUE_OPS, SKIPPED_OPS, CommutingOpHandler, ConcatHandler,
    FusedEpilogueHandler, NodeResult, NotQuantizedHandler, PlacementContext,
    PoolingInputHandler, ResidualAddHandler, ResidualSumHandler, SkippedOpHandler, SubgraphHandler,
    WeightedOpHandler, SUBGRAPH_OPS,
)
from .marks import ActivationMark, Decision, Placement, group_by_tensor

logger = logging.getLogger(__name__)


class TensorRTPolicy:
    """Where TensorRT wants Q/DQ (explicit INT8 quantization), as data: op type -> handler.

    One handler object serves many op types. Handlers run in phases: 1 (weighted ops,
    pooling, everything local), 2 (residual Adds, which need to know which weighted ops
    were quantized), 3 (Concats, in reverse order, which need to know whether their output
    feeds a quantized input).
    """

    name = "tensorrt"

    def __init__(self):
        weighted, epilogue = WeightedOpHandler(), FusedEpilogueHandler()
        commuting, skipped = CommutingOpHandler(), SkippedOpHandler()
        table: Dict[str, object] = {}
        table.update({op: weighted for op in WEIGHTED_OPS})
        table.update({op: epilogue for op in FUSED_EPILOGUE_OPS})
        table.update({op: commuting for op in COMMUTING_OPS})
        table.update({op: skipped for op in SKIPPED_OPS})
        pooling = PoolingInputHandler()
        table.update({"AveragePool": pooling, "GlobalAveragePool": pooling})
        table["Add"] = ResidualAddHandler()
        table["Sum"] = ResidualSumHandler()
        table["Concat"] = ConcatHandler()
        subgraph = SubgraphHandler()
        table.update({op: subgraph for op in SUBGRAPH_OPS})
        self.table: Mapping[str, object] = MappingProxyType(table)
        self.default = NotQuantizedHandler()

    def handler(self, op_type: str):
        """The handler for ``op_type`` (the default handler when the table has none)."""
        return self.table.get(op_type, self.default)

    def place(self, index: GraphIndex, config: QuantizeConfig) -> Placement:
        """Decide every Q/DQ for the graph behind ``index``.

        Each node is dispatched once by its op type. A handler whose decision is the same for every node
        it serves says so in its ``constant`` attribute (``(action, rule, reason)``); its nodes get that
        decision without a call. The others run by phase, in graph order (phase 3 in reverse), and only
        the results that mark something (or share a scale, or place subgraphs) are kept for rule 10.
        """
        ctx = PlacementContext(index, config,
                               place_subgraph=lambda graph, outer: self.place_subgraph(graph, outer, config))
        nodes = index.nodes
        decisions: List[Optional[Decision]] = [None] * len(nodes)  # by node position
        kept: List[Optional[NodeResult]] = [None] * len(nodes)  # the results rule 10 and the weights read
        notes: List[str] = []
        phases: Dict[int, List[Tuple[NodeInfo, object]]] = {1: [], 2: [], 3: []}
        dispatch: Dict[str, tuple] = {}  # op type -> (handler, phase, constant decision), asked once each
        # Only a node of another domain, holding subgraphs or matching an exclusion can get a decision
        # before any rule (_pre_decision); the others skip building its helpers.
        subgraphs, excluded_ops = index.subgraph_nodes, config.exclude_op_types
        check_names = bool(config.exclude_nodes)
        holders = []  # positions of nodes whose op type holds subgraphs (If, Loop, Scan), for the notes
        for node in nodes:
            op_type = node.op_type
            if (check_names or node.domain not in DEFAULT_DOMAINS or node.name in subgraphs
                    or op_type in excluded_ops):
                early = _pre_decision(node, config)
                if early is not None:
                    decisions[node.position] = early
                    if op_type in SUBGRAPH_OPS:
                        holders.append(node.position)
                    if node.has_subgraphs and early.rule == "subgraph":
                        notes.append(f"{op_type} node {node.name!r} holds subgraphs; "
                                     "they were left untouched (only If, Loop and Scan subgraphs are "
                                     "quantized)")
                        logger.warning("%s node %r holds subgraphs; leaving them untouched",
                                       op_type, node.name)
                    continue
            found = dispatch.get(op_type)
            if found is None:
                handler = self.handler(op_type)
                found = dispatch[op_type] = (handler, getattr(handler, "phase", 1),
                                             getattr(handler, "constant", None))
            if found[2] is not None:
                decisions[node.position] = Decision(node.name, op_type, *found[2])
                continue
            if op_type in SUBGRAPH_OPS:
                holders.append(node.position)
            phases[found[1]].append((node, found[0]))
        record = ctx.record
        for phase, queued in sorted(phases.items()):
            for node, handler in (reversed(queued) if phase == 3 else queued):
                result = handler(node, ctx)
                decisions[node.position] = result.decision
                if result.activations or result.weights:  # else recording it changes nothing
                    record(result)
                    kept[node.position] = result
                elif result.shares or result.subgraphs:
                    kept[node.position] = result
        if logger.isEnabledFor(logging.DEBUG):
            for d, result in zip(decisions, kept):
                logger.debug("placement %s %r (%s): %s [%s] %s", d.action, d.node, d.op_type, d.rule,
                             d.reason, "".join(f"; Q/DQ on {m.tensor!r}" for m in
                                               (result.activations if result is not None else ())))
        for position in holders:
            d = decisions[position]
            if d.rule == "subgraph" and d.action == "skip":
                notes.append(f"{d.op_type} node {d.node!r}: {d.reason}")
                logger.warning("%s node %r: %s", d.op_type, d.node, d.reason)
        results = [r for r in kept if r is not None]
        activations = rule10_merge(results, index)
        weights = tuple([w for r in results if r.weights for w in r.weights])
        nested = tuple([s for r in results if r.subgraphs for s in r.subgraphs])
        placement = Placement(activations, weights, tuple(decisions), tuple(notes), nested)
        return adapt_placement(placement, index, config)  # the marks the numeric format keeps

    def place_subgraph(self, graph, outer: GraphIndex, config: QuantizeConfig) -> Placement:
        """The placement of subgraph ``graph`` (an If branch, a Loop/Scan body) whose outer scope is
        ``outer``."""
        return self.place(GraphIndex(graph, outer=outer), config)


def _pre_decision(node: NodeInfo, config: QuantizeConfig) -> Optional[Decision]:
    """Decisions taken before any rule: subgraphs other than those of If, Loop and Scan, custom
    domains, user exclusions."""
    def decide(action: str, rule: str, reason: str) -> Decision:
        return Decision(node.name, node.op_type, action, rule, reason)

    if node.has_subgraphs and not (node.op_type in SUBGRAPH_OPS and node.standard):
        return decide("skip", "subgraph", "holds subgraphs of an op the subgraph rule does not know: "
                      "left untouched")
    if not node.standard:
        return decide("none", "domain", f"custom domain {node.domain!r}: left alone")
    if config.op_type_excluded(node.op_type):
        return decide("skip", "exclude", f"op type {node.op_type} is in exclude_op_types")
    if config.node_excluded(node.name):
        return decide("skip", "exclude", "name matches exclude_nodes")
    return None


def rule10_merge(results: Iterable[NodeResult], index: GraphIndex) -> Tuple[ActivationMark, ...]:
    """Rule 10: one Q/DQ pair per tensor, shared by all its quantized consumers.

    Marks on the same tensor merge into one ActivationMark whose consumers are all the
    consumers asked for (in graph order); rules and reasons are joined. Scale groups
    (Concat, rule 7) that share a tensor are united; a Concat output that some rule
    quantizes joins its inputs' group. Marks come out in the order their tensor is first
    produced (graph inputs first), so insertion is deterministic.

    A tensor's lone mark with one consumer is its merged mark as it is, and two marks with one consumer each
    are merged by `_merged_pair` (the same mark, without the general case's sets and sorts): on a residual
    net nearly every tensor is one of these.

    Source: TensorRT Developer Guide, Q/DQ placement (a tensor quantized once can feed
    several INT8 consumers).
    """
    by_tensor: Dict[str, List[ActivationMark]] = {}
    shares: List[Tuple[str, str]] = []
    every: List[ActivationMark] = []
    for result in results:  # one pass: most results have no marks and no shares
        if result.activations:
            every.extend(result.activations)
        if result.shares:
            shares.extend(result.shares)
    group_by_tensor(every, by_tensor)  # the marks of each tensor in the order of the results
    grouped = any(map(_SCALE_GROUP, every))
    del every
    parent: Dict[str, str] = {}

    def find(g: str) -> str:
        while parent.setdefault(g, g) != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    tensor_group: Dict[str, str] = {}
    if grouped:
        for marks in by_tensor.values():
            for mark in marks:
                if mark.scale_group:
                    if mark.tensor in tensor_group:
                        union(tensor_group[mark.tensor], mark.scale_group)
                    tensor_group.setdefault(mark.tensor, mark.scale_group)
    for tensor, group in shares:
        if tensor in by_tensor:
            if tensor in tensor_group:
                union(tensor_group[tensor], group)
            tensor_group.setdefault(tensor, group)
    by_name = index.by_name

    def graph_order(consumer: Tuple[str, int]) -> Tuple[int, int]:
        node = by_name.get(consumer[0])
        return -1 if node is None else node.position, consumer[1]

    # in production order (the order mapping iterates in), then the tensors the graph does not make, by name
    ordered = [t for t in index.production_order() if t in by_tensor]
    if len(ordered) < len(by_tensor):
        ordered += sorted(set(by_tensor).difference(ordered))
    merged = []
    for tensor in ordered:
        marks = by_tensor[tensor]
        group = find(tensor_group[tensor]) if tensor in tensor_group else None
        mark = marks[0]
        if len(marks) == 1:
            if type(mark.consumers) is tuple and len(mark.consumers) == 1 and mark.scale_group == group:
                merged.append(mark)  # the usual case: a lone mark with one consumer: as it is
                continue
        elif len(marks) == 2:  # the next most usual (a tensor read by a weighted op and a residual join)
            pair = _merged_pair(tensor, mark, marks[1], group, graph_order)
            if pair is not None:
                merged.append(pair)
                continue
        consumers = sorted({c for m in marks for c in m.consumers}, key=graph_order)
        rules = ",".join(sorted({m.rule for m in marks}))
        reason = "; ".join(dict.fromkeys([m.reason for m in marks]))
        merged.append(ActivationMark(tensor, tuple(consumers), rules, reason, scale_group=group))
    return tuple(merged)


_SCALE_GROUP = attrgetter("scale_group")


def _merged_pair(tensor: str, first: ActivationMark, second: ActivationMark, group: Optional[str],
                 graph_order) -> Optional[ActivationMark]:
    """`rule10_merge`'s mark for ``tensor`` from its two marks ``first`` and ``second`` (in that order), each
    with one consumer, and its scale group ``group``: the same mark as its general case makes (the
    consumers in graph order, the rules sorted and joined, the reasons joined once each), without its sets
    and sorts. None where it does not apply (another number of consumers, or two consumers of the same
    graph order, whose order the general case takes from a set): the caller then merges as usual."""
    ones, twos = first.consumers, second.consumers
    if len(ones) != 1 or len(twos) != 1:
        return None
    one, two = ones[0], twos[0]
    if one == two:
        consumers = (one,)
    else:
        a, b = graph_order(one), graph_order(two)
        if a == b:
            return None
        consumers = (one, two) if a < b else (two, one)
    rule_a, rule_b = first.rule, second.rule
    rules = rule_a if rule_a == rule_b else f"{rule_a},{rule_b}" if rule_a < rule_b else f"{rule_b},{rule_a}"
    reason_a, reason_b = first.reason, second.reason
    reason = reason_a if reason_a == reason_b else f"{reason_a}; {reason_b}"
    return ActivationMark(tensor, consumers, rules, reason, scale_group=group)


#: Placement policies by the name a `Target` gives in its ``policy`` field.
POLICIES: Mapping[str, type] = MappingProxyType({"tensorrt": TensorRTPolicy})


def policy_for(target):
    """A fresh placement policy of a deployment target (a `Target` or
    its name; see `onnx_qat.insertion.targets`)."""
    from ..insertion.targets import get_target

    return POLICIES[get_target(target).policy]()


def place(model, *, config: Optional[QuantizeConfig] = None, **options) -> Placement:
    """Decide where Q/DQ pairs go in ``model`` for the configured target, without changing it.

    Args:
        model: an ``onnx.ModelProto``, an ``onnx_graphsurgeon.Graph`` or a path to a model (the
            last two loaded with [`onnx_qat.io.models.load_model`][], which upgrades opset < 13;
            a Graph is exported, never modified).
        config: a [`QuantizeConfig`][onnx_qat.config.QuantizeConfig]; ``options`` (its field names:
            ``target``, ``exclude_nodes``, ``exclude_op_types``, ``min_channels``,
            ``include_attention``, ``precision``, ``block_size``) override its fields.

    Returns:
        A [`Placement`][onnx_qat.placement.marks.Placement]: the activation and weight marks, one
        `Decision` per node with its rule and reason, and notes.
        Nodes without a name are referred to as ``<op_type>_<position>``.
    """
    config = QuantizeConfig.from_options(config, **options)
    if not isinstance(model, onnx.ModelProto):
        from ..formats.numeric import get_format
        from ..io.models import load_model

        # a path or a Graph; any other object: one ModelError line
        model = load_model(model, min_opset=get_format(config.precision).min_opset)
    return policy_for(config.target).place(GraphIndex(model), config)
