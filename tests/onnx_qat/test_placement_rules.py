"""One test per TensorRT placement rule (the rules R1-R10 of docs/placement.md), on tiny graphs built in code.

Each test quantizes a tiny model with a max-calibrated ScaleTable and asserts the exact
Q/DQ structure; the graph assertions print the offending subgraph when they fail.
"""
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qat
from tests.builders import (
    GraphBuilder, amax_table, assert_check_clean, assert_float_input, assert_no_qdq_on,
    assert_qdq_on, assert_weight_quantized, concat_model, count_ops, describe, mlp_model,
    opset9_model,
    qdq_pairs, random_inputs, residual_block_model, run, transformer_block_model, weight_dqs,
)


def qdq(model, **options):
    """Quantize ``model`` with ranges measured on seeded random inputs."""
    table = amax_table(model, random_inputs(model))
    model = onnx_qat.quantize(model, scales=table, progress=False, **options).model
    if options.get("target", "tensorrt") == "tensorrt":
        assert_check_clean(model)  # the rewriter's output passes its own check cleanly
    return model


def _initializers(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _conv_chain_model(tail):
    """input -> conv1 -> <tail ops> -> conv2 -> output; ``tail(b, x)`` returns the tensor fed to conv2."""
    b = GraphBuilder("chain", seed=3)
    x = b.input("input", [1, 16, 8, 8])
    y = tail(b, b.conv(x, 16, 16, "conv1"))
    b.node("Conv", [y, b.weight("conv2.weight", [16, 16, 3, 3])], "output", name="conv2",
           kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    b.output("output")
    return b.build()


# --------------------------------------------------------------------------- rule 1
def test_rule1_only_quantize_dequantize_ops_and_opset_13():
    model = residual_block_model(projection=True)
    out = qdq(model)
    before, after = count_ops(model), count_ops(out)
    added = set(after) - set(before)
    assert added == {"QuantizeLinear", "DequantizeLinear"}, added
    assert not [op for op in after if op.startswith("QLinear") or op.endswith("Integer")]
    for op, n in before.items():
        assert after[op] == n, f"{op}: {n} -> {after[op]}"
    opset = {o.domain: o.version for o in out.opset_import}
    assert opset.get("", opset.get("ai.onnx")) >= 13
    # no int32 bias DequantizeLinear: every DQ input is int8
    inits = _initializers(out)
    prod = {o: n for n in out.graph.node for o in n.output}
    for n in out.graph.node:
        if n.op_type == "DequantizeLinear":
            src = inits.get(n.input[0])
            if src is not None:
                assert src.dtype == np.int8
            else:
                assert prod[n.input[0]].op_type == "QuantizeLinear"
    onnx.checker.check_model(out, full_check=True)


def test_rule1_old_opset_model_is_upgraded():
    out = qdq(opset9_model())
    opset = {o.domain: o.version for o in out.opset_import}
    assert opset.get("", opset.get("ai.onnx")) >= 13
    assert_weight_quantized(out, "conv", axis=0)
    assert_weight_quantized(out, "fc", axis=0)
    run(out, random_inputs(out))


# --------------------------------------------------------------------------- rule 2
def test_rule2_symmetric_int8_zero_point_and_scale_amax_over_127():
    model = mlp_model()
    table = amax_table(model, random_inputs(model))
    out = onnx_qat.quantize(model, scales=table, progress=False).model
    inits = _initializers(out)
    for n in out.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        scale, zp = inits[n.input[1]], inits[n.input[2]]
        assert zp.dtype == np.int8 and not zp.any(), n.name
        assert np.all(np.isfinite(scale)) and np.all(scale > 0) and scale.dtype == np.float32
    for tensor in qdq_pairs(out):
        q = next(n for n in out.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
        assert inits[q.input[1]] == np.float32(table.activations[tensor] / 127.0)
        assert inits[q.input[1]].shape == ()
    for info in weight_dqs(out).values():
        assert info["values"].min() >= -127 and info["values"].max() <= 127


# --------------------------------------------------------------------------- rule 3
def _weighted_model(op, weight_shape, **attrs):
    b = GraphBuilder("weighted", seed=1)
    if op == "MatMul":
        x = b.input("input", [3, 2, weight_shape[-2]] if len(weight_shape) == 3 else [2, weight_shape[0]])
    elif op == "Gemm":
        x = b.input("input", [2, weight_shape[1] if attrs.get("transB") else weight_shape[0]])
    elif op == "ConvTranspose":
        x = b.input("input", [1, weight_shape[0], 4, 4])
    else:
        x = b.input("input", [1, weight_shape[1] * attrs.get("group", 1), 6, 6])
    w = b.weight("w", weight_shape)
    b.node(op, [x, w], "output", name="op", **attrs)
    b.output("output")
    return b.build()


@pytest.mark.parametrize("op, shape, attrs, axis", [
    ("Conv", [16, 8, 3, 3], {}, 0),
    ("Gemm", [24, 16], {"transB": 1}, 0),
    ("Gemm", [16, 24], {"transB": 0}, 1),
    ("Gemm", [16, 24], {}, 1),
    ("MatMul", [16, 24], {}, 1),
    ("MatMul", [3, 16, 24], {}, 2),
    ("ConvTranspose", [16, 8, 3, 3], {}, 1),
    ("ConvTranspose", [16, 4, 3, 3], {"group": 2}, None),
])
def test_rule3_weight_per_channel_axis(op, shape, attrs, axis):
    out = qdq(_weighted_model(op, shape, **attrs))
    info = assert_weight_quantized(out, "op", axis=axis)
    expected_channels = 1 if axis is None else shape[axis]
    assert info["scale"].size == expected_channels
    assert_qdq_on(out, "input", "op", 0)
    pairs = qdq_pairs(out)
    assert list(pairs) == ["input"]  # the activation is per tensor: one scalar-scale pair
    run(out, random_inputs(out))


# --------------------------------------------------------------------------- rule 4
def test_rule4_weighted_op_quantizes_activation_and_weight_not_output():
    out = qdq(mlp_model())
    assert_qdq_on(out, "input", "fc1", 0)
    assert_weight_quantized(out, "fc1", axis=0)
    assert_qdq_on(out, "relu1_out", "fc2", 0)
    assert_weight_quantized(out, "fc2", axis=1)
    assert_qdq_on(out, "relu2_out", "fc3", 0)
    for output in ("fc1_out", "fc2_out", "fc2_bias_out", "output"):
        assert_no_qdq_on(out, output)
    # biases stay float
    assert_float_input(out, "fc1", 2)
    assert_float_input(out, "fc2_bias", 1)


# --------------------------------------------------------------------------- rule 5
def test_rule5_conv_bn_relu_maxpool_chain_unbroken():
    def tail(b, y):
        y = b.relu(b.bn(y, 16, "bn"), "relu")
        return b.node("MaxPool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])

    out = qdq(_conv_chain_model(tail))
    for inner in ("conv1_out", "bn_out", "relu_out"):
        assert_no_qdq_on(out, inner)
    assert_qdq_on(out, "pool_out", "conv2", 0)
    assert set(qdq_pairs(out)) == {"input", "pool_out"}


def test_rule5_conv_sigmoid_mul_chain_unbroken():
    def tail(b, y):
        s = b.node("Sigmoid", [y], name="sigmoid")
        return b.node("Mul", [y, s], name="swish")

    out = qdq(_conv_chain_model(tail))
    assert_no_qdq_on(out, "conv1_out")
    assert_no_qdq_on(out, "sigmoid_out")
    assert_qdq_on(out, "swish_out", "conv2", 0)


# --------------------------------------------------------------------------- rule 6
def test_rule6_residual_add_quantizes_skip_only():
    out = qdq(residual_block_model())
    assert_qdq_on(out, "stem_relu_out", "add", 1)
    assert_float_input(out, "add", 0)
    assert_no_qdq_on(out, "bn2_out")
    assert_no_qdq_on(out, "add_out")


def test_rule6_projection_shortcut_quantizes_exactly_one_input():
    out = qdq(residual_block_model(projection=True))
    # the shorter branch (the 1x1 projection) is quantized; the main branch stays float for fusion
    assert_qdq_on(out, "proj_bn_out", "add", 1)
    assert_float_input(out, "add", 0)
    assert_no_qdq_on(out, "bn2_out")


def test_rule6_residual_add_through_unfolded_scale_and_bias():
    b = GraphBuilder("unfolded_bn")
    x = b.input("input", [1, 16, 4, 4])
    r = b.relu(x, "relu")
    y = b.conv(r, 16, 16, "conv", bias=False)
    y = b.node("Mul", [y, b.const("bn_scale", np.full((16, 1, 1), 0.9, np.float32))], name="bn_mul")
    y = b.node("Add", [y, b.const("bn_shift", np.full((16, 1, 1), 0.1, np.float32))], name="bn_add")
    b.node("Add", [r, y], "output", name="add")
    b.output("output")
    out = qdq(b.build())
    assert_qdq_on(out, "relu_out", "add", 0)
    assert_float_input(out, "add", 1)
    assert qdq_pairs(out)["relu_out"] == (("add", 0), ("conv", 0))


def test_rule6_add_of_two_plain_activations_left_float():
    b = GraphBuilder("adds")
    x = b.input("input", [1, 16, 4, 4])
    r = b.relu(x, "relu")
    s = b.node("Sigmoid", [x], name="sigmoid")
    y = b.node("Add", [r, s], name="add")
    b.node("Conv", [y, b.weight("w", [16, 16, 1, 1])], "output", name="conv", kernel_shape=[1, 1])
    b.output("output")
    out = qdq(b.build())
    assert_float_input(out, "add", 0)
    assert_float_input(out, "add", 1)
    assert_qdq_on(out, "add_out", "conv", 0)


def _sum_residual_model(extra: int = 0):
    """stem -> conv1 -> bn1 -> Sum ``sum`` (input 0 ``bn1_out``, input 1 the skip ``stem_relu_out``,
    then ``extra`` more inputs: the outputs of 1x1 convs ``side{i}`` of the stem) -> Relu -> conv2."""
    b = GraphBuilder("sum_residual", seed=4)
    x = b.input("input", [1, 16, 8, 8])
    stem = b.relu(b.conv(x, 16, 16, "stem_conv"), "stem_relu")
    y = b.bn(b.conv(stem, 16, 16, "conv1"), 16, "bn1")
    sides = [b.conv(stem, 16, 16, f"side{i}", k=1) for i in range(extra)]
    y = b.relu(b.node("Sum", [y, stem] + sides, name="sum"), "relu")
    b.node("Conv", [y, b.weight("conv2.weight", [16, 16, 3, 3])], "output", name="conv2",
           kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    b.output("output")
    return b.build()


def test_rule6_two_input_sum_is_a_residual_join():
    out = qdq(_sum_residual_model())
    assert_qdq_on(out, "stem_relu_out", "sum", 1)
    assert_float_input(out, "sum", 0)
    assert_no_qdq_on(out, "bn1_out")


def test_rule6b_sum_of_three_inputs_joins_its_first_two_and_keeps_the_rest_float():
    model = _sum_residual_model(extra=1)
    decision = onnx_qat.place(model).decision_for("sum")
    assert decision.action == "quantize" and decision.rule == "R6b", decision
    out = qdq(model)
    assert_qdq_on(out, "stem_relu_out", "sum", 1)
    assert_float_input(out, "sum", 0)
    assert_float_input(out, "sum", 2)
    assert_no_qdq_on(out, "side0_out")
    feeds = random_inputs(model, seed=2)
    ref = run(model, feeds)[0]
    assert np.abs(run(out, feeds)[0] - ref).max() < 0.1 * np.abs(ref).max()


def _hard_swish(b, x, name):
    """``x * HardSigmoid(x)`` written out as exporters write hard-swish (a Mul of two activations)."""
    return b.node("Mul", [x, b.node("HardSigmoid", [x], name=f"{name}_gate", alpha=1 / 6, beta=0.5)],
                  name=name)


def test_rule6_skip_from_a_hard_swish_mul_is_quantized():
    """The skip of a MobileNetV3-style block is a hard-swish Mul: it is quantized for the Add fusion."""
    b = GraphBuilder("hswish_skip", seed=6)
    x = b.input("input", [1, 16, 8, 8])
    h = _hard_swish(b, b.conv(x, 16, 16, "stem_conv"), "hswish")
    y = b.bn(b.conv(b.relu(b.conv(h, 16, 16, "conv1"), "relu1"), 16, 16, "conv2"), 16, "bn2")
    b.node("Add", [y, h], "output", name="add")
    b.output("output")
    out = qdq(b.build())
    assert_qdq_on(out, "hswish_out", "add", 1)
    assert_float_input(out, "add", 0)


def test_rule6_skip_from_a_squeeze_excitation_mul_is_quantized():
    """A block whose output is SE-scaled (``y * sigmoid(fc(gap(y)))``) feeds the next block's Add as
    its skip: quantized, the next block's conv branch stays float."""
    b = GraphBuilder("se_skip", seed=7)
    x = b.input("input", [1, 16, 8, 8])
    y = b.relu(b.conv(x, 16, 16, "conv0"), "relu0")
    gate = b.node("GlobalAveragePool", [y], name="gap")
    fc = b.conv(b.relu(b.conv(gate, 16, 16, "fc1", k=1), "fc_relu"), 16, 16, "fc2", k=1)
    gate = b.node("Sigmoid", [fc], name="gate")
    se = b.node("Mul", [y, gate], name="se")
    z = b.bn(b.conv(b.relu(b.conv(se, 16, 16, "conv1"), "relu1"), 16, 16, "conv2"), 16, "bn2")
    b.node("Add", [z, se], "output", name="add")
    b.output("output")
    out = qdq(b.build())
    assert_qdq_on(out, "se_out", "add", 1)
    assert_float_input(out, "add", 0)


def test_rule6_add_of_a_conv_output_and_its_own_se_scaling_stays_float():
    """``y + y * gate(y)`` (PP-OCR's residual squeeze-excitation): the other addend needs the conv's
    own output, so no Add fusion is possible; both inputs stay float and check stays clean (C10)."""
    b = GraphBuilder("rse", seed=8)
    x = b.input("input", [1, 16, 8, 8])
    y = b.conv(b.relu(b.conv(x, 16, 16, "conv0"), "relu0"), 16, 16, "conv1")
    gate = b.node("GlobalAveragePool", [y], name="gap")
    gate = b.node("HardSigmoid", [b.conv(b.relu(b.conv(gate, 16, 16, "fc1", k=1), "fc_relu"), 16, 16, "fc2",
                                         k=1)], name="gate", alpha=0.2, beta=0.5)
    b.node("Add", [y, b.node("Mul", [y, gate], name="se")], "output", name="add")
    b.output("output")
    model = b.build()
    assert "computed from the weighted branch" in onnx_qat.place(model).decision_for("add").reason
    out = qdq(model)  # asserts check is clean
    assert_float_input(out, "add", 0)
    assert_float_input(out, "add", 1)


# --------------------------------------------------------------------------- rule 7
def test_rule7_concat_inputs_share_one_scale():
    model = concat_model()
    table = amax_table(model, random_inputs(model))
    out = onnx_qat.quantize(model, scales=table, progress=False).model
    inits = _initializers(out)
    members = ["b1_relu_out", "b2_relu_out", "b3_relu_out"]
    for i, t in enumerate(members):
        assert_qdq_on(out, t, "concat", i)
    assert_qdq_on(out, "concat_out", "head_conv", 0)
    scales = set()
    for t in members + ["concat_out"]:
        q = next(n for n in out.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == t)
        scales.add(float(inits[q.input[1]]))
    expected = np.float32(max(table.activations[t] for t in members + ["concat_out"]) / 127.0)
    assert scales == {float(expected)}


def test_rule7_concat_not_feeding_a_quantized_op_left_float():
    b = GraphBuilder("cat_out")
    x = b.input("input", [1, 16, 4, 4])
    c1 = b.conv(x, 16, 16, "c1", k=1)
    c2 = b.conv(x, 16, 16, "c2", k=1)
    b.node("Concat", [c1, c2], "output", name="concat", axis=1)
    b.output("output")
    out = qdq(b.build())
    assert_float_input(out, "concat", 0)
    assert_float_input(out, "concat", 1)
    assert set(qdq_pairs(out)) == {"input"}


def test_rule7_average_pool_input_quantized():
    b = GraphBuilder("pool")
    x = b.input("input", [1, 16, 8, 8])
    y = b.relu(b.conv(x, 16, 16, "conv"), "relu")
    y = b.node("AveragePool", [y], name="avgpool", kernel_shape=[2, 2], strides=[2, 2])
    b.node("GlobalAveragePool", [y], "output", name="gap")
    b.output("output")
    out = qdq(b.build())
    assert_qdq_on(out, "relu_out", "avgpool", 0)
    assert_qdq_on(out, "avgpool_out", "gap", 0)
    assert_no_qdq_on(out, "output")


# --------------------------------------------------------------------------- rule 8
def test_rule8_pad_then_conv_quantizes_before_pad():
    def tail(b, y):
        y = b.relu(y, "relu")
        return b.node("Pad", [y, b.const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))], name="pad")

    out = qdq(_conv_chain_model(tail))
    assert_qdq_on(out, "relu_out", "pad", 0)
    assert_float_input(out, "conv2", 0)  # conv2 reads the Pad output: nothing between Pad and Conv
    pad = next(n for n in out.graph.node if n.name == "conv2")
    assert pad.input[0] == "pad_out"


def test_rule8_commuting_ops_get_no_qdq_of_their_own():
    b = GraphBuilder("commute")
    x = b.input("input", [1, 16, 8, 8])
    y = b.conv(x, 16, 16, "conv")
    y = b.node("Relu", [y], name="relu")
    y = b.node("MaxPool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    y = b.node("Transpose", [y], name="transpose", perm=[0, 1, 3, 2])
    y = b.node("Flatten", [y], name="flatten", axis=1)
    b.node("Gemm", [y, b.weight("fc.weight", [16, 256])], "output", name="fc", transB=1)
    b.output("output")
    out = qdq(b.build())
    assert set(qdq_pairs(out)) == {"input", "flatten_out"}
    for t in ("conv_out", "relu_out", "pool_out", "transpose_out"):
        assert_no_qdq_on(out, t)


# --------------------------------------------------------------------------- rule 9
def test_rule9_transformer_keeps_layernorm_gelu_softmax_and_attention_float():
    out = qdq(transformer_block_model())
    for node in ("ln1", "ln2", "softmax", "gelu_erf", "gelu_div", "gelu_mul"):
        for i in range(len(next(n for n in out.graph.node if n.name == node).input)):
            assert_float_input(out, node, i)
    for node in ("scores", "context"):
        assert_float_input(out, node, 0)
        assert_float_input(out, node, 1)
    sources = {"q": "ln1_out", "k": "ln1_out", "v": "ln1_out", "out_proj": "merge_reshape_out",
               "ffn1": "ln2_out", "ffn2": "gelu_mul_half_out"}
    for node, tensor in sources.items():
        assert_qdq_on(out, tensor, node, 0)
        assert_weight_quantized(out, node, axis=1)
    # residual Adds: the skip input is quantized, the projection branch stays float (rule 6)
    assert_qdq_on(out, "input", "res1", 0)
    assert_float_input(out, "res1", 1)


def test_rule9_tanh_gelu_stays_float_even_with_its_inner_add():
    out = qdq(transformer_block_model(gelu="tanh"))
    for node in ("gelu_pow", "gelu_mul_k", "gelu_inner", "gelu_mul_s", "gelu_tanh", "gelu_add", "gelu_mul"):
        for i in range(2 if node != "gelu_tanh" else 1):
            assert_float_input(out, node, i)
    assert_qdq_on(out, "gelu_mul_half_out", "ffn2", 0)
    decision = onnx_qat.place(transformer_block_model(gelu="tanh")).decision_for("gelu_inner")
    assert decision.action == "none" and "computed from the weighted branch" in decision.reason


def test_rule9_attention_matmuls_quantized_when_asked():
    out = qdq(transformer_block_model(gelu="op", mask="-inf"), include_attention=True)
    for node in ("scores", "context"):
        for i in (0, 1):
            assert weight_dqs(out).get((node, i)) is None
        assert_qdq_on(out, "q_transpose_out", "scores", 0)
        assert_qdq_on(out, "softmax_out", "context", 0)
        assert_qdq_on(out, "v_transpose_out", "context", 1)
    assert_float_input(out, "gelu", 0)
    assert_float_input(out, "softmax", 0)


def test_rule9_graph_outputs_are_never_quantized():
    b = GraphBuilder("outputs")
    x = b.input("input", [1, 16, 4, 4])
    y = b.relu(b.conv(x, 16, 16, "conv1"), "relu")
    b.node("Conv", [y, b.weight("w2", [16, 16, 1, 1])], "output", name="conv2", kernel_shape=[1, 1])
    b.output("output")
    b.output("relu_out")
    out = qdq(b.build())
    assert_qdq_on(out, "relu_out", "conv2", 0)
    assert [o.name for o in out.graph.output] == ["output", "relu_out"]
    prod = {o: n for n in out.graph.node for o in n.output}
    assert prod["relu_out"].op_type == "Relu" and prod["output"].op_type == "Conv"


def test_rule9_non_constant_weight_and_small_channels_skipped():
    b = GraphBuilder("dyn")
    x = b.input("input", [1, 16, 4, 4])
    w = b.input("dynamic_weight", [16, 16, 1, 1])
    y = b.node("Conv", [x, w], name="dyn_conv", kernel_shape=[1, 1])
    y = b.conv(y, 16, 8, "narrow_conv", k=1)
    b.node("Conv", [y, b.weight("w3", [16, 8, 1, 1])], "output", name="wide_conv", kernel_shape=[1, 1])
    b.output("output")
    model = b.build()
    placement = onnx_qat.place(model, min_channels=16)
    assert placement.decision_for("dyn_conv").action == "skip"
    assert "not a constant" in placement.decision_for("dyn_conv").reason
    assert placement.decision_for("narrow_conv").action == "skip"
    assert "min_channels" in placement.decision_for("narrow_conv").reason
    assert placement.decision_for("wide_conv").action == "skip"  # 8 input channels
    with pytest.raises(onnx_qat.PlacementError, match="nothing to quantize"):
        qdq(model, min_channels=16)
    out = qdq(model, min_channels=8)
    assert_float_input(out, "dyn_conv", 0)
    assert_float_input(out, "dyn_conv", 1)
    assert_weight_quantized(out, "narrow_conv")
    assert_weight_quantized(out, "wide_conv")


# --------------------------------------------------------------------------- rule 10
def test_rule10_one_qdq_pair_per_tensor_shared_by_consumers():
    out = qdq(residual_block_model())
    qs = [n for n in out.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "stem_relu_out"]
    assert len(qs) == 1, describe(out, ["stem_relu_out"])
    assert qdq_pairs(out)["stem_relu_out"] == (("add", 1), ("conv1", 0))
    q_inputs = [n.input[0] for n in out.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_inputs) == len(set(q_inputs))
