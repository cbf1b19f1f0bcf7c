"""The placement index and records answer exactly as their plain definitions.

GraphIndex keeps constants as one set, reads initializer dtypes when asked and finds consumers
and subgraph nodes on first use; the records (NodeInfo, marks, Decision, NodeResult) have a
written-out ``__init__``; rule 10 reuses a lone mark. Each is compared here with the plain
definition it replaces, on graphs with the awkward cases (Identity chains longer than the hop
limit, Constants without a value, an initializer whose declared type differs, names written twice).
"""
import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.graph.constants import MAX_CONSTANT_HOPS
from onnx_qat.graph.index import (
    GraphIndex, NodeInfo, assign_node_names, unique_node_names,
)
from onnx_qat.placement.handlers import NodeResult
from onnx_qat.placement.marks import ActivationMark, Decision, WeightMark
from onnx_qat.placement.policy import rule10_merge
from tests.builders import GraphBuilder, residual_chain_model


def _awkward_model() -> onnx.ModelProto:
    """Constants every way placement meets them, plus names that break SSA (not checked by onnx)."""
    b = GraphBuilder("awkward", seed=3)
    x = b.input("input", [1, 4, 4, 4])
    w = b.weight("w", [4, 4, 1, 1])
    value = numpy_helper.from_array(np.ones((4,), np.float32), "cvalue")
    c = b.node("Constant", [], "c", name="const", value=value)
    b.node("Constant", [], "cf", name="const_float", value_float=1.0)  # no "value": not a constant here
    chain = c
    for i in range(3):
        chain = b.node("Identity", [chain], f"id_short{i}", name=f"id_short{i}")
    chain = w
    for i in range(MAX_CONSTANT_HOPS + 1):  # longer than the hop limit: its end is not a constant
        chain = b.node("Identity", [chain], f"id_long{i}", name=f"id_long{i}")
    y = b.node("Conv", [x, w], "y", name="conv", kernel_shape=[1, 1])
    s = b.node("Mul", [y, "id_short2"], "s", name="scale")
    b.node("Relu", [s], "dup", name="relu_a")
    b.node("Relu", [s], "dup", name="relu_b")      # "dup" written twice
    b.node("Sigmoid", [s], "input", name="remake")  # a graph input written by a node
    b.node("Add", ["dup", "id_long8"], "output", name="add")
    b.output("output")
    graph = helper.make_graph(b.nodes, "awkward", b.inputs, b.outputs, b.initializers,
                              value_info=[helper.make_tensor_value_info("w", TensorProto.FLOAT16, None),
                                          helper.make_tensor_value_info("y", TensorProto.INT8, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _plain_constant_proto(index: GraphIndex, tensor: str):
    source = index.constant_source(tensor)
    if source is None:
        return None
    if source in index.initializers:
        return index.initializers[source]
    return index.producer[source].attr("value")


def test_constant_answers_equal_the_identity_walk():
    index = GraphIndex(_awkward_model())
    names = index.all_tensor_names() + ("", "missing")
    constants = {t for t in names if index.is_constant(t)}
    assert constants == {t for t in names if index.constant_source(t) is not None}
    assert {"w", "c", "id_short2", "id_long6"} <= constants
    assert not constants & {"cf", "id_long8", "input", "y"}
    for tensor in names:
        assert index.constant_proto(tensor) == _plain_constant_proto(index, tensor), tensor
        proto = _plain_constant_proto(index, tensor)
        assert index.constant_shape(tensor) == (None if proto is None else tuple(int(d) for d in proto.dims))


def test_dtype_prefers_the_initializer_then_the_declaration_then_the_constant():
    index = GraphIndex(_awkward_model())
    assert index.dtype("w") == TensorProto.FLOAT        # value_info says FLOAT16: the initializer wins
    assert index.dtype("y") == TensorProto.INT8         # declared only
    assert index.dtype("id_short1") == TensorProto.FLOAT  # through Identity to the Constant's value
    assert index.dtype("s") is None
    assert index.is_float_or_unknown("w") and index.is_float_or_unknown("s")
    assert not index.is_float_or_unknown("y")


def test_structure_answers_equal_their_plain_definitions():
    model = _awkward_model()
    index = GraphIndex(model)
    graph = model.graph
    order = {}
    for name in [i.name for i in graph.input] + [o for n in graph.node for o in n.output]:
        order.setdefault(name, len(order))
    assert index.production_order() == order
    assert index.production_order()["input"] == 0           # the graph input comes first, once
    names = dict.fromkeys(i.name for i in graph.input)
    names.update(dict.fromkeys(t.name for t in graph.initializer))
    for node in graph.node:
        names.update(dict.fromkeys(t for t in list(node.input) + list(node.output) if t))
    names.update(dict.fromkeys(sorted(o.name for o in graph.output)))
    assert index.all_tensor_names() == tuple(names)
    assert index.producer["dup"].name == "relu_b"           # the last writer, as before
    assert [(n.name, i) for n, i in index.consumers("s")] == [("relu_a", 0), ("relu_b", 0), ("remake", 0)]
    assert index.consumers("output") == []
    shapes = index.constant_shapes()
    assert shapes["w"] == (4, 4, 1, 1) and shapes["id_short2"] == (4,) and "id_long8" not in shapes


def test_subgraph_nodes_are_the_nodes_holding_graphs():
    b = GraphBuilder("with_if")
    x = b.input("input", [1, 4, 2, 2])
    cond = b.input("cond", [], dtype=TensorProto.BOOL)
    y = b.relu(x, "relu")
    info = helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, [1, 4, 2, 2])
    body = helper.make_graph([helper.make_node("Relu", [y], ["branch_out"], name="inner")], "b", [], [info])
    b.node("If", [cond], "output", name="branch", then_branch=body, else_branch=body)
    b.node("Conv", [y, b.weight("w", [4, 4, 1, 1])], "conv_out", name="conv", kernel_shape=[1, 1])
    b.output("output", [1, 4, 2, 2])
    index = GraphIndex(b.build())
    assert index.subgraph_nodes == {n.name for n in index.nodes if n.has_subgraphs} == {"branch"}


@pytest.mark.parametrize("record, kwargs", [
    (NodeInfo, dict(position=2, name="n", op_type="Relu", domain="", inputs=("a",), outputs=("b",),
                    proto=onnx.NodeProto())),
    (ActivationMark, dict(tensor="t", consumers=(("n", 0),), rule="R4", reason="why", scale_group="g")),
    (WeightMark, dict(tensor="w", node="n", input_index=1, axis=0, rule="R3", reason="why")),
    (Decision, dict(node="n", op_type="Conv", action="quantize", rule="R4", reason="why")),
    (NodeResult, dict(decision=Decision("n", "Relu", "none", "R8", "x"), activations=(), weights=(),
                      shares=(("t", "g"),), subgraphs=())),
])
def test_records_behave_as_frozen_dataclasses(record, kwargs):
    a, b = record(**kwargs), record(*kwargs.values())
    assert a == b and hash(a) == hash(b)
    assert [getattr(a, f.name) for f in dataclasses.fields(a)] == list(kwargs.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(a, next(iter(kwargs)), None)
    first = dataclasses.fields(a)[0].name
    changed = dataclasses.replace(a, **{first: kwargs[first] * 2 if first != "decision" else Decision(
        "m", "Relu", "none", "R8", "x")})
    assert changed != a and getattr(a, first) == kwargs[first]
    assert repr(a).startswith(f"{record.__name__}(") and "proto=" not in repr(a)


def test_record_defaults():
    assert ActivationMark("t", (("n", 0),), "R4", "why").scale_group is None
    result = NodeResult(Decision("n", "Relu", "none", "R8", "x"))
    assert (result.activations, result.weights, result.shares) == ((), (), ())


def _plain_rule10(results, index):
    """Rule 10 as first written: every tensor's marks merged the long way."""
    by_tensor = {}
    for result in results:
        for mark in result.activations:
            by_tensor.setdefault(mark.tensor, []).append(mark)
    parent = {}

    def find(g):
        while parent.setdefault(g, g) != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    tensor_group = {}
    for marks in by_tensor.values():
        for mark in marks:
            if mark.scale_group:
                if mark.tensor in tensor_group:
                    union(tensor_group[mark.tensor], mark.scale_group)
                tensor_group.setdefault(mark.tensor, mark.scale_group)
    for result in results:
        for tensor, group in result.shares:
            if tensor in by_tensor:
                if tensor in tensor_group:
                    union(tensor_group[tensor], group)
                tensor_group.setdefault(tensor, group)
    order = index.production_order()

    def position(node):
        found = index.by_name.get(node)
        return -1 if found is None else found.position

    merged = []
    for tensor in sorted(by_tensor, key=lambda t: (order.get(t, len(order)), t)):
        marks = by_tensor[tensor]
        consumers = sorted({c for m in marks for c in m.consumers}, key=lambda c: (position(c[0]), c[1]))
        rules = ",".join(sorted({m.rule for m in marks}))
        reason = "; ".join(dict.fromkeys(m.reason for m in marks))
        group = find(tensor_group[tensor]) if tensor in tensor_group else None
        merged.append(ActivationMark(tensor, tuple(consumers), rules, reason, scale_group=group))
    return tuple(merged)


@pytest.mark.parametrize("seed", range(6))
def test_rule10_merge_equals_the_plain_merge_on_random_marks(seed):
    """Random marks (lone, repeated, several consumers, scale groups, shares) on a residual chain."""
    rng = np.random.default_rng(seed)
    index = GraphIndex(residual_chain_model(4))
    tensors = [t for t in index.all_tensor_names() if not index.is_constant(t)] + ["not_in_graph"]
    nodes = [n.name for n in index.nodes]
    results = []
    for node in index.nodes:
        marks = []
        for _ in range(int(rng.integers(0, 3))):
            consumers = tuple((nodes[int(rng.integers(len(nodes)))], int(rng.integers(2)))
                              for _ in range(int(rng.integers(1, 3))))
            group = [None, None, "concat:a", "concat:b"][int(rng.integers(4))]
            marks.append(ActivationMark(tensors[int(rng.integers(len(tensors)))], consumers,
                                        f"R{int(rng.integers(4, 8))}", f"reason {int(rng.integers(3))}",
                                        scale_group=group))
        shares = ((tensors[int(rng.integers(len(tensors)))], "concat:c"),) if rng.random() < 0.1 else ()
        decision = Decision(node.name, node.op_type, "none", "-", "")
        results.append(NodeResult(decision, tuple(marks), (), shares))
    merged = rule10_merge(results, index)
    assert merged == _plain_rule10(results, index)
    assert any(len(m.consumers) > 1 for m in merged) and any(len(m.consumers) == 1 for m in merged)


def test_assign_node_names_names_the_unnamed_and_keeps_the_rest():
    b = GraphBuilder("names")
    x = b.input("input", [1, 2])
    y = b.node("Relu", [x], "a", name="r")
    y = b.node("Relu", [y], "b", name="r")
    b.node("Relu", [y], "output", name="r")
    b.output("output")
    model = b.build()
    model.graph.node[1].name = ""
    expected = unique_node_names(model.graph.node)
    assign_node_names(model)
    assert [n.name for n in model.graph.node] == expected == ["r", "Relu_1", "r_1"]
    assign_node_names(model)  # already unique: unchanged
    assert [n.name for n in model.graph.node] == expected


def test_index_assigning_names_equals_assign_node_names_then_index():
    """GraphIndex(model, assign_names=True) names the nodes as assign_node_names does (main graph and
    If branches), in its one read of the nodes, and knows the same nodes holding subgraphs."""
    from tests.builders import if_cnn_model

    for build in (lambda: residual_chain_model(3), if_cnn_model):
        model = build()
        model.graph.node[1].name = ""
        model.graph.node[2].name = model.graph.node[0].name  # a name twice
        for node in model.graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    attribute.g.node[0].name = ""  # an unnamed node inside a branch
        plain, fused = onnx.ModelProto(), onnx.ModelProto()
        plain.CopyFrom(model)
        fused.CopyFrom(model)
        assign_node_names(plain)
        expected = GraphIndex(plain)
        index = GraphIndex(fused, assign_names=True)
        assert fused == plain
        assert [n.name for n in index.nodes] == [n.name for n in expected.nodes]
        assert index.subgraph_nodes == expected.subgraph_nodes
    assert GraphIndex(if_cnn_model(), assign_names=True).subgraph_nodes  # the If is found


def _decoding_model() -> onnx.ModelProto:
    """Initializers of every form `GraphIndex.decode_initializers` meets: float32, float16 and float64 raw
    bytes (scalars, empty, 4-D), float32 in ``float_data``, int8 raw bytes, and raw bytes that do not fit
    their dims (left to `tensor_array`)."""
    rng = np.random.default_rng(11)
    forms = [((4, 3, 1, 1), np.float32), ((), np.float32), ((0, 2), np.float32), ((5,), np.float16),
             ((2, 3), np.float64), ((7, 2), np.float32), ((3,), np.int8)]
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(dtype), f"t{i}")
             for i, (shape, dtype) in enumerate(forms)]
    inits.append(helper.make_tensor("listed", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0]))
    short = onnx.TensorProto(name="short", data_type=TensorProto.FLOAT, dims=[3], raw_data=b"\0" * 8)
    nodes = [helper.make_node("Identity", ["input"], ["output"], name="id")]
    graph = helper.make_graph(nodes, "decoding",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1])],
                              inits + [short])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("join_most", [1 << 24, 40, 1])
