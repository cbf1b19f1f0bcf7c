"""The ``ort-cpu`` form reaches onnxruntime's integer kernels: MatMul + bias Add kept apart from
``MatMulAddFusion`` (rule CPU4), and 7-bit GEMM weights behind zero-point-128 inputs (uint8 x int8
kernels that cannot saturate in 16 bits) when the ranges are calibrated."""
from __future__ import annotations

import numpy as np
import pytest

import onnx_qat
from tests import builders as B


def _block_data(seed: int, num: int = 8, seq: int = 16, dim: int = 64):
    return {"input": np.random.default_rng(seed).standard_normal((num, seq, dim)).astype(np.float32)}


@pytest.fixture(scope="module")
def block():
    model = B.transformer_block_model(seq=16, dim=64, heads=4)
    result = onnx_qat.quantize(model, data=_block_data(1), method="max", target="ort-cpu", progress=False)
    return model, result


def test_matmuls_with_a_bias_run_as_integer_kernels(block, tmp_path):
    """Before: every MatMul + bias Add became a float Gemm fed by a DequantizeLinear of its weight
    (no integer kernel at all); a 3-D input now keeps MatMulIntegerToFloat (bias read as [1, N])."""
    _, result = block
    ops = B.optimized_ops(result.model, tmp_path)
    assert ops.count("MatMulIntegerToFloat") == 6, ops  # q, k, v, out_proj, ffn1, ffn2
    assert "Gemm" not in ops and ops.count("DequantizeLinear") <= 2, ops
    split = [r for r in result.requantization if r["rule"] == "CPU4"]
    assert {r["node"] for r in split} == {"q", "k", "v", "out_proj", "ffn1", "ffn2"}
    assert all(r["status"] == "kept apart" and "[1, N]" in r["reason"] for r in split)
    B.assert_check_clean(result.model, target="ort-cpu")


def test_kept_apart_computes_the_same_values(block):
    """Reference arithmetic (optimizations off): the split model against the same Q/DQ model with the
    bias Adds left as they were differs only by float rounding."""
    model, result = block
    feeds = {"input": _block_data(2, num=1)["input"]}
    ref = B.run(model, feeds)[0]
    got = B.run(result.model, feeds)[0]
    deployed = B.run_optimized(result.model, feeds)
    error = np.abs(got - ref).mean()
    assert error < 0.05 * np.abs(ref).mean()
    assert np.abs(deployed - got).mean() <= 0.5 * error  # the integer kernels: same integers, other rounding


def test_two_d_matmul_becomes_qgemm(tmp_path):
    model = B.mlp_model(batch=4)
    data = {"input": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False)
    split = {r["node"]: r for r in result.requantization if r["rule"] == "CPU4"}
    assert set(split) == {"fc2"} and "Gemm without bias" in split["fc2"]["reason"]
    assert {n.op_type for n in result.model.graph.node if n.name == "fc2"} == {"Gemm"}
    ops = B.optimized_ops(result.model, tmp_path)
    # fc1 and fc2 run as QGemm; fc3 (a Gemm with a float bias whose output stays float, the graph
    # output) is left to onnxruntime, which runs it as a float Gemm
    assert ops.count("QGemm") == 2 and "MatMul" not in ops and ops.count("Gemm") == 1, ops
    feeds = {"input": data["input"][:4]}
    ref, got = B.run(model, feeds)[0], B.run_optimized(result.model, feeds)
    assert B.cosine(ref, got) > 0.999


def test_gemm_weights_behind_signed_inputs_use_7_bits_when_calibrated(block):
    _, result = block
    acts = {r["tensor"]: r for r in result.inserted if r["kind"] == "activation"}
    weights = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}
    ln1 = acts["ln1_out"]
    assert ln1["zero_point"] not in (0, 255)  # sign unknown: uint8 values up to 255 (asymmetric range)
    q = weights["q.weight"]
    assert q["range"] == [-63, 63] and "zero_point" not in q  # int8, zero point 0: the uint8 x int8 kernel
    from onnx import numpy_helper

    inits = {i.name: i for i in result.model.graph.initializer}
    stored = numpy_helper.to_array(inits[q["initializer"]])
    assert stored.dtype == np.int8 and np.abs(stored.astype(np.int16)).max() == 63


def test_a_given_scale_table_keeps_8_bit_unsigned_weights(block):
    """With a ScaleTable given (e.g. learned in QAT) the form keeps the tensorrt form's values: 8-bit
    weights, stored as uint8 q + 128 behind zero-point-128 inputs (the uint8 x uint8 kernel)."""
    model, calibrated = block
    result = onnx_qat.quantize(model, scales=calibrated.scales, target="ort-cpu", progress=False)
    q = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}["q.weight"]
    assert q.get("zero_point") == 128 and "range" not in q


def test_depthwise_weights_keep_8_bits():
    model = B.depthwise_model(channels=16, expand=2, size=8)
    data = {"input": np.random.default_rng(0).standard_normal((4, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False)
    weights = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}
    assert "range" not in weights["dw_conv.weight"]  # its kernel sums in 32 bits
    assert weights["expand_conv.weight"]["range"] == [-63, 63]  # reads the signed graph input
    assert "range" not in weights["project_conv.weight"]  # reads a Relu output (zero point 0)


def test_cpu_vnni_keeps_8_bit_int8_weights(block):
    """``cpu_vnni``: the model runs where int8 dot products sum in 32 bits; weights behind signed inputs
    stay int8 over [-127, 127] (the uint8 x int8 kernel, no uint8 copy)."""
    model, _ = block
    result = onnx_qat.quantize(model, data=_block_data(1), method="max", target="ort-cpu", progress=False,
                               cpu_vnni=True)
    q = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}["q.weight"]
    assert "range" not in q and "zero_point" not in q
    B.assert_check_clean(result.model, target="ort-cpu")


def test_cpu_vnni_needs_the_ort_cpu_target_and_data(block):
    from onnx_qat.errors import ConfigError

    model, calibrated = block
    with pytest.raises(ConfigError, match="cpu_vnni"):
        onnx_qat.quantize(model, data=_block_data(1), target="tensorrt", progress=False, cpu_vnni=True)
    with pytest.raises(ConfigError, match="cpu_vnni"):
        onnx_qat.quantize(model, scales=calibrated.scales, target="ort-cpu", progress=False, cpu_vnni=True)
