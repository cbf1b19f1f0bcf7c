"""Rule CPU8: the ``ort-cpu`` form leaves out the Q/DQ pairs no integer kernel of onnxruntime's CPU
provider reads or writes (a pooling input before a squeeze-excitation Conv kept float, a ConvTranspose's
input and weight). Checked in the graph onnxruntime actually runs: no QuantizeLinear there feeds only
DequantizeLinears, and every integer kernel of the form without the rule is still there."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.insertion import ort_cpu
from onnx_qat.insertion.ort_cpu import ROUND_TRIP_RULE
from tests import builders as B

_INTEGER = ("QLinearConv", "QLinearGlobalAveragePool", "QLinearSigmoid", "QLinearMul", "QLinearAdd",
            "QLinearConcat", "MatMulIntegerToFloat", "QLinearMatMul", "QGemm")


def _optimized(model: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    B.optimized_ops(model, tmp_path)
    return onnx.load(str(tmp_path / "optimized.onnx"))


def round_trips(model: onnx.ModelProto, tmp_path) -> list:
    """QuantizeLinear nodes of the graph onnxruntime runs whose every reader is a DequantizeLinear: a
    tensor quantized and dequantized in float, for no integer kernel."""
    graph = _optimized(model, tmp_path).graph
    readers: dict = {}
    for node in graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node.op_type)
    return [n.name for n in graph.node if n.op_type == "QuantizeLinear"
            and readers.get(n.output[0]) and set(readers[n.output[0]]) == {"DequantizeLinear"}]


def integer_kernels(model: onnx.ModelProto, tmp_path) -> Counter:
    return Counter(n.op_type for n in _optimized(model, tmp_path).graph.node if n.op_type in _INTEGER)


def se_net(seed: int = 0, channels: int = 16, size: int = 16) -> onnx.ModelProto:
    """stem Conv -> Relu -> squeeze-excitation (GlobalAveragePool -> conv_r -> Relu -> conv_e -> Sigmoid ->
    Mul) -> conv2 -> Relu -> residual Add with the stem -> ConvTranspose (stride 2) -> Relu -> head Conv."""
    b = B.GraphBuilder("se_net", seed)
    x = b.input("input", ["N", 3, size, size])
    stem = b.relu(b.conv(x, 3, channels, "stem"), "stem_relu")
    s = b.node("GlobalAveragePool", [stem], name="gap")
    s = b.conv(b.relu(b.conv(s, channels, 4, "conv_r", k=1), "relu_r"), 4, channels, "conv_e", k=1)
    y = b.node("Mul", [stem, b.node("Sigmoid", [s], name="gate")], name="excite")
    y = b.relu(b.conv(y, channels, channels, "conv2"), "relu2")
    y = b.node("Add", [y, stem], name="join")
    w = b.weight("up.weight", [channels, channels, 2, 2])
    y = b.relu(b.node("ConvTranspose", [y, w], name="up", kernel_shape=[2, 2], strides=[2, 2]), "up_relu")
    y = b.conv(y, channels, 4, "head")
    b.node("Identity", [y], "output", name="out")
    b.output("output")
    return b.build()


def _quantize(model, data, **kw):
    return onnx_qat.quantize(model, data={"input": data}, method="max", target="ort-cpu", progress=False,
                             **kw)


def _without_rule(monkeypatch, model, data, **kw):
    """The form as it was before rule CPU8 (the rule's function returns nothing left out); ``data``: the
    input's array, or a feed dict."""
    with monkeypatch.context() as patch:
        patch.setattr(ort_cpu, "_round_trips", lambda index, marks, placement, points: (
            [], placement.weights, placement.decisions))
        if isinstance(data, dict):
            return onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False, **kw)
        return _quantize(model, data, **kw)


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 255.0)])
@pytest.mark.parametrize("kept_float", [(), ("conv_r", "conv_e"), ("conv_r", "conv_e", "conv2")])
def test_no_round_trip_is_left_and_no_integer_kernel_is_lost(monkeypatch, tmp_path, seed, scale, kept_float):
    """Sites kept float as a latency placement keeps them (``exclude_nodes``), images normalized or
    0..255: the form runs the same integer kernels as without the rule, with no float Q -> DQ left."""
    model = se_net(seed)
    rng = np.random.default_rng(seed)
    calib = (rng.uniform(0, 1, (8, 3, 16, 16)) * scale).astype(np.float32)
    test = (rng.uniform(0, 1, (8, 3, 16, 16)) * scale).astype(np.float32)
    kw = {"exclude_nodes": tuple(re.escape(n) for n in kept_float)}
    result = _quantize(model, calib, **kw)
    before = _without_rule(monkeypatch, model, calib, **kw)
    assert round_trips(result.model, tmp_path) == []
    assert round_trips(before.model, tmp_path)  # the TensorRT placement's pairs made some
    assert integer_kernels(result.model, tmp_path) == integer_kernels(before.model, tmp_path)
    assert integer_kernels(result.model, tmp_path)["QLinearConv"] == 3 - ("conv2" in kept_float) + (
        0 if kept_float else 2)
    B.assert_check_clean(result.model, target="ort-cpu")
    left = [r for r in result.requantization if r["rule"] == ROUND_TRIP_RULE]
    assert ("up", "ConvTranspose") in {(r["node"], r["op_type"]) for r in left}
    assert all(r["status"] == "left float" and r["reason"] for r in left)
    # ConvTranspose has no integer kernel there: its weight is not quantized, its decision says why
    assert not any(r["kind"] == "weight" and "up:1" in r["nodes"] for r in result.inserted)
    assert "up.weight_quantized" not in {i.name for i in result.model.graph.initializer}
    decision = result.placement.decision_for("up")
    assert decision.action == "skip" and decision.rule == ROUND_TRIP_RULE
    # fewer roundings: the output error is not larger than the form's without the rule
    ref = B.run(model, {"input": test})[0]
    err = np.abs(B.run_optimized(result.model, {"input": test}) - ref).mean()
    err_before = np.abs(B.run_optimized(before.model, {"input": test}) - ref).mean()
    assert err <= err_before * 1.0001 + 1e-7


