"""The inserter: numbers against a NumPy reference, names, order, and onnxruntime numerics."""
import logging

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.graph.edit import GraphEdit
from onnx_qat.errors import ScalesError
from onnx_qat.formats.encoding import ZERO_CHANNEL_SCALE, quantize_weight
from onnx_qat.insertion.inserter import activation_scale, activation_scales, insert_qdq_pairs
from onnx_qat.graph.index import GraphIndex
from onnx_qat.placement.policy import TensorRTPolicy
from onnx_qat.scales import ScaleTable, WeightRange
from tests.builders import (
    GraphBuilder, amax_table, assert_weight_quantized, cosine, lines_executed, mlp_model, random_inputs,
    residual_block_model, residual_chain_model, run, weight_dqs,
)


def _reference(w, axis):
    """Symmetric int8 per-channel quantization written out independently."""
    w = w.astype(np.float32)
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    scale = (np.abs(moved).max(axis=1) / np.float32(127.0)).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)  # np.round: half to even
    return q, scale


def _fp16_reference(w, axis):
    """The TensorRT form's weights (`onnx_qat.formats.scale_grid.fp16_weight_scales`), written out
    independently: each channel's scale is whichever FP16 value just below or just above amax / 127
    quantizes the channel with the smaller squared error (the one above on a tie), the channel
    quantized with it."""
    w = w.astype(np.float32)
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    plain = (np.abs(moved).max(axis=1) / np.float32(127.0)).astype(np.float32)
    scales, rows = [], []
    for row, s in zip(moved, plain):
        half = np.float16(s)
        below = half if np.float32(half) <= s else np.nextafter(half, np.float16(0))
        above = half if np.float32(half) >= s else np.nextafter(half, np.float16(np.inf))
        best = None
        for candidate in (np.float32(above), np.float32(below)):  # the one above wins a tie
            q = np.clip(np.round(row / candidate), -127, 127)
            err = float(np.sum((q * candidate - row).astype(np.float64) ** 2))
            if best is None or err < best[0]:
                best = (err, candidate, q)
        scales.append(best[1])
        rows.append(best[2])
    q = np.moveaxis(np.stack(rows).reshape(np.moveaxis(w, axis, 0).shape), 0, axis).astype(np.int8)
    return q, np.array(scales, np.float32)


def _insert(model, table, target="tensorrt", **options):
    placement = TensorRTPolicy().place(GraphIndex(model), onnx_qat.QuantizeConfig(**options))
    edit = GraphEdit(_copy(model))
    result = insert_qdq_pairs(edit, placement, table, target)
    return edit.commit(), result


def _copy(model):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


@pytest.mark.parametrize("axis", [0, 1])
def test_quantize_weight_matches_numpy_reference(axis):
    w = np.random.default_rng(1).standard_normal((16, 24, 3)).astype(np.float32)
    q, scale = quantize_weight(w, axis)
    q_ref, scale_ref = _reference(w, axis)
    np.testing.assert_array_equal(scale, scale_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert q.dtype == np.int8 and q.min() >= -127


def test_quantize_weight_rounds_half_to_even_and_clips():
    w = np.array([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0]], np.float32)
    q, scale = quantize_weight(w, 0, amax=[127.0])
    assert scale.tolist() == [1.0]
    assert q.tolist() == [[0, 2, 2, 0, -2, 127]]
    q, _ = quantize_weight(w * 4, 0, amax=[127.0])
    assert q.max() == 127 and q.min() == -10


def test_zero_weight_channel_gets_tiny_positive_scale(caplog):
    w = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    w[2] = 0.0
    with caplog.at_level(logging.INFO, logger="onnx_qat.formats.encoding"):
        q, scale = quantize_weight(w, 0, name="w")
    assert scale[2] == np.float32(ZERO_CHANNEL_SCALE) and np.all(scale > 0)
    assert not q[2].any()
    assert any("zero range" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("target, reference", [("tensorrt", _fp16_reference), ("ort-cpu", _reference)])
def test_inserted_weights_and_scales_equal_reference(target, reference):
    """The TensorRT form's weight scales are FP16 values (each channel requantized with its own); the
    ort-cpu form's are the plain float32 amax / 127."""
    model = mlp_model()
    table = amax_table(model, random_inputs(model))
    out, _ = _insert(model, table, target)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node, name, axis in (("fc1", "fc1.weight", 0), ("fc2", "fc2.weight", 1), ("fc3", "fc3.weight", 1)):
        info = assert_weight_quantized(out, node, axis=axis)
        q_ref, scale_ref = reference(weights[name], axis)
        np.testing.assert_array_equal(info["values"], q_ref)
        np.testing.assert_array_equal(info["scale"], scale_ref)
        assert info["initializer"] == f"{name}_quantized"
        plain = _reference(weights[name], axis)[1]
        assert np.array_equal(info["scale"], plain) == (target == "ort-cpu")


def test_weight_range_from_scale_table_is_used():
    model = mlp_model()
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "fc1.weight"))
    amax = np.abs(w).max(axis=1) / 2  # half the real range: values clip at +-127
    table = amax_table(model, random_inputs(model)).merged(
        ScaleTable(weights={"fc1.weight": WeightRange(0, tuple(float(a) for a in amax))}))
    out, result = _insert(model, table)
    info = weight_dqs(out)[("fc1", 1)]
    np.testing.assert_allclose(info["scale"], (amax / 127).astype(np.float32))
    assert info["values"].max() == 127 and info["values"].min() == -127
    record = next(r for r in result.weights if r["tensor"] == "fc1.weight")
    assert record["amax_source"] == "scale table"
    wrong = ScaleTable({"input": 1.0}, {"fc1.weight": WeightRange(1, tuple([1.0] * w.shape[1]))})
    with pytest.raises(onnx_qat.ScalesError, match="axis"):
        _insert(model, amax_table(model, random_inputs(model)).merged(wrong))


