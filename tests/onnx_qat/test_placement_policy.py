"""Placement on its own: marks and decisions only, never an inserted node."""
import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.placement import TensorRTPolicy
from onnx_qat.graph.index import GraphIndex, unique_node_names
from onnx_qat.placement.handlers import rule3_weight_axis
from tests.builders import (
    GraphBuilder, assert_check_clean, concat_model, conv_bn_relu_model, lines_executed, residual_block_model,
    residual_chain_model, transformer_block_model,
)


def _digest(model):
    return model.SerializeToString(deterministic=True)


def test_place_returns_marks_and_leaves_the_model_alone():
    model = residual_block_model()
    before = _digest(model)
    placement = onnx_qat.place(model)
    assert _digest(model) == before
    assert placement.activation_tensors() == ("input", "relu1_out", "stem_relu_out")
    assert placement.weight_tensors() == ("conv1.weight", "conv2.weight", "stem_conv.weight")
    assert [d.node for d in placement.decisions] == [n.name for n in model.graph.node]
    consumers = {m.tensor: m.consumers for m in placement.activations}
    assert consumers["stem_relu_out"] == (("conv1", 0), ("add", 1))


def test_policy_is_a_table_with_shared_handlers():
    policy = TensorRTPolicy()
    assert policy.handler("Conv") is policy.handler("Gemm") is policy.handler("MatMul")
    assert policy.handler("MaxPool") is policy.handler("Reshape")
    assert policy.handler("SomeUnknownOp") is policy.default
    with pytest.raises(TypeError):
        policy.table["Conv"] = None  # the table is read-only


def test_exclude_nodes_uses_full_regex_match():
    model = residual_block_model()
    placement = onnx_qat.place(model, exclude_nodes=["conv"])  # matches no node fully
    assert placement.decision_for("conv1").action == "quantize"
    placement = onnx_qat.place(model, exclude_nodes=["conv[12]"])
    for name in ("conv1", "conv2"):
        d = placement.decision_for(name)
        assert (d.action, d.rule) == ("skip", "exclude")
    assert placement.decision_for("stem_conv").action == "quantize"
    # conv2 is excluded, so the residual Add no longer has a quantized weighted branch
    assert placement.decision_for("add").action == "none"
    assert "relu1_out" not in placement.activation_tensors()


def test_exclude_op_types():
    placement = onnx_qat.place(concat_model(), exclude_op_types=["Concat"])
    d = placement.decision_for("concat")
    assert (d.action, d.rule) == ("skip", "exclude")
    assert not any(m.scale_group for m in placement.activations)


def test_config_object_and_keyword_options_combine():
    config = onnx_qat.QuantizeConfig(exclude_op_types=("Gemm",))
    placement = onnx_qat.place(transformer_block_model(), config=config, include_attention=True)
    assert placement.decision_for("scores").action == "quantize"
    with pytest.raises(onnx_qat.ConfigError):
        onnx_qat.place(conv_bn_relu_model(), bogus=1)


def _constant_weight_model(via_identity: bool):
    b = GraphBuilder("const_weight")
    x = b.input("input", [1, 16, 4, 4])
    array = np.random.default_rng(0).standard_normal((16, 16, 1, 1)).astype(np.float32)
    value = numpy_helper.from_array(array, "v")
    w = b.node("Constant", [], "w_const", name="weight_const", value=value)
    if via_identity:
        w = b.node("Identity", [w], "w_ident", name="weight_identity")
    b.node("Conv", [x, w], "output", name="conv", kernel_shape=[1, 1])
    b.output("output")
    return b.build()


@pytest.mark.parametrize("via_identity", [False, True])
def test_weights_given_as_constant_nodes(via_identity):
    model = _constant_weight_model(via_identity)
    placement = onnx_qat.place(model)
    (mark,) = placement.weights
    assert mark.tensor == ("w_ident" if via_identity else "w_const") and mark.axis == 0
    table = onnx_qat.ScaleTable({"input": 3.0})
    out = onnx_qat.quantize(model, scales=table, progress=False).model
    ops = [n.op_type for n in out.graph.node]
    assert "Constant" not in ops and "Identity" not in ops, ops  # dead weight producers are dropped
    assert ops.count("DequantizeLinear") == 2


