"""The subgraph rule for Loop and Scan bodies: placed, calibrated over every iteration, quantized.

Built on :func:`tests.builders.loop_cnn_model` (a Loop whose body refines a carried image with a small
residual CNN), :func:`tests.builders.scan_rnn_model` (a Scan whose body is an RNN cell) and
:func:`tests.builders.growing_loop_model` (a Loop whose carried tensor grows each iteration, which
calibration cannot observe per iteration). The calibrated ranges of body tensors are compared with
the same computation unrolled in numpy.
"""
import logging

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnx_qat
from onnx_qat.calibration.branches import BranchRunner
from onnx_qat.errors import ModelError
from onnx_qat.formats.scale_grid import on_fp16_grid
from onnx_qat.graph.subgraphs import expose_iterations
from tests.builders import (assert_check_clean, cosine, growing_loop_model, if_cnn_model, loop_cnn_model, run,
                            scan_rnn_model)


def _images(num, seed, scale):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((num, 3, 8, 8)) * scale).astype(np.float32)


def _sequences(num, seed, scale, steps=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((num, steps, 16)) * scale).astype(np.float32)


def _body(model, node_name):
    node = next(n for n in model.graph.node if n.name == node_name)
    return next(a.g for a in node.attribute if a.name == "body")


def _reader_dq(graph, consumer, index):
    """The DequantizeLinear feeding input ``index`` of node ``consumer`` in ``graph`` (None if float)."""
    node = next(n for n in graph.node if n.name == consumer)
    producer = next((n for n in graph.node if node.input[index] in n.output), None)
    return producer if producer is not None and producer.op_type == "DequantizeLinear" else None


def _quantized_input(graph, consumer, index):
    """The tensor a Q/DQ pair in ``graph`` quantizes before input ``index`` of ``consumer``."""
    dq = _reader_dq(graph, consumer, index)
    assert dq is not None, f"input {index} of {consumer!r} is float"
    q = next((n for n in graph.node if dq.input[0] in n.output), None)
    return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else dq.input[0]


def _weights(model):
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}


def _conv3x3(x, w, b=None):
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3),
                                                       axis=(2, 3))
    out = np.einsum("nchwij,ocij->nohw", windows, w)
    return out if b is None else out + b[None, :, None, None]


def _unrolled_loop_cnn(model, images, trips=3):
    """The loop_cnn model's body inputs ``x`` and ``l_relu1_out`` of every iteration, in numpy."""
    outer, body = _weights(model), {t.name: numpy_helper.to_array(t).astype(np.float64)
                                    for t in _body(model, "refine").initializer}
    x = np.maximum(_conv3x3(images.astype(np.float64), outer["stem_conv.weight"], outer["stem_conv.bias"]), 0)
    xs, relus = [], []
    for _ in range(trips):
        xs.append(x)
        relus.append(np.maximum(_conv3x3(x, body["l_conv1.weight"], body["l_conv1.bias"]), 0))
        x = np.maximum(_conv3x3(relus[-1], outer["loop_w2"]) + x, 0)
    return xs, relus


