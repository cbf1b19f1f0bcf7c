"""The subgraph rule: If branches are placed, calibrated and quantized as graphs of their own.

Built on :func:`tests.builders.if_cnn_model` (a small CNN in each branch, the branch chosen by the
sign of the input's mean): calibration observes each branch on the batches that take it, the Q/DQ
go inside the branches (weights that are branch initializers, Constant nodes inside the branch or
initializers of the main graph), the result runs in onnxruntime close to the float model on both
branches and passes check cleanly.
"""
import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.calibration.branches import BranchRunner
from onnx_qat.errors import ModelError
from onnx_qat.formats.scale_grid import on_fp16_grid
from onnx_qat.graph.subgraphs import inline_branches
from tests.builders import amax_table, assert_check_clean, cosine, if_cnn_model, run


def _data(signs, seed=0, scale=1.0):
    """One sample [1,3,8,8] per sign: standard-normal values (x ``scale``) shifted by ``sign``."""
    rng = np.random.default_rng(seed)
    return np.concatenate([(rng.standard_normal((1, 3, 8, 8)) + s) * scale for s in signs]).astype(np.float32)


def _branch(model, name):
    node = next(n for n in model.graph.node if n.op_type == "If")
    return next(a.g for a in node.attribute if a.name == name)


def _ops(graph):
    return sorted(n.op_type for n in graph.node)


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 255.0)])
def test_subgraph_rule_if_cnn_calibrated_quantized_and_close_to_float(seed, scale):
    model = if_cnn_model(seed=seed)
    calib = {"input": _data([1, -1, 1, -1, 1, -1], seed=seed, scale=scale)}
    result = onnx_qat.quantize(model, data=calib, batch_size=1, progress=False)
    out = result.model
    assert_check_clean(out)
    then_ops, else_ops = _ops(_branch(out, "then_branch")), _ops(_branch(out, "else_branch"))
    # then: a_conv1, a_conv2 (activation + weight each); the outer 'stem' feeds a_conv1 and is the skip
    # of a_add: one pair for both (rule 10)
    assert then_ops.count("QuantizeLinear") == 2 and then_ops.count("DequantizeLinear") == 4, then_ops
    stem_q = next(n for n in _branch(out, "then_branch").node if n.op_type == "QuantizeLinear"
                  and n.input[0] == "stem_relu_out")
    readers = [n.name for n in _branch(out, "then_branch").node
               if any(i.startswith("stem_relu_out_DequantizeLinear") for i in n.input)]
    assert stem_q and sorted(readers) == ["a_add", "a_conv1"]
    # else: b_conv1 (Constant weight) and b_conv2 (main-graph initializer weight)
    assert else_ops.count("QuantizeLinear") == 2 and else_ops.count("DequantizeLinear") == 4, else_ops
    assert "Constant" not in else_ops  # the float weight's Constant node is replaced by its int8 copy
    # the main graph's float 'shared_w', read only by the quantized b_conv2, is gone with it
    assert "shared_w" in {t.name for t in model.graph.initializer}
    assert "shared_w" not in {t.name for t in out.graph.initializer}
    assert {r.get("subgraph") for r in result.inserted} == {None, "choose/then_branch", "choose/else_branch"}
    for k, signs in enumerate(([1], [-1], [1], [-1])):  # held-out samples of the calibration's kind
        feeds = {"input": _data(signs, seed=seed + 10 + k, scale=scale)}
        ref, got = run(model, feeds)[0], run(out, feeds)[0]
        assert cosine(ref, got) > 0.99, signs
        assert np.abs(ref - got).max() < 0.1 * np.abs(ref).max(), signs


