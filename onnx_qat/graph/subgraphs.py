"""If branches and Loop/Scan bodies as graphs of their own: the names and constants they see, and the
model copies calibration runs to observe their tensors.

Placement places each branch of an If and the body of each Loop and Scan with the same handler table
as the main graph (`onnx_qat.placement.policy.TensorRTPolicy.place`; the marks of a subgraph sit
in `onnx_qat.placement.marks.Placement.subgraphs`); the inserter runs on each of them
(`onnx_qat.insertion.subgraphs`) with `outer_constants` and `model_names` from here.
This module does the graph-level things that differ for a subgraph:

* `drop_unread` removes a float weight of an enclosing graph that only quantized subgraphs read
  (its int8 copy lives in the subgraphs).
* `inline_branches` makes a copy of a model in which chosen If nodes are replaced by the nodes
  of one of their branches. onnxruntime cannot return a tensor of a subgraph as a graph output; in
  the inlined copy it is a main-graph tensor. Calibration
  (`onnx_qat.calibration.branches.BranchRunner`) runs the original model to learn which
  branch each If takes on a batch, then the copy with that branch inlined.
* `expose_iterations` makes a copy of a model in which chosen tensors of Loop/Scan bodies are
  extra scan outputs of their bodies and extra outputs of their nodes: a body tensor takes one
  value per iteration, and onnxruntime stacks the values of every iteration there, so calibration
  gives one range covering all iterations (one Q/DQ pair in the body serves every iteration).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Set, Tuple

import onnx

from .edit import subgraph_names
from .index import subgraphs_of


def outer_constants(graph: onnx.GraphProto,
                    inherited: Mapping[str, onnx.TensorProto]) -> Dict[str, onnx.TensorProto]:
    """Name -> TensorProto of every constant a subgraph of ``graph`` can read: ``inherited`` (those
    of the graphs enclosing ``graph``), then ``graph``'s initializers and Constant values."""
    found = dict(inherited)
    found.update((t.name, t) for t in graph.initializer)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                found[node.output[0]] = value
    return found


def model_names(model: onnx.ModelProto) -> Set[str]:
    """Every tensor and node name of ``model``, in its main graph and all subgraphs."""
    graph = model.graph
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    names.update(t.name for t in graph.initializer)
    for node in graph.node:
        names.add(node.name)
        names.update(node.input)
        names.update(node.output)
    names.update(subgraph_names(graph.node))
    return names


def read_by_subgraphs(graph: onnx.GraphProto) -> Set[str]:
    """The initializers of ``graph`` that a subgraph of its nodes reads (a branch's weight kept in
    the enclosing graph)."""
    inside = subgraph_names(graph.node)
    return {t.name for t in graph.initializer if t.name in inside}


def drop_unread(graph: onnx.GraphProto, candidates: Optional[Set[str]] = None) -> List[str]:
    """Remove from ``graph`` the initializers named in ``candidates`` (every initializer when None)
    that nothing reads any more: no node of ``graph`` or of its subgraphs, no graph input or output.
    Used after the Q/DQ went into the branches (a float weight of the enclosing graph that only a
    quantized branch read is now replaced there by its int8 copy, and would otherwise stay in the
    file as dead bytes) and after a branch was inlined (the branch not taken no longer reads its
    weights). Returns the names removed."""
    if candidates is not None and not candidates:
        return []
    read = {t for node in graph.node for t in node.input} | subgraph_names(graph.node)
    read |= {i.name for i in graph.input} | {o.name for o in graph.output}
    unread = [t for t in graph.initializer
              if (candidates is None or t.name in candidates) and t.name not in read]
    for tensor in unread:
        graph.initializer.remove(tensor)
    return [t.name for t in unread]


