"""The ``ort-cpu`` target: same scales as ``tensorrt``, uint8 activations (zero point 128), Conv outputs
requantized so onnxruntime's CPU provider forms QLinearConv; every requantization point reported."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.cli import main
from tests import builders as B


# --------------------------------------------------------------------------- tiny models
def plain_cnn(seed: int = 0) -> onnx.ModelProto:
    """input [8,16,12,12] -> c1 (BN folded: Conv+bias) -> r1 -> MaxPool -> c2 -> r2 -> GlobalAveragePool
    -> Flatten -> fc (MatMul + bias) -> logits [8,10]. Every Conv output reaches a quantized tensor
    through exactly commuting ops."""
    b = B.GraphBuilder("plain_cnn", seed)
    x = b.input("input", [8, 16, 12, 12])
    y = b.relu(b.conv(x, 16, 32, "c1"), "r1")
    y = b.node("MaxPool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    y = b.relu(b.conv(y, 32, 32, "c2"), "r2")
    y = b.node("GlobalAveragePool", [y], name="gap")
    y = b.node("Flatten", [y], name="flat")
    y = b.linear(y, 32, 10, "fc")
    b.nodes[-1].output[0] = "logits"
    b.output("logits")
    return b.build()


def folded_residual(seed: int = 0) -> onnx.ModelProto:
    """input -> stem (Conv+bias) -> stem_relu -> conv1 -> relu1 -> conv2 -> Add ``add`` (conv2 output +
    stem_relu output) -> relu_out -> output. conv2's output has no quantized tensor after it."""
    b = B.GraphBuilder("folded_residual", seed)
    x = b.input("input", [4, 16, 8, 8])
    stem = b.relu(b.conv(x, 16, 16, "stem"), "stem_relu")
    y = b.relu(b.conv(stem, 16, 16, "conv1"), "relu1")
    y = b.conv(y, 16, 16, "conv2")
    y = b.node("Add", [y, stem], name="add")
    b.node("Relu", [y], "output", name="relu_out")
    b.output("output")
    return b.build()


def _feeds(model, seed):
    return B.random_inputs(model, num=1, seed=seed)


@pytest.fixture(scope="module")
def cnn():
    model = plain_cnn()
    table = B.amax_table(model, _feeds(model, 1))
    trt = B.quantize_tensorrt_float32_weights(model, scales=table, progress=False)  # weight for weight
    cpu = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False)
    return model, table, trt, cpu