def test_decode_initializers_gives_what_tensor_array_gives(monkeypatch, join_most):
    """Each array after `decode_initializers` is `tensor_array`'s (values, type, shape, read-only), the flat
    arrays returned hold every value of the names once, whatever the size of the joined buffers."""
    from onnx_qat.graph import index as index_module
    from onnx_qat.io.models import tensor_array

    monkeypatch.setattr(index_module, "JOIN_MOST", join_most)
    model = _decoding_model()
    protos = {t.name: t for t in model.graph.initializer}
    names = [n for n in protos if n != "short"]
    index = GraphIndex(model)
    index.initializer_array("t5")  # decoded before: returned whole
    flat = list(index.decode_initializers(names + ["t0"]))
    assert sum(a.size for a in flat) == sum(tensor_array(protos[n]).size for n in names)
    values = sorted(float(v) for a in flat for v in a.reshape(-1).astype(np.float64))
    expected = sorted(float(v) for n in names for v in tensor_array(protos[n]).reshape(-1).astype(np.float64))
    assert values == expected
    for name in names:
        got, want = index.initializer_array(name), tensor_array(protos[name])
        assert got.dtype == want.dtype and got.shape == want.shape and not got.flags.writeable
        assert np.array_equal(got, want)
    with pytest.raises(ValueError):  # raw bytes that do not fit: as tensor_array has it
        list(index.decode_initializers(["short"]))
    with pytest.raises(KeyError):
        list(index.decode_initializers(["input"]))