def inline_branches(model: onnx.ModelProto, choices: Mapping[int, bool]) -> onnx.ModelProto:
    """A copy of ``model`` in which the If node at each position of ``choices`` (in the main graph) is
    replaced by the nodes of its ``then_branch`` (True) or ``else_branch`` (False), followed by
    Identity nodes from the branch outputs to the If outputs; branch initializers join the main
    graph's. Nested Ifs of the branch stay Ifs (inline them with another call)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    nodes = list(graph.node)
    kept: List[onnx.NodeProto] = []
    for position, node in enumerate(nodes):
        if position not in choices:
            kept.append(node)
            continue
        wanted = "then_branch" if choices[position] else "else_branch"
        branch = next(g for name, _, g in subgraphs_of(node) if name == wanted)
        kept.extend(branch.node)
        graph.initializer.extend(branch.initializer)
        for i, (inner, outer) in enumerate(zip(branch.output, node.output)):
            if outer:
                kept.append(onnx.helper.make_node("Identity", [inner.name], [outer],
                                                  name=f"{node.name or 'If'}_{wanted}_output_{i}"))
    del graph.node[:]
    graph.node.extend(kept)
    drop_unread(graph)  # initializers only the branch not taken read are read by nobody now
    return result


#: ops whose ``body`` runs once per iteration (their tensors take one value per iteration)
LOOP_OPS = ("Loop", "Scan")


def expose_iterations(model: onnx.ModelProto, names) -> Tuple[onnx.ModelProto, Dict[str, str]]:
    """A copy of ``model`` in which every tensor of ``names`` defined in the body of a Loop or Scan
    of the main graph (also in the body of a Loop/Scan nested in such a body) is appended to the
    body's outputs as an extra scan output (through an Identity), and the node gets a matching
    extra output: a main-graph tensor holding the tensor's values of every iteration, stacked on
    a new first axis (a nested body's: one axis per level). A Scan's ``scan_output_axes`` and
    ``scan_output_directions``, when given, gain a 0 (stacked on axis 0, in iteration order).

    Tensors of If branches inside a body are not exposed (only the branch taken runs in an
    iteration, and a scan output needs a value every iteration). ONNX requires a scan output's
    shape to stay the same across iterations: where a body tensor's shape changes, onnxruntime
    refuses the copy when it runs (`onnx_qat.calibration.branches.BranchRunner` then drops
    that node's tensors).

    Returns:
        ``(copy, exposed)``: ``exposed`` maps each exposed name of ``names`` to the main-graph
        tensor holding its stacked values. ``model`` is not changed.
    """
    wanted = set(names)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    if not wanted or not any(n.op_type in LOOP_OPS for n in result.graph.node):
        return result, {}
    taken = model_names(result)
    counter = [0]

    def fresh(base: str) -> str:
        name = base
        while name in taken:
            counter[0] += 1
            name = f"{base}_{counter[0]}"
        taken.add(name)
        return name

    return result, _expose_in(result.graph, wanted, fresh, _elem_types(result))


def _expose_in(graph: onnx.GraphProto, wanted: Set[str], fresh, types: Mapping[str, int]) -> Dict[str, str]:
    """Expose the ``wanted`` tensors of the Loop/Scan bodies of ``graph`` as outputs of their
    nodes (see `expose_iterations`); wanted name -> tensor of ``graph``."""
    found: Dict[str, str] = {}
    for node in graph.node:
        if node.op_type not in LOOP_OPS or node.domain not in ("", "ai.onnx") or not wanted - set(found):
            continue
        attribute = next((a for a in node.attribute if a.name == "body"), None)
        if attribute is None:
            continue
        body = attribute.g
        local = {i.name for i in body.input} | {o for n in body.node for o in n.output if o}
        here = {n: n for n in wanted - set(found) if n in local}
        here.update(_expose_in(body, wanted - set(found) - set(here), fresh, types))
        if not here:
            continue
        carried = len(body.output) - (1 if node.op_type == "Loop" else 0)
        while len(node.output) < carried:  # omitted trailing outputs: the new ones come after all
            node.output.append("")
        for name in sorted(here):
            inner = fresh(f"{name}_iteration")
            body.node.append(onnx.helper.make_node("Identity", [here[name]], [inner],
                                                   name=fresh(f"{name}_iteration_identity")))
            body.output.append(onnx.helper.make_tensor_value_info(
                inner, types.get(here[name], onnx.TensorProto.FLOAT), None))
            found[name] = fresh(f"{name}_per_iteration")
            node.output.append(found[name])
            for attr in node.attribute:
                if attr.name in ("scan_output_axes", "scan_output_directions"):
                    attr.ints.append(0)
    return found


def _elem_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element type of every tensor whose type shape inference can tell (in all graphs); empty
    when inference fails (a model over 2 GB, an op it does not know)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a float type is assumed then
        return {}
    types: Dict[str, int] = {}
    graphs = [inferred.graph]
    while graphs:
        graph = graphs.pop()
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.type.HasField("tensor_type"):
                types[info.name] = info.type.tensor_type.elem_type
        for node in graph.node:
            if node.attribute:
                graphs.extend(g for _, _, g in subgraphs_of(node))
    return types


__all__ = ["inline_branches", "expose_iterations", "outer_constants", "model_names", "drop_unread",
           "read_by_subgraphs"]