# --------------------------------------------------------------------------- form
def test_zero_points_are_128_or_0_for_non_negative_tensors(cnn):
    """uint8 activations: zero point 0 for Relu outputs (directly or through MaxPool, GlobalAveragePool,
    Flatten) and for the Conv outputs requantized with such a tensor's scale, 128 elsewhere; weights int8
    with zero point 0, except where the activation input keeps zero point 128: there uint8 ``q + 128``
    with zero point 128 (the same values, no 16-bit saturation)."""
    _, _, trt, cpu = cnn
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in cpu.model.graph.initializer}
    zps = {n.input[0]: inits[n.input[2]] for n in cpu.model.graph.node if n.op_type == "QuantizeLinear"}
    assert all(zp.dtype == np.uint8 for zp in zps.values())
    assert {t: int(zp) for t, zp in zps.items()} == {
        "input": 128, "c1_out": 0, "pool_out": 0, "c2_out": 0, "r2_out": 0, "flat_out": 0}
    weights = {n.input[0]: (inits[n.input[0]], inits[n.input[2]]) for n in cpu.model.graph.node
               if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    c1_q, c1_zero = weights["c1.weight_quantized"]
    assert c1_q.dtype == np.uint8 and (c1_zero == 128).all()
    for name in ("c2.weight_quantized", "fc.weight_quantized"):
        assert weights[name][0].dtype == np.int8 and not weights[name][1].any()
    trt_inits = {i.name: onnx.numpy_helper.to_array(i) for i in trt.model.graph.initializer}
    same = weights["c1.weight_quantized"][0].astype(np.int16) - 128
    assert np.array_equal(same, trt_inits["c1.weight_quantized"].astype(np.int16))


def test_learned_scales_are_unchanged(cnn):
    _, _, trt, cpu = cnn
    trt_scales = {r["tensor"]: r["scale"] for r in trt.inserted if r["kind"] == "activation"}
    cpu_scales = {r["tensor"]: r["scale"] for r in cpu.inserted if r["kind"] == "activation"}
    assert trt_scales and all(cpu_scales[t] == s for t, s in trt_scales.items())
    # the requantization points reuse the scale of the quantized tensor they reach
    for point in cpu.requantization:
        if point["rule"] == "CPU4":  # the fc MatMul kept apart from its bias Add: no scale of its own
            assert point["status"] == "kept apart" and point["node"] == "fc"
            continue
        assert point["status"] == "added"
        downstream = point["amax_source"].split("'")[1]
        assert cpu_scales[point["tensor"]] == trt_scales[downstream]


def test_same_values_as_the_tensorrt_target_in_reference_semantics(cnn):
    """uint8 with zero point 128 is bit-identical to int8 with zero point 0, and requantizing before
    Relu/MaxPool with the downstream scale and zero point 0 changes no quantized value up to the amax
    (onnxruntime, optimizations off; the calibration data stays within every amax)."""
    model, _, trt, cpu = cnn
    feeds = _feeds(model, 1)
    assert np.array_equal(B.run(cpu.model, feeds)[0], B.run(trt.model, feeds)[0])


def test_values_above_the_amax_are_kept_where_zero_point_is_0(cnn):
    """Zero point 0 clamps at 255 steps instead of 127: on inputs 1.5x the calibration range the ort-cpu
    form (reference arithmetic) keeps what the tensorrt form clamps, so it is closer to FP32."""
    model, _, trt, cpu = cnn
    feeds = {k: 1.5 * v for k, v in _feeds(model, 1).items()}
    ref = B.run(model, feeds)[0]
    got_cpu, got_trt = B.run(cpu.model, feeds)[0], B.run(trt.model, feeds)[0]
    assert not np.array_equal(got_cpu, got_trt)
    assert np.abs(got_cpu - ref).max() < np.abs(got_trt - ref).max()


def test_onnxruntime_forms_integer_kernels(cnn, tmp_path):
    _, _, trt, cpu = cnn
    ops = B.optimized_ops(cpu.model, tmp_path)
    assert ops.count("QLinearConv") == 2, ops
    assert not {"Conv", "FusedConv"} & set(ops), ops
    assert "QLinearConv" not in B.optimized_ops(trt.model, tmp_path)  # the TensorRT form has no output Q
    # c1 -> Q -> DQ -> r1 -> MaxPool -> Q (one scale, zero point 0): onnxruntime drops the Relu and the
    # DQ -> Q pair, so the first QLinearConv writes the second one's input directly
    first, last = ops.index("QLinearConv"), len(ops) - 1 - ops[::-1].index("QLinearConv")
    assert not {"QuantizeLinear", "DequantizeLinear", "Relu"} & set(ops[first:last]), ops


def test_outputs_close_to_the_tensorrt_target(cnn):
    """onnxruntime with its integer kernels versus the TensorRT-target model in reference Q/DQ arithmetic
    (onnxruntime with graph optimizations off, which is what TensorRT computes up to rounding), on 32
    samples (4 batches of 8): the mean difference is under 25% of the TensorRT target's own mean error
    versus FP32 (measured 0.08-0.16 over 10 such sets), the max difference under 60% of its max error
    (0.21-0.50: a value on a rounding boundary rounds the other way), the ort-cpu model's own max error
    at most 1.25x the TensorRT target's (0.85-1.13), and top-1 agrees on every sample.
    (With zero point 128 on Relu outputs onnxruntime's 16-bit sums saturate on AVX2: 2x that error.)"""
    model, _, trt, cpu = cnn
    runs = [(B.run(model, f)[0], B.run(trt.model, f)[0], B.run_optimized(cpu.model, f))
            for f in (_feeds(model, seed) for seed in (7, 8, 9, 10))]
    ref, got_trt, got_cpu = (np.concatenate(outputs) for outputs in zip(*runs))
    assert ref.shape == (32, 10)
    trt_error, diff = np.abs(got_trt - ref), np.abs(got_cpu - got_trt)
    assert trt_error.max() > 0
    assert diff.mean() < 0.25 * trt_error.mean(), (diff.mean(), trt_error.mean())
    assert diff.max() < 0.6 * trt_error.max(), (diff.max(), trt_error.max())
    assert np.abs(got_cpu - ref).max() <= 1.25 * trt_error.max()
    assert (got_cpu.argmax(1) == got_trt.argmax(1)).all()


# --------------------------------------------------------------------------- requantization points
def test_residual_conv_uses_its_own_range_when_the_table_has_it(tmp_path):
    model = folded_residual()
    table = B.amax_table(model, _feeds(model, 1))  # every tensor, including conv2's output
    result = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False)
    points = {p["node"]: p for p in result.requantization}
    assert set(points) == {"stem", "conv1", "conv2"}
    assert points["conv2"]["status"] == "added"
    assert points["conv2"]["amax_source"] == "scale table (its own range)"
    assert points["conv2"]["amax"] == pytest.approx(table.activations["conv2_out"])
    assert points["stem"]["amax_source"] == "scale of 'stem_relu_out'"
    assert B.optimized_ops(result.model, tmp_path).count("QLinearConv") == 3