def _unrolled_scan_rnn(model, sequences):
    """The scan_rnn model's body inputs ``h`` and ``x_t`` and tensor ``r_rec_out`` of every step."""
    outer, cell = _weights(model), {t.name: numpy_helper.to_array(t).astype(np.float64)
                                    for t in _body(model, "rnn").initializer}
    seq = sequences.astype(np.float64)
    h = np.tanh(seq.mean(axis=1) @ outer["init.weight"])
    hs, xs, recs = [], [], []
    for t in range(seq.shape[1]):
        hs.append(h)
        xs.append(seq[:, t])
        recs.append(h @ cell["rnn.U"])
        h = np.tanh(seq[:, t] @ cell["rnn.W"] + recs[-1] + cell["rnn.b"])
    return hs, xs, recs


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 255.0), (1, 1.0), (0, 255.0)])
def test_subgraph_rule_loop_cnn_body_calibrated_quantized_and_close_to_float(seed, scale):
    model = loop_cnn_model(seed=seed)
    before = model.SerializeToString(deterministic=True)
    result = onnx_qat.quantize(model, data={"input": _images(8, seed, scale)}, batch_size=4, progress=False)
    assert model.SerializeToString(deterministic=True) == before, "the caller's model was changed"
    out = result.model
    assert_check_clean(out)
    body = _body(out, "refine")
    ops = sorted(n.op_type for n in body.node)
    # rule 4 inside the body: l_conv1 (carried x, body weight) and l_conv2 (l_relu1_out, outer weight);
    # the carried x is also the residual Add's skip: one pair for both (rules 6 and 10)
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 4, ops
    assert _quantized_input(body, "l_conv1", 0) == "x" and _quantized_input(body, "l_add", 1) == "x"
    assert _quantized_input(body, "l_conv2", 0) == "l_relu1_out"
    assert _reader_dq(body, "l_conv1", 1) is not None and _reader_dq(body, "l_conv2", 1) is not None
    assert _reader_dq(body, "l_add", 0) is None  # the Conv branch of the residual Add stays float
    # the outer float weight only the body read is gone; its int8 copy lives in the body
    assert "loop_w2" not in {t.name for t in out.graph.initializer}
    assert "loop_w2_quantized" in {t.name for t in body.initializer}
    assert {r.get("subgraph") for r in result.inserted} == {None, "refine/body"}
    for k in range(2):  # held-out data of the calibration's kind
        feeds = {"input": _images(4, seed + 20 + k, scale)}
        ref, got = run(model, feeds), run(out, feeds)
        assert cosine(ref[0], got[0]) > 0.99
        assert np.abs(ref[0] - got[0]).max() < 0.1 * np.abs(ref[0]).max()
        assert np.abs(ref[1] - got[1]).max() < 0.1 * np.abs(ref[1]).max()  # the per-iteration scan output


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 255.0), (1, 1.0), (0, 255.0)])
def test_subgraph_rule_scan_rnn_body_calibrated_quantized_and_close_to_float(seed, scale):
    model = scan_rnn_model(seed=seed)
    before = model.SerializeToString(deterministic=True)
    data = {"input": _sequences(8, seed, scale)}
    result = onnx_qat.quantize(model, data=data, batch_size=4, progress=False)
    assert model.SerializeToString(deterministic=True) == before, "the caller's model was changed"
    out = result.model
    assert_check_clean(out)
    body = _body(out, "rnn")
    assert _quantized_input(body, "r_in", 0) == "x_t" and _quantized_input(body, "r_rec", 0) == "h"
    assert _reader_dq(body, "r_in", 1) is not None and _reader_dq(body, "r_rec", 1) is not None
    w_dq = _reader_dq(body, "r_in", 1)
    assert next(a.i for a in w_dq.attribute if a.name == "axis") == 1  # MatMul weight [K, N]: per column
    # x255 inputs drive the cell's tanh with pre-activations in the hundreds: one int8 step of x_t
    # (amax / 127, about 8) moves an element near tanh's zero across its whole range, so the
    # worst element's error is larger there (measured 0.17-0.23 of max |output|; 0.03-0.06 at x1)
    bound = 0.3 if scale > 1 else 0.1
    for k in range(2):
        feeds = {"input": _sequences(4, seed + 20 + k, scale)}
        ref, got = run(model, feeds)[0], run(out, feeds)[0]
        assert cosine(ref, got) > 0.99
        assert np.abs(ref - got).max() < bound * np.abs(ref).max()


def _grid(amax) -> float:
    """A calibrated max as calibration gives it: raised so that amax / 127 is an FP16 value."""
    return on_fp16_grid(float(amax), 127.0)


def test_calibrated_loop_body_range_is_the_max_over_every_iteration():
    model = loop_cnn_model(seed=3)
    images = _images(6, 7, 1.0)
    table = onnx_qat.calibrate(model, {"input": images}, tensors=["x", "l_relu1_out", "stem_relu_out"],
                               method="max", batch_size=2, progress=False)
    xs, relus = _unrolled_loop_cnn(model, images)
    per_iteration = [np.abs(v).max() for v in xs]
    assert len(set(np.round(per_iteration, 4))) == 3, "iterations should differ for this test to mean much"
    # each max raised to the FP16 grid of scales as calibration raises every range (formats.scale_grid)
    assert table.activations["x"] == pytest.approx(_grid(max(per_iteration)), rel=1e-4)
    relu_max = max(np.abs(v).max() for v in relus)
    assert table.activations["l_relu1_out"] == pytest.approx(_grid(relu_max), rel=1e-4)
    assert table.activations["stem_relu_out"] == pytest.approx(_grid(per_iteration[0]), rel=1e-4)
    # the histogram methods see the values of all iterations pooled: the median of |x| over the three
    # iterations is none of the iterations' own medians (0, 0.40, 0.64 here)
    median = onnx_qat.calibrate(model, {"input": images}, tensors=["x"], method="percentile", percentile=50.0,
                                batch_size=2, progress=False).activations["x"]
    pooled = np.percentile(np.abs(np.concatenate([v.ravel() for v in xs])), 50)
    assert median == pytest.approx(pooled, rel=1e-2)
    assert all(abs(np.percentile(np.abs(v), 50) - pooled) > 0.1 * pooled for v in xs)


