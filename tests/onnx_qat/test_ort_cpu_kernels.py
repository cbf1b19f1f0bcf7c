"""The ``ort-cpu`` form reaches onnxruntime's integer kernels: MatMul + bias Add kept apart from
``MatMulAddFusion`` (rule CPU4), and 7-bit GEMM weights behind zero-point-128 inputs (uint8 x int8
kernels that cannot saturate in 16 bits) when the ranges are calibrated."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest

import onnx_qat
from tests import builders as B


def _block_data(seed: int, num: int = 8, seq: int = 16, dim: int = 64):
    return {"input": np.random.default_rng(seed).standard_normal((num, seq, dim)).astype(np.float32)}


@pytest.fixture(scope="module")
def block():
    model = B.transformer_block_model(seq=16, dim=64, heads=4)
    result = onnx_qat.quantize(model, data=_block_data(1), method="max", target="ort-cpu", progress=False,
                               cpu_vnni=False)  # the portable form, whatever CPU runs the tests
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


def _biases_as_constants(model):
    """``model`` with each bias Add's initializer written as a Constant node instead (as paddle2onnx
    writes them)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    adds = {t for n in graph.node if n.op_type == "Add" for t in n.input}
    biases = [t for t in graph.initializer if t.name in adds and len(t.dims) == 1]
    kept = [t for t in graph.initializer if t not in biases]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    constants = [onnx.helper.make_node("Constant", [], [t.name], name=f"{t.name}_const", value=t)
                 for t in biases]
    nodes = constants + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model, [t.name for t in biases]


def test_constant_node_biases_are_kept_apart_too(block, tmp_path, caplog):
    """A bias written by a Constant node (PP-OCRv4's recognizer has nine such MatMuls) is read as
    [1, N] like an initializer's: before, the Add kept the Constant's rank-1 output (the report said
    otherwise) and every such MatMul logged a warning."""
    model, _ = block
    model, biases = _biases_as_constants(model)
    assert len(biases) >= 6
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        result = onnx_qat.quantize(model, data=_block_data(1), method="max", target="ort-cpu",
                                   progress=False, cpu_vnni=False)
    assert not [r for r in caplog.records if "MatMulAddFusion" in r.getMessage()]
    split = {r["node"] for r in result.requantization if r["rule"] == "CPU4"}
    assert split == {"q", "k", "v", "out_proj", "ffn1", "ffn2"}
    graph = result.model.graph
    inits = {t.name: list(t.dims) for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    for name in split:
        (add,) = [n for n in graph.node if n.op_type == "Add" and producer.get(n.input[0]) is not None
                  and producer[n.input[0]].name == name]
        bias = add.input[1]
        assert bias in inits and len(inits[bias]) == 2 and inits[bias][0] == 1, (name, bias)
    left = {n.output[0] for n in graph.node if n.op_type == "Constant"}
    assert not left & set(biases), left & set(biases)  # the rank-1 Constants nothing reads any more
    ops = B.optimized_ops(result.model, tmp_path)
    assert ops.count("MatMulIntegerToFloat") == 6 and "Gemm" not in ops, ops
    feeds = {"input": _block_data(2, num=1)["input"]}
    assert B.cosine(B.run(model, feeds)[0], B.run_optimized(result.model, feeds)) > 0.99
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


@pytest.mark.parametrize("declared", [True, False])
def test_a_declared_2d_input_makes_the_matmul_a_qgemm(tmp_path, declared):
    """A classifier head as paddle2onnx writes it (the document-orientation classifier): a MatMul with a
    bias Add, whose input comes from an op the rule cannot see the rank through (an Add of two
    activations). With the input's 2-D shape declared in value_info the MatMul becomes a Gemm without
    bias (QGemm); without it the form is unchanged and onnxruntime fuses MatMul and Add into a float
    Gemm (its input's pair then runs in float)."""
    b = B.GraphBuilder("head", 0)
    x = b.input("input", ["N", 32])
    h = b.node("Add", [b.relu(x, "relu_a"), b.node("Sigmoid", [x], name="gate")], name="mix")
    y = b.linear(h, 32, 8, "fc")
    b.node("Identity", [y], "output", name="out")
    b.output("output")
    model = b.build()
    if declared:
        declared_2d = onnx.helper.make_tensor_value_info(h, onnx.TensorProto.FLOAT, ["N", 32])
        model.graph.value_info.append(declared_2d)
    data = {"input": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False)
    split = [r for r in result.requantization if r["rule"] == "CPU4"]
    ops = B.optimized_ops(result.model, tmp_path)
    if declared:
        assert len(split) == 1 and "Gemm without bias" in split[0]["reason"]
        assert "QGemm" in ops and "Gemm" not in ops, ops
    else:
        assert not split or "[1, N]" in split[0]["reason"]
        assert "QGemm" not in ops and "MatMulIntegerToFloat" not in ops, ops
    feeds = {"input": data["input"][:4]}
    assert B.cosine(B.run(model, feeds)[0], B.run_optimized(result.model, feeds)) > 0.999


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
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False,
                               cpu_vnni=False)
    weights = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}
    assert "range" not in weights["dw_conv.weight"]  # its kernel sums in 32 bits
    assert weights["expand_conv.weight"]["range"] == [-63, 63]  # reads the signed graph input
    # reads a Relu output (zero point 0, the whole uint8 grid): 16-bit pair sums saturate there too
    assert weights["project_conv.weight"]["range"] == [-63, 63]


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