def test_the_pooling_pair_before_a_float_squeeze_excitation_is_left_out(tmp_path):
    """With the squeeze-excitation Convs float, nothing reads the pooling's input on integers: its pair
    (placement rule for pooling inputs, a TensorRT fusion) is left out and recorded."""
    model = se_net()
    calib = np.random.default_rng(0).uniform(0, 1, (8, 3, 16, 16)).astype(np.float32)
    result = _quantize(model, calib, exclude_nodes=("conv_r", "conv_e"))
    ops = B.optimized_ops(result.model, tmp_path)
    assert "QLinearGlobalAveragePool" not in ops and "GlobalAveragePool" in ops
    plain = _quantize(model, calib)  # every site integer: the pooling runs on integers and keeps its pair
    assert "QLinearGlobalAveragePool" in B.optimized_ops(plain.model, tmp_path)
    assert "stem_relu_out" in B.qdq_pairs(plain.model)


def test_the_tensorrt_form_keeps_its_pairs():
    """The rule is the CPU form's: the tensorrt form of the same model keeps the ConvTranspose quantized."""
    model = se_net()
    calib = np.random.default_rng(0).uniform(0, 1, (8, 3, 16, 16)).astype(np.float32)
    result = onnx_qat.quantize(model, data={"input": calib}, method="max", progress=False)
    assert any(r["kind"] == "weight" and "up:1" in r["nodes"] for r in result.inserted)
    assert not [r for r in result.requantization if r.get("rule") == ROUND_TRIP_RULE]