def test_calibration_observes_each_branch_on_the_batches_that_take_it():
    model = if_cnn_model()
    positive, negative = _data([1, 2], seed=3), _data([-1, -2], seed=4)
    tensors = ["a_relu1_out", "b_relu1_out", "stem_relu_out"]
    table = onnx_qat.calibrate(model, {"input": np.concatenate([positive, negative])}, tensors=tensors,
                               batch_size=1, method="max", progress=False)
    # independent reference: max |x| of each tensor on the float model with the branch inlined,
    # fed only the samples that take that branch (raised to the FP16 grid of scales as calibration
    # raises every range, onnx_qat.formats.scale_grid)
    then_model, else_model = inline_branches(model, {4: True}), inline_branches(model, {4: False})
    want_then = on_fp16_grid(amax_table(then_model, {"input": positive}, ["a_relu1_out"]).activations[
        "a_relu1_out"], 127.0)
    want_else = on_fp16_grid(amax_table(else_model, {"input": negative}, ["b_relu1_out"]).activations[
        "b_relu1_out"], 127.0)
    assert table.activations["a_relu1_out"] == pytest.approx(want_then, rel=1e-6)
    assert table.activations["b_relu1_out"] == pytest.approx(want_else, rel=1e-6)
    both = np.concatenate([positive, negative])
    assert table.activations["stem_relu_out"] == pytest.approx(on_fp16_grid(
        amax_table(model, {"input": both}, ["stem_relu_out"]).activations["stem_relu_out"], 127.0), rel=1e-6)


def test_branch_no_calibration_batch_takes_stays_float_with_a_note():
    model = if_cnn_model()
    result = onnx_qat.quantize(model, data={"input": _data([1, 2, 1])}, batch_size=1, progress=False)
    assert any("else_branch" in note for note in result.placement.notes)
    assert [s.attribute for s in result.placement.subgraphs] == ["then_branch"]
    assert "QuantizeLinear" not in _ops(_branch(result.model, "else_branch"))
    assert "QuantizeLinear" in _ops(_branch(result.model, "then_branch"))
    assert_check_clean(result.model)


def test_given_scale_table_quantizes_both_branches():
    model = if_cnn_model()
    names = onnx_qat.place(model).activation_tensors()
    table = onnx_qat.ScaleTable({n: 4.0 for n in names})
    out = onnx_qat.quantize(model, scales=table, progress=False).model
    assert "QuantizeLinear" in _ops(_branch(out, "then_branch"))
    assert "QuantizeLinear" in _ops(_branch(out, "else_branch"))
    onnx.checker.check_model(out, full_check=True)
    assert_check_clean(out)


def test_branch_runner_refuses_a_tensor_it_cannot_reach():
    model = if_cnn_model()
    with pytest.raises(ModelError, match="not a tensor of the model"):
        BranchRunner(model, ["no_such_tensor"])