@pytest.mark.parametrize("flags, arch, wide", [
    (["avx2", "avx512f", "avx512bw"], "x86_64", False),  # AVX-512 core: vpmaddubsw, 16-bit pair sums
    (["avx2"], "x86_64", False),
    (["avx2", "avx512f", "avx512_vnni"], "x86_64", True),
    (["avx2", "avx_vnni"], "AMD64", True),
    (["avx2", "amx_tile", "amx_int8"], "x86_64", True),
    ([], "aarch64", True),  # NEON widening multiply-accumulate: 32-bit sums on every ARM64 CPU
    (["asimddp"], "arm64", True),
    ([], "riscv64", False),  # unknown: the form exact everywhere
])
def test_wide_dot_products_follows_the_kernels(flags, arch, wide):
    from onnx_qat.placement.cpu_latency import wide_dot_products

    got, reason = wide_dot_products(flags, arch)
    assert got is wide and reason


def test_cpu_vnni_auto_follows_this_machine(block):
    """The default (``"auto"``): 8-bit weights where this CPU sums int8 products in 32 bits, 7-bit
    otherwise; the result, the report and a note say which and why."""
    import platform

    from onnx_qat.placement.cpu_latency import machine_key, wide_dot_products

    model, _ = block
    result = onnx_qat.quantize(model, data=_block_data(1), method="max", target="ort-cpu", progress=False)
    wide, reason = wide_dot_products(machine_key(0)["flags"], platform.machine())
    assert dict(result.ort_cpu) == {"cpu_vnni": wide, "weight_bits": 8 if wide else 7, "chosen_by": "auto",
                                    "reason": reason}
    q = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}["q.weight"]
    assert q.get("range") == (None if wide else [-63, 63])
    report = result.to_report()
    assert report["ort_cpu"]["cpu_vnni"] is wide
    prefix = f"ort-cpu: Conv/Gemm/MatMul weights (depthwise Convs excepted) in {8 if wide else 7} bits"
    assert any(n.startswith(prefix) for n in report["notes"])
    forced = onnx_qat.quantize(model, data=_block_data(1), method="max", target="ort-cpu", progress=False,
                               cpu_vnni=not wide)
    assert forced.ort_cpu["chosen_by"] == "option" and forced.ort_cpu["cpu_vnni"] is (not wide)


def test_cpu_vnni_rejects_other_values(block):
    from onnx_qat.errors import ConfigError

    model, _ = block
    for value in ("yes", 1, None):
        with pytest.raises(ConfigError, match="cpu_vnni must be True, False or 'auto'"):
            onnx_qat.quantize(model, data=_block_data(1), target="ort-cpu", progress=False, cpu_vnni=value)