def _if_model():
    """``conv`` (main graph) -> If ``branch``: then ``then_conv`` (reads the outer ``conv_out``, weight a
    branch initializer), else ``else_relu``."""
    b = GraphBuilder("with_if")
    x = b.input("input", [1, 16, 4, 4])
    cond = b.input("cond", [], dtype=TensorProto.BOOL)
    y = b.conv(x, 16, 16, "conv", k=1)
    branch_w = numpy_helper.from_array(np.ones((16, 16, 1, 1), np.float32), "branch_w")

    def out_info(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 16, 4, 4])

    then_g = helper.make_graph([helper.make_node("Conv", [y, "branch_w"], ["then_out"], name="then_conv")],
                               "then", [], [out_info("then_out")], [branch_w])
    else_g = helper.make_graph([helper.make_node("Relu", [y], ["else_out"], name="else_relu")], "else",
                               [], [out_info("else_out")])
    b.node("If", [cond], "output", name="branch", then_branch=then_g, else_branch=else_g)
    b.output("output", [1, 16, 4, 4])
    return b.build()


def test_subgraph_rule_if_branch_is_placed_as_a_graph_of_its_own():
    model = _if_model()
    placement = onnx_qat.place(model)
    decision = placement.decision_for("branch")
    assert decision.action == "quantize" and decision.rule == "subgraph", decision
    assert placement.decision_for("conv").action == "quantize"
    (sub,) = placement.subgraphs
    assert (sub.node, sub.attribute) == ("branch", "then_branch")
    assert [(m.tensor, m.consumers) for m in sub.placement.activations] == [("conv_out", (("then_conv", 0),))]
    assert [(w.tensor, w.axis) for w in sub.placement.weights] == [("branch_w", 0)]
    assert placement.activation_tensors() == ("conv_out", "input")
    out = onnx_qat.quantize(model, scales=onnx_qat.ScaleTable({"input": 3.0, "conv_out": 4.0}),
                            progress=False).model
    if_node = next(n for n in out.graph.node if n.op_type == "If")
    branches = {a.name: [n.op_type for n in a.g.node] for a in if_node.attribute}
    assert sorted(branches["then_branch"]) == ["Conv", "DequantizeLinear", "DequantizeLinear",
                                               "QuantizeLinear"]
    assert branches["else_branch"] == ["Relu"]
    assert_check_clean(out)


def test_loop_body_placed_as_a_graph_of_its_own():
    b = GraphBuilder("with_loop")
    x = b.input("input", [1, 16, 4, 4])
    y = b.conv(x, 16, 16, "conv", k=1)
    body_w = numpy_helper.from_array(np.ones((16, 16, 1, 1), np.float32), "body_w")
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
         helper.make_node("Conv", ["carried", "body_w"], ["carried_out"], name="body_conv")],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carried", TensorProto.FLOAT, [1, 16, 4, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carried_out", TensorProto.FLOAT, [1, 16, 4, 4])], [body_w])
    trips = b.const("trips", np.array(2, np.int64))
    b.node("Loop", [trips, "", y], "output", name="loop", body=body)
    b.output("output", [1, 16, 4, 4])
    model = b.build()
    placement = onnx_qat.place(model)
    assert placement.decision_for("loop").action == "quantize"
    assert placement.decision_for("loop").rule == "subgraph"
    assert placement.decision_for("conv").action == "quantize"
    [sub] = placement.subgraphs
    assert (sub.node, sub.attribute) == ("loop", "body")
    # the loop-carried body input is an activation of the body graph, quantized before the body's Conv
    assert [(m.tensor, m.consumers) for m in sub.placement.activations] == [("carried", (("body_conv", 0),))]
    assert [w.tensor for w in sub.placement.weights] == ["body_w"]
    assert not placement.notes
    scales = onnx_qat.ScaleTable({"input": 3.0, "carried": 3.0})
    out = onnx_qat.quantize(model, scales=scales, progress=False).model
    loop = next(n for n in out.graph.node if n.op_type == "Loop")
    assert sorted(n.op_type for a in loop.attribute for n in a.g.node) == [
        "Conv", "DequantizeLinear", "DequantizeLinear", "Identity", "QuantizeLinear"]