def test_missing_range_leaves_the_conv_float_and_says_so(tmp_path):
    model = folded_residual()
    placement = onnx_qat.place(model)
    table = B.amax_table(model, _feeds(model, 1), tensors=placement.activation_tensors())
    result = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False)
    points = {p["node"]: p for p in result.requantization}
    assert points["conv2"]["status"] == "not requantized" and points["conv2"]["amax"] is None
    assert any("conv2" in n and "float output" in n for n in result.to_report()["notes"])
    ops = B.optimized_ops(result.model, tmp_path)
    assert ops.count("QLinearConv") == 2 and {"Conv", "FusedConv"} & set(ops), ops


def test_quantize_with_data_calibrates_the_requantization_points():
    model = folded_residual()
    result = onnx_qat.quantize(model, data=B.random_inputs(model, num=1, seed=3), target="ort-cpu",
                               progress=False)
    assert "conv2_out" in result.scales.activations
    assert {p["node"]: p["status"] for p in result.requantization}["conv2"] == "added"


def test_tensorrt_target_has_no_requantization_points(cnn):
    _, _, trt, _ = cnn
    assert trt.requantization == () and trt.to_report()["requantization"] == []


def test_check_differs_by_the_uint8_zero_points_and_the_requantization_points():
    """Rules that differ for this target: C4 (uint8 zero point 128 instead of int8 0, on purpose), and the
    warnings C11 (the residual branch straight from a Conv is quantized) and C14 (a Q/DQ between Conv and
    Relu): both are the requantization points onnxruntime needs for QLinearConv."""
    model = folded_residual()
    result = onnx_qat.quantize(model, scales=B.amax_table(model, _feeds(model, 1)), target="ort-cpu",
                               progress=False)
    report = onnx_qat.check(result.model)
    assert {f.rule for f in report.findings} == {"C4", "C11", "C14"}
    assert {f.rule for f in report.findings if f.severity == "warning"} == {"C11", "C14"}


def test_check_for_the_ort_cpu_target_passes_with_no_findings(cnn):
    """``check(..., target="ort-cpu")`` replaces C4 by the form's zero points (int8 0, uint8 any) and
    leaves out C11/C14 (the requantization points): the ort-cpu model has no finding at all."""
    model = folded_residual()
    result = onnx_qat.quantize(model, scales=B.amax_table(model, _feeds(model, 1)), target="ort-cpu",
                               progress=False)
    report = onnx_qat.check(result.model, target="ort-cpu")
    assert report.passed and report.findings == ()
    assert onnx_qat.check(cnn[2].model, target="ort-cpu").passed  # a tensorrt model is a valid ort-cpu form