def test_activation_pair_names_values_and_order():
    model = residual_block_model()
    table = amax_table(model, random_inputs(model))
    out, result = _insert(model, table)
    nodes = {n.name: n for n in out.graph.node}
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    q = nodes["stem_relu_out_QuantizeLinear"]
    dq = nodes["stem_relu_out_DequantizeLinear"]
    assert q.input == ["stem_relu_out", "stem_relu_out_scale", "stem_relu_out_zero_point"]
    assert dq.input[0] == q.output[0] == "stem_relu_out_QuantizeLinear_Output"
    assert inits["stem_relu_out_scale"] == np.float32(table.activations["stem_relu_out"] / 127.0)
    assert inits["stem_relu_out_zero_point"].dtype == np.int8 and inits["stem_relu_out_zero_point"] == 0
    names = [n.name for n in out.graph.node]
    # each pair sits right before its first consumer; original nodes keep their order
    assert names.index("stem_relu_out_DequantizeLinear") == names.index("conv1") - 2
    assert [n for n in names if "Linear" not in n] == [n.name for n in model.graph.node]
    assert len(result.activations) == 3 and len(result.weights) == 3
    onnx.checker.check_model(out)


def test_shapes_and_graph_outputs_preserved_and_outputs_close():
    model = residual_block_model(projection=True)
    table = amax_table(model, random_inputs(model))
    out, _ = _insert(model, table)
    assert [(o.name, o.type) for o in out.graph.output] == [(o.name, o.type) for o in model.graph.output]
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    feeds = random_inputs(model, seed=7)
    ref, got = run(model, feeds)[0], run(out, feeds)[0]
    assert got.shape == ref.shape
    assert cosine(ref, got) > 0.99