@pytest.mark.parametrize("axes_given", [False, True])
def test_calibrated_scan_body_range_is_the_max_over_every_step(axes_given):
    model = scan_rnn_model(seed=2)
    if axes_given:  # a Scan that spells out its scan output axes and directions: both are extended
        scan = next(n for n in model.graph.node if n.op_type == "Scan")
        scan.attribute.extend([helper.make_attribute("scan_output_axes", [0]),
                               helper.make_attribute("scan_output_directions", [0])])
    sequences = _sequences(6, 5, 1.0, steps=7)
    table = onnx_qat.calibrate(model, {"input": sequences}, tensors=["h", "x_t", "r_rec_out"], method="max",
                               batch_size=3, progress=False)
    hs, xs, recs = _unrolled_scan_rnn(model, sequences)
    assert table.activations["h"] == pytest.approx(_grid(max(np.abs(v).max() for v in hs)), rel=1e-4)
    assert table.activations["x_t"] == pytest.approx(_grid(np.abs(sequences).max()), rel=1e-6)
    rec_max = max(np.abs(v).max() for v in recs)
    assert table.activations["r_rec_out"] == pytest.approx(_grid(rec_max), rel=1e-4)
    assert max(np.abs(v).max() for v in recs) > np.abs(recs[0]).max(), "the first step alone is not the max"


