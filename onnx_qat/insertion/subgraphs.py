"""Q/DQ insertion inside If branches and Loop/Scan bodies: the one inserter
(`onnx_qat.insertion.inserter.insert_qdq_pairs`) run on each branch or body, wrapped in a
ModelProto, with outer-scope constants readable (a branch's weight may be an initializer or Constant of
an enclosing graph) and names unique across the whole model; the edited graph replaces the original
in its node. A float weight of an enclosing graph that only quantized subgraphs read is dropped there
afterwards (`onnx_qat.graph.subgraphs.drop_unread`): its int8 copy lives in the subgraphs.
"""
from __future__ import annotations

from typing import List, Optional, Set

import onnx

from ..graph.edit import GraphEdit
from ..graph.subgraphs import drop_unread, model_names, outer_constants, read_by_subgraphs
from ..placement.marks import Placement
from .inserter import insert_qdq_pairs


def insert_into_subgraphs(model: onnx.ModelProto, placement: Placement, scales, target, *,
                          names: Optional[Set[str]] = None, inherited=None, precision="int8",
                          block_size: int = 128) -> List[dict]:
    """Insert the Q/DQ of every `SubgraphPlacement` of ``placement``
    into the matching If branch or Loop/Scan body of ``model`` (a model
    [`onnx_qat.quantize`][onnx_qat.quantize.quantize] owns; its nodes get their edited subgraphs in place).
    Nested subgraphs are edited first, then the graph holding them.

    Args:
        model: the ModelProto whose main graph ``placement`` describes.
        placement: the main graph's placement.
        scales: the [`ScaleTable`][onnx_qat.scales.ScaleTable] (ranges of branch tensors included).
        target: the `Target` or its name.
        names: every name of the model, shared by all edits (made here when None).
        inherited: internal: constants of the graphs enclosing ``model.graph``.
        precision, block_size: the numeric format, as
            `onnx_qat.insertion.inserter.insert_qdq_pairs` takes it.

    Returns:
        The inserted records (as `InsertionResult` holds them), each with
        ``"subgraph"``: ``"<node>/<attribute>"`` (e.g. ``"choose/then_branch"``, ``"refine/body"``).
    """
    if not placement.subgraphs:
        return []
    names = model_names(model) if names is None else names
    visible = outer_constants(model.graph, inherited or {})
    by_name = {n.name: n for n in model.graph.node}
    records: List[dict] = []
    for sub in placement.subgraphs:
        node = by_name[sub.node]
        attribute = next(a for a in node.attribute if a.name == sub.attribute)
        graph = attribute.g if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs[sub.position]
        records.extend(_insert_into_branch(model, node, graph, sub, scales, target, names, visible,
                                           {"precision": precision, "block_size": block_size}))
    return records


def _insert_into_branch(model, node, graph, sub, scales, target, names, visible, fmt) -> List[dict]:
    wrapper = onnx.ModelProto(ir_version=model.ir_version)
    wrapper.opset_import.extend(model.opset_import)
    wrapper.graph.CopyFrom(graph)
    shared = read_by_subgraphs(wrapper.graph)  # weights of this branch its nested Ifs read
    records = insert_into_subgraphs(wrapper, sub.placement, scales, target, names=names, inherited=visible,
                                    **fmt)
    edit = GraphEdit(wrapper, names=names, outer_constants=outer_constants(wrapper.graph, visible))
    inserted = insert_qdq_pairs(edit, sub.placement, scales, target, **fmt)
    graph.CopyFrom(edit.commit().graph)
    drop_unread(graph, shared)
    where = f"{node.name}/{sub.attribute}"
    return [dict(r, subgraph=f"{where}/{r['subgraph']}") for r in records] + \
        [dict(r, subgraph=where) for r in inserted.activations + inserted.weights]

__all__ = ["insert_into_subgraphs"]