def test_shared_weight_gets_one_dequantize():
    b = GraphBuilder("shared")
    x = b.input("input", [1, 16, 4, 4])
    w = b.weight("w", [16, 16, 1, 1])
    y = b.node("Conv", [x, w], name="conv1", kernel_shape=[1, 1])
    y = b.node("Relu", [y], name="relu")
    b.node("Conv", [y, w], "output", name="conv2", kernel_shape=[1, 1])
    b.output("output")
    model = b.build()
    out, _ = _insert(model, amax_table(model, random_inputs(model)))
    dqs = [n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w_quantized"]
    assert len(dqs) == 1
    assert weight_dqs(out)[("conv1", 1)]["initializer"] == weight_dqs(out)[("conv2", 1)]["initializer"]
    assert "w" not in {i.name for i in out.graph.initializer}  # the float copy is gone


def test_missing_activation_range_is_listed():
    model = residual_block_model()
    table = ScaleTable({"input": 1.0})
    with pytest.raises(onnx_qat.ScalesError, match="relu1_out") as err:
        _insert(model, table)
    assert "stem_relu_out" in str(err.value) and "2 quantized tensor" in str(err.value)


def test_name_collisions_get_a_suffix():
    b = GraphBuilder("collide")
    x = b.input("input", [1, 16, 4, 4])
    b.node("Relu", [x], "input_scale", name="relu")  # a tensor already named like the new scale
    b.node("Conv", [x, b.weight("w", [16, 16, 1, 1])], "output", name="conv", kernel_shape=[1, 1])
    b.output("output")
    b.output("input_scale", [1, 16, 4, 4])
    model = b.build()
    out, _ = _insert(model, ScaleTable({"input": 2.0}))
    q = next(n for n in out.graph.node if n.op_type == "QuantizeLinear")
    assert q.input[1] == "input_scale_1"
    prod = {o: n.op_type for n in out.graph.node for o in n.output}
    assert prod["input_scale"] == "Relu"
    onnx.checker.check_model(out)
    run(out, random_inputs(out))


def test_new_names_do_not_collide_with_subgraph_names():
    b = GraphBuilder("sub_names")
    x = b.input("input", [1, 16, 4, 4])
    cond = b.input("cond", [], dtype=onnx.TensorProto.BOOL)
    y = b.node("Conv", [x, b.weight("w", [16, 16, 1, 1])], name="conv", kernel_shape=[1, 1])
    info = onnx.helper.make_tensor_value_info("input_scale", onnx.TensorProto.FLOAT, [1, 16, 4, 4])
    then_g = onnx.helper.make_graph([onnx.helper.make_node("Relu", [y], ["input_scale"], name="then_relu")],
                                    "then", [], [info])
    else_info = onnx.helper.make_tensor_value_info("else_out", onnx.TensorProto.FLOAT, [1, 16, 4, 4])
    else_g = onnx.helper.make_graph([onnx.helper.make_node("Identity", [y], ["else_out"], name="else_id")],
                                    "else", [], [else_info])
    b.node("If", [cond], "output", name="branch", then_branch=then_g, else_branch=else_g)
    b.output("output", [1, 16, 4, 4])
    model = b.build()
    out, _ = _insert(model, ScaleTable({"input": 2.0}))
    q = next(n for n in out.graph.node if n.op_type == "QuantizeLinear")
    assert q.input[1] == "input_scale_1"
    onnx.checker.check_model(out, full_check=True)
    feeds = {"input": random_inputs(model)["input"], "cond": np.array(True)}
    run(out, feeds)


def test_insertion_work_grows_linearly_with_graph_size():
    """Python lines executed by insertion + commit (a clock-free measure, tests/builders.lines_executed)
    at 4x the nodes: ~4x for linear work, ~16x for a per-node pass over the graph."""
    def lines(blocks):
        model = residual_chain_model(blocks)
        placement = TensorRTPolicy().place(GraphIndex(model), onnx_qat.QuantizeConfig())
        table = ScaleTable({t: 1.0 for t in placement.activation_tensors()})
        edit = GraphEdit(model)

        def insert():
            result = insert_qdq_pairs(edit, placement, table)
            edit.commit()
            return result

        result, count = lines_executed(insert)
        assert result.num_quantize == len(placement.activations)
        return count

    small, large = lines(100), lines(400)
    assert 3 * small < large < 4.5 * small, (small, large)


def test_activation_scales_equal_one_by_one_and_refuse_the_first_bad_amax():
    """The vectorized scales are the float32 values of activation_scale per amax (floats, NumPy
    float32 and odd magnitudes alike); a zero, negative, NaN or overflowing amax raises the
    one-value message of that amax."""
    rng = np.random.default_rng(11)
    amaxes = [float(a) for a in rng.uniform(1e-3, 50, 200)] + [np.float32(3.3), 1e-30, 1e30, 127.0, 0.1]
    got = activation_scales(amaxes)
    assert got.dtype == np.float32
    assert got.tolist() == [float(activation_scale(a)) for a in amaxes]
    for bad in (0.0, -1.0, float("nan"), 1e300):
        with pytest.raises(ScalesError) as info:
            activation_scales([1.0, bad, 2.0])
        with pytest.raises(ScalesError) as single:
            activation_scale(bad)
        assert str(info.value) == str(single.value)


def test_the_configuration_offers_exactly_the_registered_targets():
    """``QuantizeConfig`` and the CLI's ``--target`` validate against ``config.TARGETS``; the inserter
    reads the targets' facts from ``insertion.targets``: the two name the same targets."""
    from onnx_qat.config import TARGETS
    from onnx_qat.insertion.targets import _TARGETS, get_target

    assert TARGETS[0] == "tensorrt" and set(TARGETS) == set(_TARGETS)
    assert [get_target(name).name for name in TARGETS] == list(TARGETS)


@pytest.mark.parametrize("seed", range(5))
def test_group_amax_equals_its_plain_definition(seed):
    """Each quantized tensor's amax: its own, or its scale group's largest (rule 7); tensors without a range
    (their own, or none in their group) are left out. Random marks and tables, groups with and without
    ranges."""
    from onnx_qat.insertion.inserter import group_amax
    from onnx_qat.placement.marks import ActivationMark, Placement

    rng = np.random.default_rng(seed)
    marks = [ActivationMark(f"t{i}", (("n", 0),), "R7", "", scale_group=[None, "", "g1", "g2", "g3"][
        int(rng.integers(5 if seed else 2))]) for i in range(40)]
    table = ScaleTable({m.tensor: float(rng.uniform(0.5, 9)) for m in marks if rng.random() < 0.7})
    given = table.activations
    groups = {}
    for m in marks:
        if m.scale_group and m.tensor in given:
            groups[m.scale_group] = max(groups.get(m.scale_group, 0.0), given[m.tensor])
    expected = {}
    for m in marks:
        amax = groups.get(m.scale_group) if m.scale_group else given.get(m.tensor)
        if amax is not None:
            expected[m.tensor] = amax
    found = group_amax(Placement(tuple(marks)), table)
    assert found == expected and list(found) == list(expected)
    assert len(found) < len(marks)