def _nested_if_model():
    """:func:`if_cnn_model` whose If ``choose`` sits in the then_branch of an outer If ``gate`` (on a
    graph input ``use_cnn``); the else_branch passes ``stem_relu_out`` through."""
    from onnx import TensorProto, helper

    model = if_cnn_model()
    graph = model.graph
    inner = next(n for n in graph.node if n.op_type == "If")
    chosen = inner.output[0]
    inner.output[0] = "inner_chosen"
    info = helper.make_tensor_value_info
    then_g = helper.make_graph([inner], "gate_then", [], [info("inner_chosen", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["stem_relu_out"], ["passed"], name="pass")],
                               "gate_else", [], [info("passed", TensorProto.FLOAT, None)])
    gate = helper.make_node("If", ["use_cnn"], [chosen], name="gate", then_branch=then_g, else_branch=else_g)
    nodes = [gate if n is inner else n for n in graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.append(info("use_cnn", TensorProto.BOOL, []))
    onnx.checker.check_model(model)
    return model


def test_subgraph_rule_nested_ifs_are_calibrated_and_quantized_depth_first():
    model = _nested_if_model()
    x = _data([1, -1, 1, -1])
    calib = {"input": x, "use_cnn": np.ones(4, bool)}
    result = onnx_qat.quantize(model, data=calib, batch_size=1, progress=False)
    assert_check_clean(result.model)
    (outer,) = result.placement.subgraphs
    assert (outer.node, outer.attribute) == ("gate", "then_branch")
    assert sorted(s.attribute for s in outer.placement.subgraphs) == ["else_branch", "then_branch"]
    gate = next(n for n in result.model.graph.node if n.op_type == "If")
    inner = next(n for a in gate.attribute if a.name == "then_branch" for n in a.g.node if n.op_type == "If")
    for attribute in inner.attribute:
        assert "QuantizeLinear" in _ops(attribute.g), attribute.name
    for k, sign in enumerate([1, -1]):
        feeds = {"input": _data([sign], seed=20 + k), "use_cnn": np.array(True)}
        ref, got = run(model, feeds)[0], run(result.model, feeds)[0]
        assert cosine(ref, got) > 0.99 and np.abs(ref - got).max() < 0.1 * np.abs(ref).max()


def test_if_with_a_tensor_name_defined_in_both_branches_is_left_untouched():
    model = if_cnn_model()
    node = next(n for n in model.graph.node if n.op_type == "If")
    branches = {a.name: a.g for a in node.attribute}
    relu = next(n for n in branches["else_branch"].node if n.name == "b_relu1")
    renamed = relu.output[0]
    for n in branches["else_branch"].node:  # b_relu1 now writes 'a_relu1_out', a then_branch name too
        n.input[:] = ["a_relu1_out" if t == renamed else t for t in n.input]
    relu.output[0] = "a_relu1_out"
    placement = onnx_qat.place(model)
    decision = placement.decision_for("choose")
    assert decision.action == "skip" and "not unique" in decision.reason
    assert not placement.subgraphs and any("'choose'" in note for note in placement.notes)


def test_a_model_quantized_inside_a_branch_is_refused():
    model = if_cnn_model()
    options = {"exclude_nodes": ["stem_conv", "head_conv"]}  # Q/DQ only inside the branches
    table = onnx_qat.ScaleTable({n: 4.0 for n in onnx_qat.place(model, **options).activation_tensors()})
    once = onnx_qat.quantize(model, scales=table, progress=False, **options).model
    assert "QuantizeLinear" in _ops(_branch(once, "then_branch"))
    assert "QuantizeLinear" not in _ops(once.graph)
    with pytest.raises(onnx_qat.PlacementError, match="already quantized"):
        onnx_qat.quantize(once, scales=table, progress=False)


def test_a_given_placement_naming_a_missing_branch_is_refused():
    import dataclasses

    model = if_cnn_model()
    placement = onnx_qat.place(model)
    sub = dataclasses.replace(placement.subgraphs[0], attribute="body")
    bad = dataclasses.replace(placement, subgraphs=(sub,))
    table = onnx_qat.ScaleTable({n: 4.0 for n in placement.activation_tensors()})
    with pytest.raises(onnx_qat.PlacementError, match="subgraph 'body' of node 'choose'"):
        onnx_qat.quantize(model, scales=table, placement=bad, progress=False)
    out = onnx_qat.quantize(model, scales=table, placement=placement, progress=False).model
    assert "QuantizeLinear" in _ops(_branch(out, "else_branch"))


def test_a_float_weight_the_main_graph_also_reads_stays():
    """'shared_w' read by b_conv2 inside the else branch and by a node of the main graph: the branch
    reads its int8 copy, the main graph still needs the float one."""
    from onnx import TensorProto, helper

    model = if_cnn_model(seed=0)
    model.graph.node.append(helper.make_node("ReduceSum", ["shared_w"], ["w_sum"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("w_sum", TensorProto.FLOAT, []))
    result = onnx_qat.quantize(model, data={"input": _data([1, -1])}, batch_size=1, progress=False)
    assert "shared_w" in {t.name for t in result.model.graph.initializer}
    else_ops = _ops(_branch(result.model, "else_branch"))
    assert else_ops.count("DequantizeLinear") == 4, else_ops
    feeds = {"input": _data([-1], seed=5)}
    assert np.allclose(run(model, feeds)[1], run(result.model, feeds)[1])
