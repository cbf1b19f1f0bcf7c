"""Validation of an edit's result by what the edit changed (the "delta check").

A rewrite from given scales loads a model that ``onnx.checker`` passed in full, adds QuantizeLinear /
DequantizeLinear nodes and their initializers of a few fixed forms, points the quantized inputs of the
original nodes at the new outputs and drops the float weights nothing reads any more. Running
``onnx.checker`` on the whole result again (about 1 s on the 50,000-node benchmark graph: 4 us per node,
2.5 us per initializer) re-checks what the first run already passed. What ``onnx.checker``
(``full_check=False``) verifies falls in three kinds, and `EditEvidence` covers each for such an edit:

* **per node** (an op type registered in the imported opset, not deprecated; the schema's input and
  output counts, attribute names and types; no attribute twice): a function of the node's op type,
  domain, attributes and input/output counts, which is all that differs between new nodes of one *form*.
  The original nodes passed at load under the same header (IR version and opset imports, compared by
  `onnx_qat.io.models.save_model`) and the edit changes only their input names. Each new node's form is
  named by the code that makes it (`GraphEdit.insert`'s ``forms``); one node of each form is checked by
  ``onnx.checker`` (in a small model with the result's header). A node queued without a form, or a
  result whose header differs from the checked one, leaves the whole result to ``onnx.checker``.
* **per initializer** (a defined element type, exactly one value field, raw bytes of the size the
  dims and type give): each new initializer made as bytes is measured when it is made (its raw length
  against its dims and element type; a mismatch leaves the result to ``onnx.checker``), one of each
  element type goes through ``onnx.checker``, and new initializers made as TensorProtos go through it
  whole. The original initializers are unchanged.
* **per graph** (names: SSA form, nodes in topological order, unique non-empty initializer names,
  every graph output produced): `structure_problem` over the whole result, every node's inputs and
  outputs as written (an original node's read from its protobuf, a new node's from the fields its bytes
  were made from), in the checker's words.

Only a main graph without subgraphs is covered (names read inside a subgraph would need its scope).
``ONNX_QAT_FULL_CHECK=1`` (`onnx_qat.io.models.FULL_CHECK_ENV`) runs ``onnx.checker`` in full instead, as
the tests of the rewrite do for every model they write. docs/architecture.md ("Validation of the
result") gives the reasoning; docs/performance.md the figures.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

import onnx

from ..errors import ModelError, brief
from .wire import EncodedNode, EncodedTensor


def structure_problem(graph_inputs: Sequence[str], initializer_names: Iterable[str], nodes,
                      graph_outputs: Iterable[str]) -> Optional[str]:
    """The first name problem ``onnx.checker`` would report for a main graph, in its words, or None.

    ``nodes``: every node in order, each with ``name``, ``op_type``, ``input`` and ``output`` (NodeProtos,
    `EncodedNode`s). The checks are those of ``onnx.checker``'s graph pass for a graph without outer scope
    and IR version >= 4: graph inputs named once; initializer names non-empty and unique; each non-empty
    node input a graph input, an initializer or an earlier node's output; each non-empty node output new;
    each graph output defined."""
    defined = set()
    for name in graph_inputs:
        if name in defined:
            return (f"Graph must be in single static assignment (SSA) form, however '{name}' has been used "
                    "as graph input names multiple times.")
        defined.add(name)
    seen = set()
    for name in initializer_names:
        if not name:
            return "Tensor initializers must have a non-empty name"
        if name in seen:
            return f"{name} initializer name is not unique"
        seen.add(name)
    defined |= seen
    add = defined.add
    for node in nodes:
        inputs, outputs = node.input, node.output
        if type(outputs) is not tuple:  # a NodeProto's fields: copied once, not read again by each test
            inputs, outputs = inputs[:], outputs[:]
        if not defined.issuperset(inputs):  # or an absent ("") input, which is allowed
            for tensor in inputs:
                if tensor and tensor not in defined:
                    return (f"Nodes in a graph must be topologically sorted, however input '{tensor}' of "
                            f"node: name: {node.name} OpType: {node.op_type} is not output of any previous "
                            "nodes.")
        for tensor in outputs:
            if tensor:
                if tensor in defined:
                    return (f"Graph must be in single static assignment (SSA) form, however '{tensor}' has "
                            "been used as output names multiple times.")
                add(tensor)
    for name in graph_outputs:
        if name not in defined:
            return f"Graph output '{name}' is not an output of any node in graph."
    return None


def structure_clean(graph_inputs: Sequence[str], initializer_names: Sequence[str], inputs: Iterable,
                    outputs: Iterable, graph_outputs: Iterable[str]) -> bool:
    """Whether `structure_problem` finds nothing in a graph whose nodes' input and output names are
    ``inputs`` and ``outputs`` (one list or tuple per node, in order): the same tests from those lists
    alone, for a caller that holds them already (`onnx_qat.graph.edit.GraphEdit.commit`); the words of a
    problem come from `structure_problem`."""
    defined = set(graph_inputs)
    if len(defined) != len(graph_inputs):
        return False
    names = set(initializer_names)
    if len(names) != len(initializer_names) or "" in names:
        return False
    defined |= names
    issuperset, add = defined.issuperset, defined.add
    for node_inputs, node_outputs in zip(inputs, outputs):
        if not issuperset(node_inputs) and any(t and t not in defined for t in node_inputs):
            return False
        for tensor in node_outputs:
            if tensor:
                if tensor in defined:
                    return False
                add(tensor)
    return defined.issuperset(graph_outputs)


class ResultNodes(NamedTuple):
    """The result's main graph as the edit wrote it, node by node in order, from the values the edit
    made it from (an original node's fields read once from its protobuf, a new node's from the fields its
    bytes were made from): what `structure_problem` reads, kept for the readiness check of the same
    result (``onnx_qat.check.check``'s ``evidence``), which then reads no node's fields from the protobuf
    again.

    Attributes:
        ops: each node's op type.
        inputs: each node's input names (a list or tuple; ``""`` for an absent input).
        outputs: each node's output names.
        forms: each node's form (`onnx_qat.graph.edit.GraphEdit.insert`) for a new node, None for an
            original one.
        samples: form -> one new node of that form (`EncodedNode` or NodeProto): a new node's domain and
            attributes are its form's.
        initializers: the names of the result's initializers, in order.
        stored: name -> ``(element type, raw bytes)`` of the new initializers made as bytes with at most
            `onnx_qat.graph.edit.STORED_MOST` raw bytes (what their ``data_type`` and ``raw_data`` hold).
        dims: name -> ``dims`` (a tuple) of the new initializers made as bytes that are not scalars (a
            name of `stored` absent here has no dims).
    """

    ops: list
    inputs: list
    outputs: list
    forms: list
    samples: dict
    initializers: list
    stored: dict
    dims: dict


class EditEvidence:
    """What an edit of a fully checked model changed, to validate its result with (see the module
    docstring). Made by `onnx_qat.graph.edit.GraphEdit.commit`; used by
    `onnx_qat.io.models.save_model` (``evidence``) and by the readiness check of the result
    (``onnx_qat.check.check``'s ``evidence``: `nodes`).

    Attributes:
        checked: the `onnx_qat.io.models.CheckedForm` (IR version, opset imports) under which
            ``onnx.checker`` passed the model before the edit.
        problem: the structural problem of the result (`structure_problem`), or None.
        forms: one new node of each form (`EncodedNode` or NodeProto).
        tensors: one new initializer made as bytes of each element type (`EncodedTensor`), and every new
            initializer made as a TensorProto.
        model: the result (the ModelProto `commit` returned), or None.
        nodes: its main graph's `ResultNodes`, or None.
    """

    def __init__(self, checked, problem: Optional[str], forms: Sequence, tensors: Sequence, model=None,
                 nodes: Optional[ResultNodes] = None):
        self.checked = checked
        self.problem = problem
        self.forms = tuple(forms)
        self.tensors = tuple(tensors)
        self.model = model
        self.nodes = nodes

    def nodes_of(self, model) -> Optional[ResultNodes]:
        """`nodes` when they describe ``model``: the very ModelProto the edit committed, with no
        structural problem and as many nodes and initializers as the edit wrote (a model changed since
        in other ways than its metadata is not this evidence's to describe: callers change none); else
        None."""
        nodes = self.nodes
        if nodes is None or self.model is not model or self.problem is not None:
            return None
        graph = model.graph
        if len(graph.node) != len(nodes.ops) or len(graph.initializer) != len(nodes.initializers):
            return None
        return nodes

    def __repr__(self) -> str:
        return f"EditEvidence({len(self.forms)} node form(s), {len(self.tensors)} initializer(s) checked)"

    def verify(self, model: onnx.ModelProto, label: str) -> None:
        """Raise ModelError (``<label> is not a valid ONNX model: <problem>``, as for ``onnx.checker``)
        when the structural pass found a problem or ``onnx.checker`` refuses the model of `forms` and
        `tensors` with ``model``'s header."""
        if self.problem is not None:
            raise ModelError(f"{label} is not a valid ONNX model: {self.problem}")
        sample = forms_model(model, self.forms, self.tensors)
        try:
            onnx.checker.check_model(sample.SerializeToString(), full_check=False)
        except Exception as exc:  # onnx raises ValidationError, or C++ errors as other types
            reason = brief(exc, 300, first_line=True)
            raise ModelError(f"{label} is not a valid ONNX model: {reason}") from None


def forms_model(model: onnx.ModelProto, forms: Sequence, tensors: Sequence) -> onnx.ModelProto:
    """A model with ``model``'s header (every field but the graph) whose graph holds a copy of each node
    of ``forms`` (its inputs and outputs renamed apart: inputs become graph inputs, outputs graph outputs)
    and the initializers ``tensors``."""
    sample = onnx.ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name != "graph":
            target = getattr(sample, descriptor.name)
            if hasattr(target, "extend"):
                target.extend(value)
            elif descriptor.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(sample, descriptor.name, value)
    graph = sample.graph
    graph.name = model.graph.name or "graph"
    nodes: List[onnx.NodeProto] = []
    for k, form in enumerate(forms):
        node = form.proto() if type(form) is EncodedNode else _copy(form)
        renamed_in = [f"onnx_qat.delta/{k}/in{j}" if t else "" for j, t in enumerate(node.input)]
        renamed_out = [f"onnx_qat.delta/{k}/out{j}" if t else "" for j, t in enumerate(node.output)]
        del node.input[:]
        node.input.extend(renamed_in)
        del node.output[:]
        node.output.extend(renamed_out)
        nodes.append(node)
        graph.input.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, [])
                           for t in renamed_in if t)
        graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, [])
                            for t in renamed_out if t)
    graph.node.extend(nodes)
    graph.initializer.extend(t.proto() if type(t) is EncodedTensor else t for t in tensors)
    return sample


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def tensor_forms(added: Iterable) -> List:
    """The new initializers `EditEvidence` has ``onnx.checker`` look at: the first made as bytes of each
    element type, and every one made as a TensorProto."""
    first: Dict[int, EncodedTensor] = {}
    whole = []
    for tensor in added:
        if type(tensor) is EncodedTensor:
            first.setdefault(tensor.data_type, tensor)
        else:
            whole.append(tensor)
    return list(first.values()) + whole


__all__ = ["EditEvidence", "ResultNodes", "forms_model", "structure_clean", "structure_problem",
           "tensor_forms"]