def test_check_for_the_ort_cpu_target_still_refuses_other_zero_points(cnn):
    model = onnx.ModelProto()
    model.CopyFrom(cnn[3].model)
    zp = next(i for i in model.graph.initializer if i.name == "input_zero_point")
    zp.CopyFrom(onnx.numpy_helper.from_array(np.array(100, np.uint8), zp.name))
    assert onnx_qat.check(model, target="ort-cpu").passed  # uint8: an asymmetric range's zero point
    zp.CopyFrom(onnx.numpy_helper.from_array(np.array(3, np.int8), zp.name))
    findings = onnx_qat.check(model, target="ort-cpu").findings
    assert "C4" in [f.rule for f in findings] and "input_zero_point" in findings[0].message
    with pytest.raises(onnx_qat.errors.ConfigError, match="target 'gpu'"):
        onnx_qat.check(model, target="gpu")


def test_cli_report_lists_the_requantization_points(tmp_path, capsys):
    model = folded_residual()
    src, scales = tmp_path / "m.onnx", tmp_path / "s.json"
    onnx.save(model, str(src))
    B.amax_table(model, _feeds(model, 1)).save(scales)
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    assert main(["quantize", str(src), "--scales", str(scales), "--target", "ort-cpu", "-o", str(out),
                 "--report", str(report), "--no-progress"]) == 0
    data = json.loads(report.read_text())
    assert data["target"]["name"] == "ort-cpu" and data["target"]["activation_dtype"] == "uint8"
    assert [p["tensor"] for p in data["requantization"]] == ["stem_out", "conv1_out", "conv2_out"]
    assert all(p["rule"] == "CPU1" and p["reason"] for p in data["requantization"])


def test_notes_count_the_zero_point_0_tensors():
    model = folded_residual()
    result = onnx_qat.quantize(model, scales=B.amax_table(model, _feeds(model, 1)), target="ort-cpu",
                               progress=False)
    zps = {r["tensor"]: r["zero_point"] for r in result.inserted if r["kind"] == "activation"}
    assert zps == {"input": 128, "stem_out": 0, "stem_relu_out": 0, "conv1_out": 0, "relu1_out": 0,
                   "conv2_out": 128}
    note = next(n for n in result.to_report()["notes"] if "zero point 0" in n)
    assert "2 non-negative tensor(s) and 2 requantization point(s)" in note and "clamped" in note


def test_zero_pad_commutes_exactly():
    """A ResNet stem: Conv -> Relu -> Pad (zeros) -> MaxPool -> Conv. The first Conv's output takes the
    MaxPool output's scale and zero point 0 (bit-identical values within the amax), and the MaxPool output
    is non-negative (zero point 0, so the second Conv keeps int8 weights)."""
    b = B.GraphBuilder("stem", 0)
    x = b.input("input", [2, 16, 10, 10])
    y = b.relu(b.conv(x, 16, 16, "stem"), "stem_relu")
    pads = b.const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    y = b.node("Pad", [y, pads], name="pad", mode="constant")
    y = b.node("MaxPool", [y], name="pool", kernel_shape=[3, 3], strides=[2, 2])
    b.conv(y, 16, 16, "next")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    model = b.build()
    table = B.amax_table(model, _feeds(model, 1))
    cpu = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False)
    trt = B.quantize_tensorrt_float32_weights(model, scales=table, progress=False)  # weight for weight
    point = {p["node"]: p for p in cpu.requantization}["stem"]
    assert point["amax_source"] == "scale of 'pool_out'"
    zps = {r["tensor"]: r["zero_point"] for r in cpu.inserted if r["kind"] == "activation"}
    assert zps["pool_out"] == 0 and zps["stem_out"] == 0
    assert "zero_point" not in {r["tensor"]: r for r in cpu.inserted if r["kind"] == "weight"}["next.weight"]
    feeds = _feeds(model, 1)
    assert np.array_equal(B.run(cpu.model, feeds)[0], B.run(trt.model, feeds)[0])
