"""Rule CPU6: a residual join onnxruntime runs in float (no other input quantized) loses the Q/DQ pair that
placement rule 6 puts on its skip input for TensorRT's Add-into-Conv fusion; a join whose other input is
quantized (a Conv's requantization point) keeps it and runs as ``QLinearAdd``."""
from __future__ import annotations

import numpy as np
import pytest

import onnx_qat
from onnx_qat.insertion.ort_cpu import JOIN_RULE
from tests import builders as B


def _block_data(seed: int, num: int = 16, shift: float = 0.0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((num, 8, 32)) + shift) * scale).astype(np.float32)


@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_transformer_residual_stream_is_left_float(scale, tmp_path):
    """A residual stream large against its branches (scale 100, as a ViT's patch embedding of 0..255
    images gives): the skip Q/DQ rounded it; without it the deployed form's output error is 0.04x the
    tensorrt form's (exact arithmetic, rule 6's pairs). At scale 1 measured 1.16x: there the stream's
    rounding is small and the deployed form's 7-bit weights behind signed inputs cost more."""
    model = B.transformer_block_model(mask="-1e9")
    calib, test = _block_data(0, scale=scale), _block_data(1, scale=scale)
    cpu = onnx_qat.quantize(model, data={"input": calib}, method="max", target="ort-cpu", progress=False)
    trt = onnx_qat.quantize(model, data={"input": calib}, method="max", progress=False)
    joins = {r["node"]: r for r in cpu.requantization if r["rule"] == JOIN_RULE}
    assert set(joins) == {"res1", "res2"} and {r["status"] for r in joins.values()} == {"left float"}
    pairs = B.qdq_pairs(cpu.model)
    assert "input" not in pairs and "res1_out" not in pairs
    assert {("res1", 0)} <= set(B.qdq_pairs(trt.model)["input"])  # the tensorrt form keeps rule 6
    B.assert_check_clean(cpu.model, target="ort-cpu")
    ref = np.stack([B.run(model, {"input": x[None]})[0] for x in test])
    error_cpu = np.abs(np.stack([B.run_optimized(cpu.model, {"input": x[None]}) for x in test]) - ref).mean()
    error_trt = np.abs(np.stack([B.run(trt.model, {"input": x[None]})[0] for x in test]) - ref).mean()
    assert error_cpu < (1.3 if scale == 1.0 else 0.1) * error_trt, (error_cpu, error_trt)
    assert "QLinearAdd" not in B.optimized_ops(cpu.model, tmp_path)


def test_a_join_with_a_quantized_branch_keeps_its_skip_pair(tmp_path):
    """ResNet's block: the other input is the Conv's requantization point (onnxruntime's QLinearAdd when the
    sum is quantized too), so the skip keeps its pair."""
    model = B.residual_block_model(channels=16, size=8)
    data = {"input": np.random.default_rng(0).standard_normal((4, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False)
    assert not [r for r in result.requantization if r["rule"] == JOIN_RULE]
    assert ("add", 1) in B.qdq_pairs(result.model)["stem_relu_out"]
    B.assert_check_clean(result.model, target="ort-cpu")


def _matmul_join_model(kind: str, seed: int = 0):
    """Joins whose addends come from bias-free MatMuls, as ``check`` rule C10 sees them: ``split``:
    ``x @ Wa + x @ Wb`` (a split projection, both addends from quantized MatMuls); ``attention``:
    ``x + LayerNorm(x) @ Wo`` (an output projection without bias and its skip)."""
    b = B.GraphBuilder(f"{kind}_join", seed)
    x = b.input("input", [1, 8, 32])
    if kind == "split":
        left, right = b.linear(x, 32, 32, "a", bias=False), b.linear(x, 32, 32, "b", bias=False)
    else:
        gamma = b.const("ln.gamma", np.ones(32, np.float32))
        beta = b.const("ln.beta", np.zeros(32, np.float32))
        h = b.node("LayerNormalization", [x, gamma, beta], name="ln", axis=-1, epsilon=1e-5)
        left, right = x, b.linear(h, 32, 32, "out_proj", bias=False)
    b.node("Add", [left, right], "output", name="join")
    b.output("output")
    return b.build()


@pytest.mark.parametrize("kind", ["split", "attention"])
@pytest.mark.parametrize("seed", [0, 3])
def test_matmul_joins_check_clean_in_both_forms(kind, seed, tmp_path):
    """The ort-cpu form of a join fed by quantized MatMuls has no Q/DQ on either addend (rule CPU6:
    onnxruntime runs it in float beside MatMulIntegerToFloat); its own check (rule C10 is TensorRT's
    Add-into-MatMul fusion and is left out for ort-cpu) finds nothing, while the tensorrt rules would still
    ask for the skip's pair. The tensorrt form keeps rule 6's pair and checks clean."""
    model = _matmul_join_model(kind, seed)
    calib, test = _block_data(seed, scale=4.0), _block_data(seed + 1, num=4, scale=4.0)
    cpu = onnx_qat.quantize(model, data={"input": calib}, method="max", target="ort-cpu", progress=False)
    trt = onnx_qat.quantize(model, data={"input": calib}, method="max", progress=False)
    B.assert_check_clean(cpu.model, target="ort-cpu")
    B.assert_check_clean(trt.model)
    skip = "b_out" if kind == "split" else "input"
    assert ("join", 1 if kind == "split" else 0) in B.qdq_pairs(trt.model)[skip]
    assert not [t for t, uses in B.qdq_pairs(cpu.model).items() if any(n == "join" for n, _ in uses)]
    assert [r["node"] for r in cpu.requantization if r["rule"] == JOIN_RULE] == ["join"]
    as_tensorrt = onnx_qat.check(cpu.model)
    assert [f.rule for f in as_tensorrt.warnings] == ["C10"]  # the TensorRT fusion the CPU form does without
    ops = B.optimized_ops(cpu.model, tmp_path)
    assert ops.count("MatMulIntegerToFloat") == (2 if kind == "split" else 1) and "QLinearAdd" not in ops
    ref = np.stack([B.run(model, {"input": x[None]})[0] for x in test])
    out = np.stack([B.run_optimized(cpu.model, {"input": x[None]}) for x in test])
    assert B.cosine(out, ref) > 0.999