def test_a_pooling_read_through_a_computed_reshape_stays_on_integers(monkeypatch, tmp_path):
    """As paddle2onnx writes a classifier head (the PP-OCR angle classifier): MaxPool -> GlobalAveragePool,
    whose output a Shape reads (for a Reshape's computed shape) beside the Reshape into the Gemm.
    onnxruntime folds the Shape of a static shape and moves the Gemm input's QuantizeLinear up through the
    Reshape, so the pooling runs as QLinearGlobalAveragePool: the rule leaves its input's pair in place
    (a first version took it out)."""
    b = B.GraphBuilder("head", 0)
    x = b.input("input", [1, 3, 16, 16])  # a static shape: onnxruntime folds the Shape
    y = b.relu(b.conv(x, 3, 16, "stem"), "stem_relu")
    y = b.node("MaxPool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    g = b.node("GlobalAveragePool", [y], name="gap")
    batch = b.node("Slice", [b.node("Shape", [g], name="shape"), b.const("zero", np.array([0], np.int64)),
                             b.const("one", np.array([1], np.int64))], name="batch")
    shape = b.node("Concat", [batch, b.const("rest", np.array([-1], np.int64))], name="shape_cat", axis=0)
    flat = b.node("Reshape", [g, shape], name="flat")
    w = b.weight("fc.weight", [4, 16])
    b.node("Gemm", [flat, w, b.const("fc.bias", np.zeros(4, np.float32))], "output", name="fc", transB=1)
    b.output("output")
    model = b.build()
    calib = np.random.default_rng(0).uniform(0, 1, (8, 3, 16, 16)).astype(np.float32)
    result = _quantize(model, calib)
    before = _without_rule(monkeypatch, model, calib)
    kernels = integer_kernels(result.model, tmp_path)
    assert kernels["QLinearGlobalAveragePool"] == 1 and kernels == integer_kernels(before.model, tmp_path)
    assert not [r for r in result.requantization if r["rule"] == ROUND_TRIP_RULE]
    assert round_trips(result.model, tmp_path) == []
    B.assert_check_clean(result.model, target="ort-cpu")


@pytest.mark.parametrize("kept_float", [0, 59])
def test_the_real_pp_ocr_detector(monkeypatch, tmp_path, kept_float):
    """The real PP-OCRv4 text detector (from the rapidocr wheel, cached; skipped with the reason when it
    cannot be fetched), every site integer and with 59 of its 62 Convs kept float (as a latency placement
    on a many-core server keeps them): no round trip left, the same integer kernels, its two
    ConvTransposes float; with the Convs float, the pairs before its squeeze-excitation poolings go too."""
    from tests.onnx_qat.test_real_models import wheel_member

    path = str(wheel_member("rapidocr-onnxruntime==1.4.4",
                            "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"))
    convs = [n.name for n in onnx.load(path).graph.node if n.op_type == "Conv"]
    calib = np.random.default_rng(0).uniform(0, 1, (4, 3, 160, 160)).astype(np.float32)
    kw = {"exclude_nodes": tuple(re.escape(n) for n in convs[len(convs) - kept_float:])}
    result = onnx_qat.quantize(path, data={"x": calib}, method="max", target="ort-cpu", progress=False, **kw)
    before = _without_rule(monkeypatch, path, {"x": calib}, **kw)
    assert round_trips(result.model, tmp_path) == []
    assert len(round_trips(before.model, tmp_path)) == (2 if not kept_float else 12)
    assert integer_kernels(result.model, tmp_path) == integer_kernels(before.model, tmp_path)
    left = [r for r in result.requantization if r["rule"] == ROUND_TRIP_RULE]
    assert sum(r["op_type"] == "ConvTranspose" for r in left) == 2
    B.assert_check_clean(result.model, target="ort-cpu")


def test_a_table_calibrated_for_the_cpu_form_leaves_out_the_same_pairs(tmp_path):
    """``calibrate(..., target="ort-cpu")`` then ``quantize(scales=...)`` (ranges calibrated for the form,
    used as with data): the same pairs are left out and the same integer kernels run as with the data
    given to ``quantize``; a table of the tensorrt form (ranges as learned in QAT) keeps them all."""
    model = se_net()
    calib = np.random.default_rng(0).uniform(0, 1, (8, 3, 16, 16)).astype(np.float32)
    kw = {"exclude_nodes": ("conv_r", "conv_e")}
    direct = _quantize(model, calib, **kw)
    table = onnx_qat.calibrate(model, {"input": calib}, method="max", target="ort-cpu", progress=False)
    given = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False, **kw)
    left = sorted(r["tensor"] for r in direct.requantization if r["rule"] == ROUND_TRIP_RULE)
    assert left and left == sorted(r["tensor"] for r in given.requantization if r["rule"] == ROUND_TRIP_RULE)
    assert integer_kernels(given.model, tmp_path) == integer_kernels(direct.model, tmp_path)
    assert round_trips(given.model, tmp_path) == []
    learned = onnx_qat.calibrate(model, {"input": calib}, method="max", target="tensorrt", progress=False)
    kept = onnx_qat.quantize(model, scales=learned, target="ort-cpu", progress=False, **kw)
    assert not [r for r in kept.requantization if r["rule"] == ROUND_TRIP_RULE]