def test_expose_iterations_stacks_every_iteration_and_leaves_the_model_unchanged():
    model = loop_cnn_model(seed=1)
    before = model.SerializeToString(deterministic=True)
    copy, exposed = expose_iterations(model, ["l_relu1_out", "x", "stem_relu_out"])
    assert model.SerializeToString(deterministic=True) == before
    assert set(exposed) == {"l_relu1_out", "x"}  # a main-graph tensor needs no exposing
    images = _images(2, 3, 1.0)
    session_outputs = run(onnx_qat.runtime.sessions.with_outputs(copy, list(exposed.values())),
                          {"input": images})
    stacked = dict(zip(exposed, session_outputs[-2:]))
    xs, relus = _unrolled_loop_cnn(model, images)
    assert stacked["x"].shape == (3, 2, 16, 8, 8)
    np.testing.assert_allclose(stacked["x"], np.stack(xs), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(stacked["l_relu1_out"], np.stack(relus), rtol=1e-4, atol=1e-4)


def test_body_whose_shapes_change_across_iterations_stays_float_with_a_note(caplog):
    model = growing_loop_model()
    before = model.SerializeToString(deterministic=True)
    rng = np.random.default_rng(0)
    data = {"input": rng.standard_normal((8, 4, 16)).astype(np.float32)}
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        result = onnx_qat.quantize(model, data=data, batch_size=4, progress=False)
    assert model.SerializeToString(deterministic=True) == before
    assert any("'grow'" in note and "left float" in note for note in result.placement.notes), \
        result.placement.notes
    assert not result.placement.subgraphs
    assert "QuantizeLinear" not in {n.op_type for n in _body(result.model, "grow").node}
    main_ops = [n.op_type for n in result.model.graph.node]
    assert main_ops.count("QuantizeLinear") == 2  # proj and out_proj inputs: the rest is quantized
    assert_check_clean(result.model)
    feeds = {"input": rng.standard_normal((2, 4, 16)).astype(np.float32)}
    ref, got = run(model, feeds)[0], run(result.model, feeds)[0]
    assert ref.shape == (2, 7, 16) and cosine(ref, got) > 0.99


def test_ort_cpu_target_quantizes_the_main_graph_and_leaves_the_body_float():
    model = loop_cnn_model()
    result = onnx_qat.quantize(model, data={"input": _images(8, 0, 1.0)}, batch_size=4, progress=False,
                               target="ort-cpu")
    assert "QuantizeLinear" not in {n.op_type for n in _body(result.model, "refine").node}
    assert any("main graph only" in note and "Loop/Scan" in note for note in result.placement.notes)
    assert "QuantizeLinear" in {n.op_type for n in result.model.graph.node}
    feeds = {"input": _images(2, 30, 1.0)}
    assert cosine(run(model, feeds)[0], run(result.model, feeds)[0]) > 0.99


def test_given_scale_table_quantizes_the_body():
    model = scan_rnn_model()
    names = onnx_qat.place(model).activation_tensors()
    assert {"h", "x_t"} <= set(names)
    out = onnx_qat.quantize(model, scales=onnx_qat.ScaleTable({n: 4.0 for n in names}), progress=False).model
    assert "QuantizeLinear" in {n.op_type for n in _body(out, "rnn").node}
    onnx.checker.check_model(out, full_check=True)
    assert_check_clean(out)


def test_calibrate_refuses_an_unknown_tensor_in_one_line():
    with pytest.raises(ModelError, match="not a tensor of the model") as caught:
        BranchRunner(loop_cnn_model(), ["x", "no_such_tensor"])
    assert "\n" not in str(caught.value)


def _loop_in_if_model():
    """if_cnn_model with its else branch's ``b_relu1`` output refined by a Loop (one Conv per iteration)."""
    model = if_cnn_model()
    node = next(n for n in model.graph.node if n.op_type == "If")
    other = next(a.g for a in node.attribute if a.name == "else_branch")
    rng = np.random.default_rng(4)
    w = numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.05).astype(np.float32), "k_w")
    body = helper.make_graph(
        [helper.make_node("Conv", ["k_x", "k_w"], ["k_c"], name="k_conv", pads=[1] * 4),
         helper.make_node("Add", ["k_c", "k_x"], ["k_next"], name="k_add"),
         helper.make_node("Identity", ["k_cond"], ["k_cond_out"], name="k_id")], "inner_body",
        [helper.make_tensor_value_info("k_i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("k_cond", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("k_x", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("k_cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("k_next", onnx.TensorProto.FLOAT, None)], [w])
    relu = next(n for n in other.node if n.name == "b_relu1")
    relu.output[0] = "b_relu1_raw"
    position = list(other.node).index(relu)
    other.initializer.append(numpy_helper.from_array(np.array(2, np.int64), "k_trips"))
    other.node.insert(position + 1, helper.make_node("Loop", ["k_trips", "", "b_relu1_raw"], ["b_relu1_out"],
                                                     name="inner_loop", body=body))
    onnx.checker.check_model(model)
    return model


def test_a_loop_inside_an_if_branch_is_calibrated_on_the_batches_that_take_it():
    model = _loop_in_if_model()
    rng = np.random.default_rng(1)
    data = np.concatenate([rng.standard_normal((1, 3, 8, 8)) + s for s in (1, -1, 1, -1)]).astype(np.float32)
    result = onnx_qat.quantize(model, data={"input": data}, batch_size=1, progress=False)
    assert_check_clean(result.model)
    if_node = next(n for n in result.model.graph.node if n.op_type == "If")
    other = next(a.g for a in if_node.attribute if a.name == "else_branch")
    loop = next(n for n in other.node if n.op_type == "Loop")
    inner = next(a.g for a in loop.attribute if a.name == "body")
    assert _quantized_input(inner, "k_conv", 0) == "k_x"
    assert _reader_dq(inner, "k_conv", 1) is not None
    for k, sign in enumerate((1, -1)):
        feeds = {"input": (rng.standard_normal((1, 3, 8, 8)) + sign).astype(np.float32)}
        ref, got = run(model, feeds)[0], run(result.model, feeds)[0]
        assert cosine(ref, got) > 0.99, sign


def _if_in_loop_model():
    """``pre_conv`` -> Loop ``outer`` (2 trips): body(i, cond, x): ``o_conv`` -> ``o_relu`` -> If ``o_if``
    (on the sign of x's mean; Conv -> Relu -> Conv in each branch) -> Add ``o_add`` (x) -> carried."""
    rng = np.random.default_rng(6)

    def weight(name):
        return numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.08).astype(np.float32), name)

    def branch(name, conv):  # Conv -> Relu -> Conv: the second Conv's input exists only inside the branch
        nodes = [helper.make_node("Conv", ["o_relu_out", f"{conv}1_w"], [f"{conv}1_out"], name=f"{conv}1",
                                  pads=[1] * 4),
                 helper.make_node("Relu", [f"{conv}1_out"], [f"{conv}_relu_out"], name=f"{conv}_relu"),
                 helper.make_node("Conv", [f"{conv}_relu_out", f"{conv}2_w"], [f"{name}_out"],
                                  name=f"{conv}2", pads=[1] * 4)]
        return helper.make_graph(nodes, name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, None)],
                                 [weight(f"{conv}1_w"), weight(f"{conv}2_w")])

    body = helper.make_graph(
        [helper.make_node("Conv", ["o_x", "o_w"], ["o_conv_out"], name="o_conv", pads=[1] * 4),
         helper.make_node("Relu", ["o_conv_out"], ["o_relu_out"], name="o_relu"),
         helper.make_node("ReduceMean", ["o_x"], ["o_mean"], name="o_mean", keepdims=0),
         helper.make_node("Greater", ["o_mean", "o_zero"], ["o_cond"], name="o_greater"),
         helper.make_node("If", ["o_cond"], ["o_if_out"], name="o_if", then_branch=branch("o_then", "t_conv"),
                          else_branch=branch("o_else", "e_conv")),
         helper.make_node("Add", ["o_if_out", "o_x"], ["o_next"], name="o_add"),
         helper.make_node("Identity", ["o_c"], ["o_c_out"], name="o_id")], "outer_body",
        [helper.make_tensor_value_info("o_i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("o_c", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("o_x", onnx.TensorProto.FLOAT, ["N", 16, 8, 8])],
        [helper.make_tensor_value_info("o_c_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("o_next", onnx.TensorProto.FLOAT, ["N", 16, 8, 8])],
        [weight("o_w"), numpy_helper.from_array(np.array(0, np.float32), "o_zero")])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "pre_w"], ["pre_out"], name="pre_conv", pads=[1] * 4),
         helper.make_node("Loop", ["trips", "", "pre_out"], ["output"], name="outer", body=body)],
        "if_in_loop",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["N", 16, 8, 8])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["N", 16, 8, 8])],
        [weight("pre_w"), numpy_helper.from_array(np.array(2, np.int64), "trips")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def test_an_if_inside_a_loop_body_stays_float_with_a_note_and_the_rest_of_the_body_is_quantized():
    model = _if_in_loop_model()
    before = model.SerializeToString(deterministic=True)
    rng = np.random.default_rng(2)
    data = {"input": rng.standard_normal((8, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, batch_size=4, progress=False)
    assert model.SerializeToString(deterministic=True) == before
    assert any("'o_if'" in note and "inside a Loop/Scan body" in note for note in result.placement.notes), \
        result.placement.notes
    body = _body(result.model, "outer")
    assert _quantized_input(body, "o_conv", 0) == "o_x" and _reader_dq(body, "o_conv", 1) is not None
    if_node = next(n for n in body.node if n.op_type == "If")
    assert {n.op_type for a in if_node.attribute for n in a.g.node} == {"Conv", "Relu"}  # left float
    assert_check_clean(result.model)
    feeds = {"input": rng.standard_normal((2, 16, 8, 8)).astype(np.float32)}
    assert cosine(run(model, feeds)[0], run(result.model, feeds)[0]) > 0.99


def test_a_loop_nested_in_a_loop_body_is_observed_in_every_inner_and_outer_iteration():
    """Outer Loop (2 trips) whose body runs an inner Loop (3 trips) doubling its carried value."""
    def loop_body(name, nodes, carried, out, initializers=()):
        return helper.make_graph(
            nodes + [helper.make_node("Identity", [f"{name}_c"], [f"{name}_c_out"], name=f"{name}_id")], name,
            [helper.make_tensor_value_info(f"{name}_i", onnx.TensorProto.INT64, []),
             helper.make_tensor_value_info(f"{name}_c", onnx.TensorProto.BOOL, []),
             helper.make_tensor_value_info(carried, onnx.TensorProto.FLOAT, [2, 4])],
            [helper.make_tensor_value_info(f"{name}_c_out", onnx.TensorProto.BOOL, []),
             helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, [2, 4])], list(initializers))

    inner = loop_body("inner", [helper.make_node("Mul", ["in_y", "two"], ["in_next"], name="in_mul")], "in_y",
                      "in_next", [numpy_helper.from_array(np.array(2, np.float32), "two")])
    inner_loop = helper.make_node("Loop", ["three", "", "out_x"], ["out_next"], name="inner_loop", body=inner)
    outer = loop_body("outer", [inner_loop], "out_x", "out_next",
                      [numpy_helper.from_array(np.array(3, np.int64), "three")])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["twice", "", "input"], ["output"], name="outer_loop", body=outer)],
        "nested",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.array(2, np.int64), "twice")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    runner = BranchRunner(model, ["in_y", "out_x"])
    in_y, out_x = runner.run(["in_y", "out_x"], {"input": x})
    assert in_y.shape == (2, 3, 2, 4) and out_x.shape == (2, 2, 4)
    np.testing.assert_allclose(in_y, np.array([[x, 2 * x, 4 * x], [8 * x, 16 * x, 32 * x]]), rtol=1e-6)
    np.testing.assert_allclose(out_x, np.array([x, 8 * x]), rtol=1e-6)