def test_custom_domain_ops_left_alone():
    b = GraphBuilder("custom")
    x = b.input("input", [1, 16, 4, 4])
    y = b.node("MyOp", [x], name="custom", domain="com.example")
    b.node("Conv", [y, b.weight("w", [16, 16, 1, 1])], "output", name="conv", kernel_shape=[1, 1])
    b.output("output", [1, 16, 4, 4])
    graph = helper.make_graph(b.nodes, "custom", b.inputs, b.outputs, b.initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    placement = onnx_qat.place(model)
    d = next(d for d in placement.decisions if d.node == "custom")
    assert (d.action, d.rule) == ("none", "domain")
    assert placement.activation_tensors() == ("custom_out",)


def test_unnamed_nodes_get_stable_unique_names():
    nodes = [helper.make_node("Relu", ["a"], ["b"]), helper.make_node("Relu", ["b"], ["c"], name="Relu_0"),
             helper.make_node("Relu", ["c"], ["d"], name="x"),
             helper.make_node("Relu", ["d"], ["e"], name="x")]
    assert unique_node_names(nodes) == ["Relu_0", "Relu_0_1", "x", "x_1"]


def test_every_decision_is_logged_at_debug_with_its_reason(caplog):
    model = residual_block_model()
    with caplog.at_level(logging.DEBUG, logger="onnx_qat.placement"):
        placement = onnx_qat.place(model)
    text = "\n".join(r.getMessage() for r in caplog.records)
    for d in placement.decisions:
        assert repr(d.node) in text and d.reason in text


def test_placement_is_deterministic():
    model = transformer_block_model()
    assert onnx_qat.place(model) == onnx_qat.place(model)
    assert onnx_qat.place(model).table() == onnx_qat.place(transformer_block_model()).table()


def test_rule3_axis_helper_documents_convtranspose_choice():
    index = GraphIndex(residual_block_model())
    assert rule3_weight_axis(index.by_name["conv1"], (16, 16, 3, 3))[0] == 0
    assert "axis 1" in rule3_weight_axis.__doc__ and "ConvTranspose" in rule3_weight_axis.__doc__


def test_table_and_dict_forms():
    placement = onnx_qat.place(residual_block_model(projection=True))
    text = placement.table()
    assert "add" in text and "R6" in text and "shorter branch" in text
    data = placement.to_dict()
    assert {d["node"] for d in data["decisions"]} >= {"add", "conv1", "proj_conv"}
    assert placement.counts()["activations"] == 4


def test_placement_work_grows_linearly_with_graph_size():
    """Python lines executed by onnx_qat.place (a clock-free measure, tests/builders.lines_executed) at
    4x the nodes: ~4x for linear work, ~16x for a per-node graph search."""
    def lines(blocks):
        model = residual_chain_model(blocks)
        placement, count = lines_executed(lambda: onnx_qat.place(model))
        assert len(placement.decisions) == 4 * blocks
        return count

    small, large = lines(200), lines(800)
    assert 3 * small < large < 4.5 * small, (small, large)


def test_rule10_two_marks_merge_as_the_general_case():
    """The two-mark shortcut of rule 10 makes the same mark as the general merge (sets, sorts and joins),
    over consumers in either order, the same consumer twice, equal and different rules and reasons, and
    consumers the graph does not have (their order then a tie: the general case decides)."""
    import itertools

    from onnx_qat.placement.marks import ActivationMark
    from onnx_qat.placement.policy import _merged_pair

    b = GraphBuilder("chain")
    x = b.input("input", [1, 4, 2, 2])
    b.output(b.relu(b.relu(x, "r0"), "r1"), [1, 4, 2, 2])
    index = GraphIndex(b.build())
    assert [n.name for n in index.nodes] == ["r0", "r1"]

    def graph_order(consumer):
        node = index.by_name.get(consumer[0])
        return -1 if node is None else node.position, consumer[1]

    def general(tensor, marks, group):
        consumers = sorted({c for m in marks for c in m.consumers}, key=graph_order)
        rules = ",".join(sorted({m.rule for m in marks}))
        reason = "; ".join(dict.fromkeys([m.reason for m in marks]))
        return ActivationMark(tensor, tuple(consumers), rules, reason, scale_group=group)

    consumers = [("r0", 0), ("r1", 0), ("r1", 1), ("gone", 0), ("other", 0)]
    taken = 0
    for (c1, c2), (r1, r2), (w1, w2), group in itertools.product(
            itertools.product(consumers, repeat=2), [("R4", "R4"), ("R6", "R4"), ("R4", "R6")],
            [("a", "a"), ("a", "b"), ("b", "a")], (None, "g")):
        first, second = ActivationMark("t", (c1,), r1, w1), ActivationMark("t", (c2,), r2, w2)
        found = _merged_pair("t", first, second, group, graph_order)
        if found is None:  # only a tie of graph order between different consumers
            assert c1 != c2 and graph_order(c1) == graph_order(c2)
            continue
        taken += 1
        assert found == general("t", [first, second], group)
    assert taken > 200
    two = ActivationMark("t", (("r0", 0), ("r1", 0)), "R4", "a")
    assert _merged_pair("t", two, ActivationMark("t", (("r1", 0),), "R4", "a"), None, graph_order) is None
