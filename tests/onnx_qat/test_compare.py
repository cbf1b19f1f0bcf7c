"""compare(): figures against NumPy, thresholds, the typed result and its text."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.runtime.compare import Comparison, OutputComparison, compare, output_figures
from onnx_qat.errors import ConfigError, DataError, ModelError

W = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)


def _classifier(w: np.ndarray = W, out_name: str = "logits", classes: int = 5) -> onnx.ModelProto:
    """x[N,6] -> MatMul(w) -> logits[N,5]."""
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], [out_name], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["N", classes])],
                              [numpy_helper.from_array(w[:, :classes], "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


X = np.random.default_rng(1).standard_normal((20, 6)).astype(np.float32)


def test_identical_models_pass_with_zero_error(tmp_path):
    path = tmp_path / "a.onnx"
    path.write_bytes(_classifier().SerializeToString())
    result = compare(path, _classifier(), {"x": X}, max_abs=1e-6, min_sqnr_db=60, min_top1=1.0)
    assert isinstance(result, Comparison) and result and result.passed
    (out,) = result.outputs
    assert out.max_abs == 0.0 and out.mean_abs == 0.0 and out.max_rel == 0.0
    assert out.cosine == pytest.approx(1.0) and math.isinf(out.sqnr_db) and out.top1 == 1.0
    assert result.num_samples == 20
    assert str(result).startswith("PASSED | output 'logits' | max abs 0.0e+00 ≤ 1.0e-06 | cosine 1.00000")
    assert "SQNR inf dB ≥ 60.0 dB" in str(result) and "top-1 100.0%" in str(result)


def test_perturbed_model_fails_with_right_figures():
    noise = np.random.default_rng(2).standard_normal(W.shape).astype(np.float32) * 0.3
    result = compare(_classifier(), _classifier(W + noise), {"x": X}, max_abs=1e-3, batch_size=7)
    assert not result
    (out,) = result.outputs
    ref, cand = X @ W, X @ (W + noise)
    diff = np.abs(ref.astype(np.float64) - cand)
    assert out.max_abs == pytest.approx(diff.max(), rel=1e-5)
    assert out.mean_abs == pytest.approx(diff.mean(), rel=1e-5)
    cos = float((ref * cand).sum() / (np.linalg.norm(ref) * np.linalg.norm(cand)))
    assert out.cosine == pytest.approx(cos, rel=1e-5)
    sqnr = 10 * np.log10((ref.astype(np.float64) ** 2).sum() / ((ref - cand).astype(np.float64) ** 2).sum())
    assert out.sqnr_db == pytest.approx(sqnr, rel=1e-4)
    assert out.top1 == pytest.approx(float(np.mean(ref.argmax(1) == cand.argmax(1))))
    assert not out.passed and out.reason.startswith("max abs")
    text = str(result)
    assert text.startswith("FAILED | output 'logits' | max abs") and "> 1.0e-03" in text
    assert "\n" not in text


def test_thresholds_each_can_fail():
    ref = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    swapped = np.array([[1.0, 3.0, 2.0], [3.0, 2.0, 1.0]])
    from onnx_qat.runtime.compare import judge

    assert judge("y", ref, ref).passed
    assert "top-1" in judge("y", ref, swapped, min_cosine=None, min_top1=0.9).reason
    assert "cosine" in judge("y", ref, -ref).reason
    assert "SQNR" in judge("y", ref, ref * 1.1, min_sqnr_db=30).reason
    assert judge("y", ref, ref * 1.1, min_sqnr_db=19.9).passed
    assert "NaN" in judge("y", ref, np.full_like(ref, np.nan)).reason


def test_figures_without_class_axis_and_zero_reference():
    figures = output_figures(np.zeros(4), np.zeros(4))
    assert figures["cosine"] == 1.0 and figures["top1"] is None and math.isinf(figures["sqnr_db"])
    figures = output_figures(np.array([0.0, 1.0]), np.array([0.0, 1.5]))
    assert figures["max_rel"] == pytest.approx(0.5)


def test_to_dict_and_frozen():
    result = compare(_classifier(), _classifier(), {"x": X})
    data = result.to_dict()
    assert data["passed"] is True and data["num_samples"] == 20
    assert data["outputs"][0]["name"] == "logits" and data["outputs"][0]["thresholds"]["min_cosine"] == 0.99
    with pytest.raises(Exception):
        result.outputs[0].max_abs = 1.0  # frozen
    assert isinstance(result.outputs[0], OutputComparison)


def test_generated_data_when_none_and_num_samples():
    result = compare(_classifier(), _classifier(), num_samples=3)
    assert result and result.num_samples == 3
    assert compare(_classifier(), _classifier(), {"x": X}, num_samples=5).num_samples == 5


def test_mismatched_outputs_and_inputs():
    with pytest.raises(ModelError, match="output names differ"):
        compare(_classifier(), _classifier(out_name="probs"), {"x": X})
    with pytest.raises(ModelError, match="shape"):
        compare(_classifier(), _classifier(classes=4), {"x": X})
    with pytest.raises(DataError):
        compare(_classifier(), _classifier(), {"x": np.ones((2, 7), np.float32)})
    with pytest.raises(ConfigError):
        compare(_classifier(), _classifier(), {"x": X}, min_top1=99)


@pytest.mark.parametrize("seed", [0, 1])
def test_tensorrt_form_is_judged_by_exact_qdq_arithmetic_not_fused_cpu_kernels(seed):
    """``keras.applications.MobileNetV2(weights=None)``'s initialization (inputs 0..255) shrinks the
    activations to ~1e-9: onnxruntime's optimized session of the TensorRT form loses the output, the
    exact Q/DQ arithmetic keeps it, and compare judges the TensorRT form by the latter."""
    import onnx_qat
    from onnx_qat.runtime.sessions import needs_exact_qdq
    from tests.builders import mobilenet_v2_model

    model = mobilenet_v2_model(size=32, width=0.25, seed=seed)
    x = np.random.default_rng(seed).uniform(0, 255, (8, 3, 32, 32)).astype(np.float32)
    trt = onnx_qat.quantize(model, data={"input": x}, method="max", progress=False).model
    cpu = onnx_qat.quantize(model, data={"input": x}, method="max", target="ort-cpu", progress=False).model
    assert needs_exact_qdq(trt) and not needs_exact_qdq(cpu) and not needs_exact_qdq(model)
    exact = compare(model, trt, {"input": x}, min_cosine=None)
    fused = compare(model, trt, {"input": x}, min_cosine=None, exact_qdq=False)
    assert exact.outputs[0].cosine > 0.99
    assert fused.outputs[0].cosine < 0.9  # what onnxruntime's fused CPU kernels give
    forced = compare(model, trt, {"input": x}, min_cosine=None, exact_qdq=True)  # float model unoptimized too
    assert forced.outputs[0].cosine == pytest.approx(exact.outputs[0].cosine, abs=1e-6)
    with pytest.raises(ConfigError, match="exact_qdq"):
        compare(model, trt, {"input": x}, exact_qdq="yes")


def test_cli_compare_exact_qdq_options(tmp_path, capsys):
    import json

    import onnx_qat
    from onnx_qat.cli import main
    from tests.builders import mobilenet_v2_model

    model = mobilenet_v2_model(size=32, width=0.25)
    x = np.random.default_rng(0).uniform(0, 255, (4, 3, 32, 32)).astype(np.float32)
    trt = onnx_qat.quantize(model, data={"input": x}, method="max", progress=False).model
    paths = [tmp_path / "f.onnx", tmp_path / "q.onnx"]
    onnx.save(model, paths[0])
    onnx.save(trt, paths[1])
    np.savez(tmp_path / "d.npz", input=x)
    cosines = {}
    for flag in ("--exact-qdq", "--no-exact-qdq", None):
        argv = ["compare", *map(str, paths), "--data", str(tmp_path / "d.npz"), "--json",
                "--min-cosine", "0.9"]
        code = main(argv + ([flag] if flag else []))
        cosines[flag] = (code, json.loads(capsys.readouterr().out)["outputs"][0]["cosine"])
    assert cosines[None][0] == 0 and cosines["--exact-qdq"][0] == 0 and cosines["--no-exact-qdq"][0] == 1
    assert cosines[None][1] == pytest.approx(cosines["--exact-qdq"][1], abs=1e-6)