def test_a_large_weight_is_decoded_each_time_and_not_kept(monkeypatch):
    """A weight of `JOIN_MOST` bytes or more is not kept by the index (kept, every large weight of a
    model over 2 GB was held twice, its protobuf bytes and its array): each `initializer_array` call
    decodes it anew, equal values, while a smaller one is decoded once; `decode_initializers` decodes a
    large one when its array is asked for (a generator)."""
    from onnx_qat.graph import index as index_module

    monkeypatch.setattr(index_module, "JOIN_MOST", 40)  # t0 (48 bytes) and t4 (48) large, t3 (10) small
    model = _decoding_model()
    index = GraphIndex(model)
    arrays = index.decode_initializers(["t0", "t3", "t4"])
    first = next(arrays)
    assert first.size == 12
    rest = list(arrays)
    assert sum(a.size for a in rest) == 5 + 6
    assert index.initializer_array("t0") is not index.initializer_array("t0")
    assert np.array_equal(index.initializer_array("t0"), index.initializer_array("t0"))
    assert index.initializer_array("t3") is index.initializer_array("t3")


def test_constant_shapes_of_some_names_and_has_tensor():
    index = GraphIndex(_awkward_model())
    names = index.all_tensor_names() + ("", "missing")
    every = index.constant_shapes()
    for only in ([], ["w"], ["id_short2", "missing"], list(names), ["id_long8", "c", "y"]):
        assert index.constant_shapes(only) == {t: s for t, s in every.items() if t in only}, only
    found = {t for t in names if index.has_tensor(t)}
    graph = {*index.graph_inputs, *index.graph_outputs, *index.initializers, *index.producer}
    assert found == graph and found <= set(index.all_tensor_names())
    assert not index.has_tensor("missing") and not index.has_tensor("")
