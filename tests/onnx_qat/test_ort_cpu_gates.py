"""Rule CPU5: Sigmoid gates (swish ``x * Sigmoid(x)``, squeeze-excitation ``x * Sigmoid(s)``) in the
``ort-cpu`` form run on onnxruntime's integer kernels (``QLinearSigmoid``, ``QLinearMul``) instead of in
float between a DequantizeLinear and a QuantizeLinear, which made EfficientNetB0's form slower than FP32."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.insertion.ort_cpu import GATE_RULE
from tests import builders as B

_FLOAT_GATE_OPS = {"Sigmoid", "Mul", "QuickGelu"}


def swish_model(channels: int = 32, size: int = 16, se: bool = False, seed: int = 0) -> onnx.ModelProto:
    """conv1 -> swish (``swish``: Mul of conv1_out and Sigmoid(conv1_out)) -> [squeeze-excitation: GAP ->
    conv_r -> Relu -> conv_e -> Sigmoid -> ``excite`` Mul] -> conv2 -> output."""
    b = B.GraphBuilder("swish", seed)
    x = b.input("input", ["N", channels, size, size])
    y = b.conv(x, channels, channels, "conv1", k=1)
    y = b.node("Mul", [y, b.node("Sigmoid", [y], name="sig")], name="swish")
    if se:
        s = b.node("GlobalAveragePool", [y], name="gap")
        s = b.conv(b.relu(b.conv(s, channels, 8, "conv_r", k=1), "relu_r"), 8, channels, "conv_e", k=1)
        y = b.node("Mul", [y, b.node("Sigmoid", [s], name="gate")], name="excite")
    y = b.conv(y, channels, channels, "conv2", k=1)
    b.node("Identity", [y], "output", name="out")
    b.output("output")
    return b.build()


def _data(seed: int, channels: int = 32, size: int = 16, num: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((num, channels, size, size)).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_swish_runs_on_integer_kernels(seed, tmp_path):
    model = swish_model(seed=seed)
    calib, test = _data(seed), _data(10 + seed)
    result = onnx_qat.quantize(model, data={"input": calib}, method="max", target="ort-cpu", progress=False)
    ops = B.optimized_ops(result.model, tmp_path)
    assert ops.count("QLinearConv") == 2 and "QLinearSigmoid" in ops and "QLinearMul" in ops, ops
    assert not _FLOAT_GATE_OPS & set(ops), ops
    assert ops.count("QuantizeLinear") == ops.count("DequantizeLinear") == 1  # uint8 from Conv to Conv
    gates = [r for r in result.requantization if r["rule"] == GATE_RULE]
    assert [(g["tensor"], g["status"], g["swish"]) for g in gates] == [("sig_out", "quantized gate", True)]
    acts = {r["tensor"]: r for r in result.inserted if r["kind"] == "activation"}
    assert acts["sig_out"]["zero_point"] == 0 and acts["sig_out"]["scale"] == pytest.approx(1 / 255)
    B.assert_check_clean(result.model, target="ort-cpu")
    ref = B.run(model, {"input": test})[0]
    got = B.run_optimized(result.model, {"input": test})
    assert np.abs(got - ref).mean() < 0.01 * (ref.max() - ref.min())


def test_squeeze_excitation_gate_runs_on_integer_kernels(tmp_path):
    model = swish_model(se=True)
    result = onnx_qat.quantize(model, data={"input": _data(0)}, method="max", target="ort-cpu",
                               progress=False)
    gates = {r["tensor"]: r for r in result.requantization if r["rule"] == GATE_RULE}
    assert set(gates) == {"sig_out", "gate_out"} and gates["gate_out"]["swish"] is False
    ops = B.optimized_ops(result.model, tmp_path)
    assert ops.count("QLinearSigmoid") == 2 and ops.count("QLinearMul") == 2, ops
    assert not _FLOAT_GATE_OPS & set(ops), ops
    B.assert_check_clean(result.model, target="ort-cpu")


def test_a_gate_whose_output_stays_float_is_left_float(tmp_path):
    """Nothing quantizes the swish output (a graph output): no Q/DQ is added around its Sigmoid."""
    b = B.GraphBuilder("swish_out", 0)
    x = b.input("input", ["N", 16, 8, 8])
    y = b.conv(x, 16, 16, "conv1", k=1)
    b.node("Mul", [y, b.node("Sigmoid", [y], name="sig")], "output", name="swish")
    b.output("output")
    model = b.build()
    result = onnx_qat.quantize(model, data={"input": _data(0, 16, 8)}, method="max", target="ort-cpu",
                               progress=False)
    assert not [r for r in result.requantization if r["rule"] == GATE_RULE]
    assert "sig_out" not in B.qdq_pairs(result.model)


def test_the_tensorrt_form_has_no_gate_marks():
    model = swish_model()
    result = onnx_qat.quantize(model, data={"input": _data(0)}, method="max", progress=False)
    assert "sig_out" not in B.qdq_pairs(result.model)


def test_gates_with_a_given_scale_table(tmp_path):
    """A ScaleTable given (ranges for the placement's tensors and the Convs' outputs, as a calibrated
    quantize writes it; ``onnx-qat calibrate`` observes the placement's tensors only, and without the
    Conv output's range its requantization point and the gate are not formed): the gate's Sigmoid output
    takes amax 1 (it has no range in the table) at zero point 0, and the chain still runs on integers."""
    model = swish_model(seed=2)
    first = onnx_qat.quantize(model, data={"input": _data(2)}, method="max", target="ort-cpu", progress=False)
    table = first.scales.subset([t for t in first.scales.activations if t != "sig_out"])
    result = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False)
    gate = next(r for r in result.requantization if r["rule"] == GATE_RULE)
    assert gate["tensor"] == "sig_out" and gate["amax"] == 1.0
    acts = {r["tensor"]: r for r in result.inserted if r["kind"] == "activation"}
    assert acts["sig_out"]["zero_point"] == 0 and acts["sig_out"]["scale"] == pytest.approx(1 / 127)
    ops = B.optimized_ops(result.model, tmp_path)
    assert "QLinearSigmoid" in ops and "QLinearMul" in ops and not _FLOAT_GATE_OPS & set(ops), ops
    B.assert_check_clean(result.model, target="ort-cpu")
