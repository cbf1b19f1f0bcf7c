"""tools/deploy_tensorrt.py: arguments, gate, onnxruntime validation, missing-TensorRT stop, and the
pure-number parts (health, parity, latency, layer analysis). Tests that need TensorRT and a GPU are
skipped with a reason where they are absent."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.deploy import command as deploy
from onnx_qat.deploy import backend as trt_backend

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "deploy_tensorrt.py"
CLASSES = 16


# --------------------------------------------------------------------------- tiny Q/DQ models
def qdq_conv_model(*, zero_point_dtype=np.int8, zero_point: int = 0, zero_weights: bool = False,
                   batch="N", height=8, width=8, seed: int = 0) -> onnx.ModelProto:
    """input [N,4,8,8] -> Q/DQ (activation) -> Conv (int8 weight -> DQ per channel, axis 0) -> Relu ->
    GlobalAveragePool -> Flatten -> output [N,16]."""
    rng = np.random.default_rng(seed)
    weight = np.zeros((CLASSES, 4, 3, 3), np.int8) if zero_weights else \
        rng.integers(-127, 128, (CLASSES, 4, 3, 3)).astype(np.int8)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(zero_point, zero_point_dtype), "x_zp"),
        numpy_helper.from_array(weight, "w_q"),
        numpy_helper.from_array(rng.uniform(0.001, 0.004, CLASSES).astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(CLASSES, np.int8), "w_zp"),
        numpy_helper.from_array((rng.standard_normal(CLASSES) * 0.1).astype(np.float32), "bias"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["input", "x_scale", "x_zp"], ["x_q"], name="input_q"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"], name="input_dq"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], name="weight_dq", axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq", "bias"], ["conv_out"], name="conv", kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["relu_out"], name="relu"),
        helper.make_node("GlobalAveragePool", ["relu_out"], ["pool_out"], name="pool"),
        helper.make_node("Flatten", ["pool_out"], ["output"], name="flatten"),
    ]
    graph = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info(
        "input", TensorProto.FLOAT, [batch, 4, height, width])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture()
def good_model(tmp_path) -> Path:
    path = tmp_path / "good.onnx"
    onnx.save(qdq_conv_model(), str(path))
    return path


@pytest.fixture()
def uint8_model(tmp_path) -> Path:
    path = tmp_path / "uint8.onnx"
    onnx.save(qdq_conv_model(zero_point_dtype=np.uint8, zero_point=128), str(path))
    return path


@pytest.fixture()
def no_tensorrt(monkeypatch):
    """Make ``import tensorrt`` fail in this process, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)


def run_main(argv, capsys):
    code = deploy.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def ort_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["output"], {"input": x})[0]


# --------------------------------------------------------------------------- arguments
def test_help_lists_every_option_in_a_subprocess():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for option in ("--engine", "--report", "--data", "--labels", "--num-samples", "--seed", "--shapes",
                   "--batch", "--fp16", "--workspace", "--timing-cache", "--iterations", "--warmup",
                   "--min-top1", "--max-abs", "--skip-validation", "--force", "--no-progress", "--verbose"):
        assert option in out.stdout, option
    assert "tensorrt" not in out.stderr.lower()


@pytest.mark.parametrize("shapes", ["input", "input:1x3,8x3", "input:1x3x0", "input:axb",
                                    "input:8x3,4x3,16x3", "input:1x3,1x3x3,1x3", ":1x3"])
def test_bad_shapes_string_is_one_line_exit_2(shapes, good_model, tmp_path, capsys):
    code, out, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--shapes", shapes], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--shapes" in err and "Traceback" not in err
    assert not (tmp_path / "m.engine").exists()


def test_parse_shape_spec_min_opt_max_and_static():
    profile = deploy.parse_shape_spec("input:1x3x224x224,8x3x224x224,32x3x224x224")
    assert (profile.name, profile.min, profile.opt, profile.max) == (
        "input", (1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))
    static = deploy.parse_shape_spec("ns:tensor:0:4x2")  # names may hold ':'
    assert static.name == "ns:tensor:0" and static.min == static.opt == static.max == (4, 2)


@pytest.mark.parametrize("argv, words", [
    (["--iterations", "0"], "--iterations"),
    (["--min-top1", "1.5"], "--min-top1"),
    (["--batch", "4", "--shapes", "input:1x4x8x8,4x4x8x8,8x4x8x8"], "--batch"),
    (["--shapes", "input:1x4x8x8", "--shapes", "input:2x4x8x8"], "more than once"),
    (["--unknown-option"], "--unknown-option"),
])
def test_bad_options_are_one_line_exit_2(argv, words, good_model, tmp_path, capsys):
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine"] + argv, capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_missing_engine_option_is_exit_2(good_model, capsys):
    code, _, err = run_main([good_model], capsys)
    assert code == 2 and "--engine" in err


# --------------------------------------------------------------------------- gate
def test_gate_refuses_uint8_zero_point_listing_the_rule(uint8_model, tmp_path, capsys):
    before = uint8_model.read_bytes()
    report = tmp_path / "r.json"
    code, out, err = run_main([uint8_model, "--engine", tmp_path / "m.engine", "--report", report], capsys)
    assert code == 2
    assert "C4" in err and "input_q" in err and "--force" in err.splitlines()[-1]
    assert "Traceback" not in err
    data = json.loads(report.read_text())
    assert data["status"] == "refused" and data["exit_code"] == 2
    assert any(f["rule"] == "C4" for f in data["check"]["findings"])
    assert data["validation"] is None  # refused before onnxruntime ran
    assert not (tmp_path / "m.engine").exists()
    assert uint8_model.read_bytes() == before


def test_force_passes_the_gate_and_validates(uint8_model, tmp_path, capsys, no_tensorrt):
    report = tmp_path / "r.json"
    code, out, err = run_main([uint8_model, "--engine", tmp_path / "m.engine", "--report", report, "--force",
                               "--no-progress"], capsys)
    assert code == 2  # stopped for want of TensorRT, after the gate and validation
    data = json.loads(report.read_text())
    assert data["check"]["passed"] is False
    assert data["validation"]["healthy"] is True
    assert data["status"] == "tensorrt-unavailable"


# --------------------------------------------------------------------------- validation
def test_validation_figures_match_onnxruntime(good_model, tmp_path, capsys, no_tensorrt):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 4, 8, 8)).astype(np.float32)
    expected = ort_outputs(good_model, x)
    labels = expected.argmax(axis=1)
    labels[:3] = (labels[:3] + 1) % CLASSES  # 7 of 10 right
    np.savez(tmp_path / "data.npz", input=x)
    np.save(tmp_path / "labels.npy", labels)
    report = tmp_path / "r.json"
    code, out, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report, "--data",
                               tmp_path / "data.npz", "--labels", tmp_path / "labels.npy", "--batch", "4",
                               "--no-progress"], capsys)
    assert code == 2, err
    validation = json.loads(report.read_text())["validation"]
    assert validation["num_samples"] == 10 and validation["batch_size"] == 4
    (health,) = validation["outputs"]
    assert health["name"] == "output" and health["shape"] == [10, CLASSES]
    assert health["min"] == pytest.approx(float(expected.min()), rel=1e-5, abs=1e-7)
    assert health["max"] == pytest.approx(float(expected.max()), rel=1e-5)
    assert health["mean"] == pytest.approx(float(expected.astype(np.float64).mean()), rel=1e-5)
    assert validation["accuracy"] == pytest.approx(0.7)
    assert "accuracy 70.00%" in out


def test_labels_named_inside_the_data_file(good_model, tmp_path, capsys, no_tensorrt):
    x = np.random.default_rng(5).standard_normal((6, 4, 8, 8)).astype(np.float32)
    labels = ort_outputs(good_model, x).argmax(axis=1)
    np.savez(tmp_path / "data.npz", input=x, labels=labels)
    report = tmp_path / "r.json"
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report, "--data",
                             tmp_path / "data.npz", "--labels", "labels", "--no-progress"], capsys)
    assert code == 2, err
    assert json.loads(report.read_text())["validation"]["accuracy"] == 1.0


def test_generated_inputs_when_no_data(good_model, tmp_path, capsys, no_tensorrt):
    report = tmp_path / "r.json"
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                             "--num-samples", "5", "--no-progress"], capsys)
    assert code == 2, err
    validation = json.loads(report.read_text())["validation"]
    assert validation["source"] == "generated" and validation["num_samples"] == 5
    assert validation["outputs"][0]["shape"] == [5, CLASSES]


def test_unhealthy_outputs_refused_before_the_build(tmp_path, capsys, no_tensorrt):
    path = tmp_path / "dead.onnx"
    onnx.save(qdq_conv_model(zero_weights=True), str(path))  # output = relu(bias) whatever the input
    report = tmp_path / "r.json"
    code, _, err = run_main([path, "--engine", tmp_path / "m.engine", "--report", report, "--no-progress"],
                            capsys)
    assert code == 2 and "unhealthy" in err and "identical for all" in err
    data = json.loads(report.read_text())
    assert data["status"] == "refused" and data["validation"]["healthy"] is False


def test_skip_validation_goes_straight_to_the_build(good_model, tmp_path, capsys, no_tensorrt):
    report = tmp_path / "r.json"
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                             "--skip-validation"], capsys)
    assert code == 2 and "TensorRT" in err
    data = json.loads(report.read_text())
    assert data["validation"] is None and data["status"] == "tensorrt-unavailable"


def test_dynamic_spatial_dims_need_shapes(tmp_path, capsys):
    path = tmp_path / "dyn.onnx"
    onnx.save(qdq_conv_model(height="H", width="W"), str(path))
    code, _, err = run_main([path, "--engine", tmp_path / "m.engine"], capsys)
    assert code == 2 and "--shapes input:MIN,OPT,MAX" in err and len(err.strip().splitlines()) == 1


def test_shapes_profile_drives_generated_inputs(tmp_path, capsys, no_tensorrt):
    path = tmp_path / "dyn.onnx"
    onnx.save(qdq_conv_model(height="H", width="W"), str(path))
    report = tmp_path / "r.json"
    code, _, err = run_main([path, "--engine", tmp_path / "m.engine", "--report", report,
                             "--num-samples", "3", "--shapes", "input:1x4x6x6,2x4x8x8,4x4x12x12",
                             "--no-progress"], capsys)
    assert code == 2, err
    data = json.loads(report.read_text())
    assert data["validation"]["batch_size"] == 2
    assert data["options"]["shapes"] == [{"name": "input", "min": [1, 4, 6, 6], "opt": [2, 4, 8, 8],
                                          "max": [4, 4, 12, 12]}]


@pytest.mark.parametrize("shapes, words", [
    ("other:1x4x8x8", "not a model input"),
    ("input:1x4x8", "rank"),
    ("input:1x3x8x8,2x3x8x8,4x3x8x8", "fixed to 4"),
])
def test_shapes_must_fit_the_model(shapes, words, good_model, tmp_path, capsys):
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--shapes", shapes], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_engine_path_equal_to_model_is_refused(good_model, capsys):
    before = good_model.read_bytes()
    code, _, err = run_main([good_model, "--engine", good_model], capsys)
    assert code == 2 and "--engine" in err and good_model.read_bytes() == before


@pytest.mark.parametrize("option", ["--report", "--timing-cache"])
def test_other_outputs_may_not_overwrite_inputs(option, good_model, tmp_path, capsys):
    before = good_model.read_bytes()
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", option, good_model], capsys)
    assert code == 2 and option in err and good_model.read_bytes() == before


def test_bad_data_file_is_one_line(good_model, tmp_path, capsys):
    np.savez(tmp_path / "data.npz", wrong_name=np.zeros((2, 4, 8, 8), np.float32),
             other=np.zeros((2, 4, 8, 8), np.float32))
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--data", tmp_path / "data.npz"],
                            capsys)
    assert code == 2 and "data.npz" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_labels_of_the_wrong_length_are_refused(good_model, tmp_path, capsys):
    np.savez(tmp_path / "data.npz", input=np.zeros((4, 4, 8, 8), np.float32), y=np.arange(3))
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--data", tmp_path / "data.npz",
                             "--labels", "y"], capsys)
    assert code == 2 and "3 labels for 4 samples" in err



def test_a_labels_file_of_two_arrays_keeps_its_own_message(good_model, tmp_path, capsys):
    # the DataError raised inside the reading block is a ValueError too: it must not be re-worded
    np.savez(tmp_path / "data.npz", input=np.zeros((4, 4, 8, 8), np.float32))
    np.savez(tmp_path / "labels.npz", a=np.arange(4), b=np.arange(4))
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--data", tmp_path / "data.npz",
                             "--labels", tmp_path / "labels.npz"], capsys)
    assert code == 2 and "holds 2 arrays; give a .npy or a one-array .npz" in err
    assert "not a readable NumPy file" not in err


# --------------------------------------------------------------------------- missing TensorRT
def test_missing_tensorrt_stops_with_one_line_in_a_subprocess(good_model, tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "tensorrt").mkdir(parents=True)
    (shadow / "tensorrt" / "__init__.py").write_text("raise ImportError('No module named tensorrt')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), str(ROOT)]))
    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, str(SCRIPT), str(good_model),
                          "--engine", str(tmp_path / "m.engine"), "--report", str(report), "--no-progress"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "TensorRT" in lines[0] and "pip install" in lines[0] and "Traceback" not in out.stderr
    assert "onnxruntime: ok | output 'output'" in out.stdout
    data = json.loads(report.read_text())
    assert data["status"] == "tensorrt-unavailable" and data["exit_code"] == 2
    assert data["check"]["passed"] is True and data["validation"]["healthy"] is True
    assert data["build"] is None
    assert not (tmp_path / "m.engine").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_missing_tensorrt_in_this_environment(good_model, tmp_path, capsys):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here; the shadowed-import test covers its absence")
    except ImportError:
        pass
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--no-progress"], capsys)
    assert code == 2 and "TensorRT is not installed" in err and len(err.strip().splitlines()) == 1


def test_interrupt_during_validation_leaves_no_output(good_model, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    engine, report = tmp_path / "m.engine", tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(good_model), "--engine", str(engine),
                             "--report", str(report), "--num-samples", "50000", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # "check: PASSED ..." once the gate is done and validation starts
        assert line.startswith("check:"), line
        time.sleep(0.3)
        if proc.poll() is not None:
            pytest.skip("the run finished before the signal could be sent")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["deploy_tensorrt.py: interrupted; no partial output was left"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.onnx"]


# --------------------------------------------------------------------------- numbers (pure NumPy)
def test_output_health_flags_nan_inf_constant_and_sample_independent_outputs():
    good = deploy.output_health("y", np.arange(12, dtype=np.float32).reshape(3, 4))
    assert good.problems == () and (good.min, good.max) == (0.0, 11.0) and good.mean == pytest.approx(5.5)
    bad = deploy.output_health("y", np.array([[1.0, np.nan], [np.inf, 2.0]], np.float32))
    assert (bad.num_nan, bad.num_inf) == (1, 1) and len(bad.problems) == 2
    constant = deploy.output_health("y", np.full((4, 3), 0.5, np.float32))
    assert constant.constant and "constant" in constant.problems[0]
    same = deploy.output_health("y", np.tile(np.array([[1.0, 2.0]], np.float32), (5, 1)))
    assert same.same_for_all_samples and "identical for all 5 samples" in same.problems[0]
    single = deploy.output_health("y", np.array([[1.0, 2.0]], np.float32))
    assert single.problems == ()  # one sample cannot show independence


def test_compare_outputs_figures_and_thresholds():
    ref = np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 1.0], [0.1, 0.2, 0.3], [1.0, 0.9, 0.0]], np.float32)
    got = ref.copy()
    got[3] = [0.8, 1.0, 0.0]  # argmax flips on one sample of four
    (parity,) = deploy.compare_outputs({"y": ref}, {"y": got}, min_top1=0.9)
    assert parity.top1 == pytest.approx(0.75) and not parity.passed and "75.0%" in parity.reason
    assert parity.max_abs == pytest.approx(0.2, rel=1e-5)
    assert parity.max_rel == pytest.approx(0.2, rel=1e-5)
    (ok,) = deploy.compare_outputs({"y": ref}, {"y": ref + 1e-4}, min_top1=0.99, max_abs=1e-3)
    assert ok.passed and ok.top1 == 1.0 and str(ok).startswith("PASSED")
    (too_far,) = deploy.compare_outputs({"y": ref}, {"y": ref + 1e-2}, max_abs=1e-3)
    assert not too_far.passed and "max abs" in too_far.reason
    (missing,) = deploy.compare_outputs({"y": ref}, {})
    assert not missing.passed


def test_compare_outputs_counts_non_finite_values_instead_of_printing_nan():
    """onnxruntime's NaN/Inf values (a masked score, an overflow) are left out of the figures and
    counted; the engine's NaN/Inf where onnxruntime's values are finite fail the output by name."""
    rng = np.random.default_rng(11)
    ref = rng.standard_normal((4, 6, 30)).astype(np.float32)
    ref[:, :, 0] = -np.inf  # a masked column
    got = ref + 1e-3 * rng.standard_normal(ref.shape).astype(np.float32)
    got[:, :, 0] = -np.inf
    (masked,) = deploy.compare_outputs({"scores": ref}, {"scores": got})
    assert masked.passed and masked.left_out == 24 and masked.nonfinite == 0
    assert masked.cosine > 0.9999 and np.isfinite(masked.max_abs) and "cosine 1.00000" in str(masked)
    assert "24 value(s) left out" in str(masked)
    broken = got.copy()
    broken[1, 2, 3] = np.nan
    broken[2, 0, 5] = np.inf
    (failed,) = deploy.compare_outputs({"scores": ref}, {"scores": broken})
    assert not failed.passed and failed.nonfinite == 2 and failed.cosine == 0.0
    assert "2 NaN or Inf value(s) where onnxruntime's are finite" in failed.reason
    assert failed.to_dict()["left_out"] == 24 and failed.to_dict()["nonfinite"] == 2


def test_accuracy_and_latency_summary():
    logits = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0]]
    assert deploy.accuracy({"y": logits}, np.array([0, 1, 2, 0, 0])) == pytest.approx(0.8)
    latency = deploy.summarize_latency([1.0, 2.0, 3.0, 4.0, 10.0], batch_size=8, warmup=2)
    assert latency.mean_ms == pytest.approx(4.0) and latency.median_ms == 3.0
    assert latency.p90_ms == pytest.approx(np.percentile([1, 2, 3, 4, 10], 90))
    assert latency.throughput == pytest.approx(8 * 1000 / 4.0)


def test_report_json_is_strict_even_with_non_finite_figures(tmp_path):
    health = deploy.output_health("y", np.array([[np.nan, np.nan]], np.float32))
    report = deploy.DeployReport(model="m.onnx", engine="m.engine", options={},
                                 validation={"outputs": [health.to_dict()]})
    report.write(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["validation"]["outputs"][0]["min"] == "nan" and data["version"] == deploy.REPORT_VERSION


# --------------------------------------------------------------------------- layer analysis
def _region(name, fmt):
    return {"Name": name, "Location": "Device", "Dimensions": [1, 16, 8, 8], "Format/Datatype": fmt}


INSPECTOR_JSON = json.dumps({"Layers": [
    {"Name": "input_q", "LayerType": "Scale", "Metadata": "[ONNX Layer: input_q]",
     "Inputs": [_region("input", "Row major linear FP32")],
     "Outputs": [_region("x_q", "Thirty-two wide channel vectorized row major Int8 format")]},
    {"Name": "input_dq + weight_dq + conv + relu", "LayerType": "CaskConvolution",
     "Metadata": "[ONNX Layer: input_dq]\x1e[ONNX Layer: weight_dq]\x1e[ONNX Layer: conv]\x1e"
                 "[ONNX Layer: relu]",
     "Inputs": [_region("x_q", "Thirty-two wide channel vectorized row major Int8 format")],
     "Outputs": [_region("relu_out", "Row major linear FP32")]},
    {"Name": "pool", "LayerType": "CaskPooling", "Inputs": [_region("relu_out", "Row major linear FP32")],
     "Outputs": [_region("pool_out", "Row major linear FP32")]},
    {"Name": "flatten", "LayerType": "NoOp", "Inputs": [_region("pool_out", "Row major linear FP32")],
     "Outputs": [_region("output", "Row major linear FP32")]},
    {"Name": "shape_calc", "LayerType": "Shuffle", "Inputs": [_region("s", "Row major linear Int32")],
     "Outputs": [_region("t", "Row major linear Int32")]},
], "Bindings": ["input", "output"]})


def test_analyse_layers_counts_precisions_and_names_unfused_qdq():
    summary = trt_backend.analyse_layers(INSPECTOR_JSON, ["input_q", "input_dq", "weight_dq"])
    assert (summary.total, summary.int8, summary.higher, summary.other) == (4, 1, 2, 1)
    assert summary.by_precision == {"FP32": 2, "INT8": 1, "INT32": 1}
    assert summary.unfused_qdq == ("input_q",)  # input_dq and weight_dq were fused into the conv
    assert summary.higher_precision_layers == ("input_q", "pool")


def test_analyse_layers_without_detailed_verbosity():
    summary = trt_backend.analyse_layers(json.dumps({"Layers": ["a", "b + c"]}), ["a"])
    assert not summary.detailed and summary.total == 2 and summary.unfused_qdq == ()


@pytest.mark.parametrize("fmt, precision", [
    ("Row major linear FP32", "FP32"), ("Channel major FP16 format where channel % 8 == 0", "FP16"),
    ("Thirty-two wide channel vectorized row major Int8 format", "INT8"), ("Half", "FP16"),
    ("Row major linear UInt8 format", "UINT8"), ("Row major linear BFloat16 format", "BF16"),
    ("Float", "FP32"),
])
def test_tensor_precision_from_inspector_formats(fmt, precision):
    assert trt_backend.tensor_precision(fmt) == precision


@pytest.mark.parametrize("version, fp16, mode", [
    ("10.3.0.26", False, trt_backend.STRONGLY_TYPED), ("10.0.1", True, trt_backend.WEAKLY_TYPED),
    ("8.6.1", False, trt_backend.FLAG_BASED), ("9.2.0", True, trt_backend.FLAG_BASED),
    ("11.4.0", False, trt_backend.STRONGLY_TYPED), ("11.0.0", True, trt_backend.STRONGLY_TYPED),
])
def test_build_mode_follows_the_tensorrt_version(version, fp16, mode):
    assert trt_backend.choose_build_mode(version, fp16) == mode
    if version.startswith("11"):  # FP8 and INT4 with --fp16 too: the float parts are converted first
        assert trt_backend.choose_build_mode(version, fp16, "fp8") == trt_backend.STRONGLY_TYPED


@pytest.mark.parametrize("version, fp16, converts", [
    ("11.4.0", True, True), ("11.0.1.5", True, True), ("11.4.0", False, False), ("10.13.2", True, False),
    ("8.6.1", True, False), (None, True, False),
])
def test_fp16_converts_the_float_parts_only_on_tensorrt_11(version, fp16, converts):
    assert trt_backend.converts_float_parts(version, fp16) is converts


# --------------------------------------------------------------------------- API stand-in (CPU)
# A CPU stand-in for the parts of the TensorRT and cuda-python APIs the script calls (names and
# signatures from the TensorRT 10 and 11 Python API references and cuda-python's runtime bindings;
# TensorRT 11 as its migration guide describes it: BuilderFlag.FP16/INT8 removed,
# NetworkDefinitionCreationFlag.STRONGLY_TYPED kept but ignored, the inspector's "Bindings" list
# replaced by "I/O Tensors" objects). The
# "engine" is the ONNX model run by onnxruntime; "device memory" is host memory. It checks how the
# script drives the API (network flags, builder flags, profiles, timing cache, buffers, events, the
# report) on machines without a GPU. It says nothing about TensorRT's own numerics or speed: the
# skipped tests further down do, on a GPU.
class _Enum:
    def __init__(self, **members):
        for name, value in members.items():
            setattr(self, name, value)


class _StandInTensorRT(types.ModuleType):
    """``tensorrt`` as far as onnx_qat/deploy/backend.py uses it; records what the script asked for."""

    def __init__(self, version: str):
        super().__init__("tensorrt")
        self.__version__ = version
        self.calls = {"network_flags": [], "builder_flags": [], "profiles": [], "pool_limits": [],
                      "verbosity": [], "timing_cache_in": []}
        major = self.major = int(version.split(".")[0])
        flags = {"STRONGLY_TYPED": 1} if major >= 10 else {"EXPLICIT_BATCH": 0}
        if 9 <= major <= 10:
            flags.update(EXPLICIT_BATCH=0, STRONGLY_TYPED=1)
        self.NetworkDefinitionCreationFlag = _Enum(**flags)
        self.BuilderFlag = _Enum(REFIT=5) if major >= 11 else _Enum(INT8=2, FP16=0)
        self.MemoryPoolType = _Enum(WORKSPACE=0)
        self.ProfilingVerbosity = _Enum(LAYER_NAMES_ONLY=0, NONE=1, DETAILED=2)
        self.LayerInformationFormat = _Enum(ONELINE=0, JSON=1)
        self.TensorIOMode = _Enum(NONE=0, INPUT=1, OUTPUT=2)
        self.DataType = _Enum(FLOAT=0)
        module = self

        class ILogger:
            Severity = _Enum(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)

            def __init__(self):
                pass

        self.ILogger = ILogger
        self.nptype = lambda dtype: np.float32

        class Builder:
            def __init__(self, logger):
                self.logger = logger

            def create_network(self, flags):
                module.calls["network_flags"].append(flags)
                return _Network()

            def create_builder_config(self):
                return _Config(module)

            def create_optimization_profile(self):
                return _Profile()

            def build_serialized_network(self, network, config):
                module.calls["profiles"].extend(config.profiles)
                return network.model_bytes

        class OnnxParser:
            def __init__(self, network, logger):
                self.network, self.errors = network, []

            def parse(self, model_bytes, path=None):
                model = onnx.load_from_string(model_bytes)
                for index, node in enumerate(model.graph.node):
                    if not onnx.defs.has(node.op_type):
                        self.errors.append(_ParserError(index, node))
                self.network.load(model, model_bytes)
                return not self.errors

            @property
            def num_errors(self):
                return len(self.errors)

            def get_error(self, index):
                return self.errors[index]

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, data):
                return _Engine(module, bytes(data))

        self.Builder, self.OnnxParser, self.Runtime = Builder, OnnxParser, Runtime


class _ParserError:
    def __init__(self, index, node):
        self.index, self.onnx_node = index, node

    def desc(self):
        return f"No importer registered for op: {self.onnx_node.op_type}"

    def node(self):
        return self.index

    def node_name(self):
        return self.onnx_node.name

    def node_operator(self):
        return self.onnx_node.op_type


class _Network:
    def load(self, model, model_bytes):
        self.model_bytes = model_bytes
        self.inputs = []
        for value in model.graph.input:
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
            self.inputs.append(types.SimpleNamespace(name=value.name, shape=tuple(dims)))

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, index):
        return self.inputs[index]


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, low, opt, high):
        self.shapes[name] = (tuple(low), tuple(opt), tuple(high))


class _TimingCache:
    def __init__(self, data):
        self.data = bytes(data) or b"timing-cache"

    def serialize(self):
        return self.data + b"+"


class _Config:
    def __init__(self, trt):
        self.trt, self.profiles = trt, []

    def set_memory_pool_limit(self, pool, size):
        self.trt.calls["pool_limits"].append((pool, size))

    def set_flag(self, flag):
        self.trt.calls["builder_flags"].append(flag)

    def add_optimization_profile(self, profile):
        self.profiles.append(profile.shapes)

    def create_timing_cache(self, data):
        self.trt.calls["timing_cache_in"].append(bytes(data))
        return _TimingCache(data)

    def set_timing_cache(self, cache, ignore_mismatch):
        return True

    def __setattr__(self, name, value):
        if name == "profiling_verbosity":
            self.trt.calls["verbosity"].append(value)
        object.__setattr__(self, name, value)


class _Engine:
    def __init__(self, trt, model_bytes):
        self.trt, self.model = trt, onnx.load_from_string(model_bytes)
        options = ort.SessionOptions()
        # the stand-in computes as TensorRT does: every Q/DQ by its definition, none of onnxruntime's
        # fused integer kernels (MatMulNBits, QLinearConv...), as the onnxruntime gate of step 2 does
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        self.names = ([i.name for i in self.session.get_inputs()]
                      + [o.name for o in self.session.get_outputs()])
        self.num_inputs = len(self.session.get_inputs())

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_mode(self, name):
        return (self.trt.TensorIOMode.INPUT if self.names.index(name) < self.num_inputs
                else self.trt.TensorIOMode.OUTPUT)

    def get_tensor_dtype(self, name):
        return self.trt.DataType.FLOAT

    def create_execution_context(self):
        return _Context(self)

    def create_engine_inspector(self):
        return _Inspector(self)


class _Context:
    def __init__(self, engine):
        self.engine, self.shapes, self.addresses = engine, {}, {}

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        feed = {n: np.zeros(s, np.float32) for n, s in self.shapes.items()}
        if len(feed) == self.engine.num_inputs:
            for out, value in zip(self.engine.names[self.engine.num_inputs:],
                                  self.engine.session.run(None, feed)):
                self.shapes[out] = value.shape
        return True

    def get_tensor_shape(self, name):
        return self.shapes[name]

    def set_tensor_address(self, name, pointer):
        self.addresses[name] = pointer
        return True

    def execute_async_v3(self, stream):
        assert isinstance(stream, int)
        feed = {}
        for name in self.engine.names[:self.engine.num_inputs]:
            shape = self.shapes[name]
            size = int(np.prod(shape)) * 4
            feed[name] = np.frombuffer((ctypes.c_char * size).from_address(self.addresses[name]),
                                       np.float32).reshape(shape).copy()
        for name, value in zip(self.engine.names[self.engine.num_inputs:],
                               self.engine.session.run(None, feed)):
            value = np.ascontiguousarray(value, np.float32)
            ctypes.memmove(self.addresses[name], value.ctypes.data, value.nbytes)
        return True


class _Inspector:
    """Layer information in the inspector's JSON layout: Q nodes standalone, DQ fused into consumers."""

    def __init__(self, engine):
        self.engine, self.execution_context = engine, None

    def get_engine_information(self, fmt):
        int8 = "Thirty-two wide channel vectorized row major Int8 format"
        layers, pending = [], []
        for node in self.engine.model.graph.node:
            if node.op_type == "DequantizeLinear":
                pending.append(node.name)
                continue
            if node.op_type in ("Relu", "BatchNormalization") and layers \
                    and layers[-1]["LayerType"] == "Conv":
                layers[-1]["Name"] += f" + {node.name}"  # fused into the convolution, as TensorRT does
                layers[-1]["Metadata"] += f"\x1e[ONNX Layer: {node.name}]"
                continue
            in_fmt = int8 if pending else "Row major linear FP32"
            out_fmt = int8 if node.op_type == "QuantizeLinear" else "Row major linear FP32"
            names = pending + [node.name]
            layers.append({"Name": " + ".join(names), "LayerType": "Scale" if node.op_type == "QuantizeLinear"
                           else node.op_type, "Metadata": "\x1e".join(f"[ONNX Layer: {n}]" for n in names),
                           "Inputs": [{"Name": node.input[0], "Format/Datatype": in_fmt}],
                           "Outputs": [{"Name": node.output[0], "Format/Datatype": out_fmt}]})
            pending = []
        if self.engine.trt.major >= 11:
            return json.dumps({"Layers": layers, "I/O Tensors": [
                {"Name": n, "IOMode": "Input" if i < self.engine.num_inputs else "Output",
                 "DataType": "Float"}
                for i, n in enumerate(self.engine.names)]})
        return json.dumps({"Layers": layers, "Bindings": self.engine.names})


def _standin_cudart():
    ok = "cudaSuccess"
    memory, events = {}, {}

    def malloc(size):
        buffer = ctypes.create_string_buffer(size)
        memory[ctypes.addressof(buffer)] = buffer
        return ok, ctypes.addressof(buffer)

    def memcpy(dst, src, count, kind, stream):
        ctypes.memmove(dst, src, count)
        return (ok,)

    def record(event, stream):
        events[event] = time.perf_counter()
        return (ok,)

    counter = iter(range(1, 1 << 30))
    return types.SimpleNamespace(
        cudaError_t=_Enum(cudaSuccess=ok),
        cudaMemcpyKind=_Enum(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2),
        cudaGetDeviceCount=lambda: (ok, 1),
        cudaGetDeviceProperties=lambda device: (ok, types.SimpleNamespace(name=b"stand-in device\0")),
        cudaStreamCreate=lambda: (ok, 7), cudaStreamSynchronize=lambda stream: (ok,),
        cudaStreamDestroy=lambda stream: (ok,), cudaMalloc=malloc,
        cudaFree=lambda pointer: ((ok,) if memory.pop(pointer, None) is not None
                                  else ("cudaErrorInvalidValue",)),
        cudaMemcpyAsync=memcpy, cudaEventCreate=lambda: (ok, next(counter)), cudaEventRecord=record,
        cudaEventSynchronize=lambda event: (ok,), cudaEventDestroy=lambda event: (ok,),
        cudaEventElapsedTime=lambda start, end: (ok, 1000.0 * (events[end] - events[start]) + 0.25),
        memory=memory)


@pytest.fixture()
def standin(monkeypatch):
    """Install the stand-in ``tensorrt`` (version set by the test) and ``cuda.bindings.runtime``."""
    cudart = _standin_cudart()
    cuda_pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    bindings.runtime, cuda_pkg.bindings = cudart, bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cudart)

    def install(version="10.3.0"):
        trt = _StandInTensorRT(version)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        return trt, cudart
    return install


def test_standin_strongly_typed_build_time_verify_and_report(good_model, tmp_path, capsys, standin):
    trt, cudart = standin("10.3.0")
    x = np.random.default_rng(1).standard_normal((10, 4, 8, 8)).astype(np.float32)
    labels = ort_outputs(good_model, x).argmax(axis=1)
    np.savez(tmp_path / "data.npz", input=x, labels=labels)
    report, cache, engine = tmp_path / "r.json", tmp_path / "t.cache", tmp_path / "m.engine"
    code, out, err = run_main([good_model, "--engine", engine, "--report", report,
                               "--data", tmp_path / "data.npz", "--labels", "labels", "--batch", "4",
                               "--timing-cache", cache, "--workspace", "64",
                               "--iterations", "7", "--warmup", "2", "--no-progress"], capsys)
    assert code == 0, err
    assert trt.calls["network_flags"] == [1 << trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED]
    assert trt.calls["builder_flags"] == []  # strongly typed: no INT8 flag, no calibrator
    assert trt.calls["pool_limits"] == [(trt.MemoryPoolType.WORKSPACE, 64 << 20)]
    assert trt.calls["verbosity"] == [trt.ProfilingVerbosity.DETAILED]
    assert trt.calls["profiles"] == [{"input": ((1, 4, 8, 8), (4, 4, 8, 8), (4, 4, 8, 8))}]
    assert trt.calls["timing_cache_in"] == [b""] and cache.read_bytes() == b"timing-cache+"
    assert onnx.load_from_string(engine.read_bytes()).graph.name == "qdq_conv"  # the stand-in's "engine"
    data = json.loads(report.read_text())
    assert data["status"] == "verified" and data["exit_code"] == 0
    assert data["build"]["mode"] == "strongly-typed" and data["build"]["tensorrt_version"] == "10.3.0"
    assert data["build"]["device"] == "stand-in device"
    assert data["latency"]["iterations"] == 7 and data["latency"]["batch_size"] == 4
    assert data["latency"]["min_ms"] >= 0.25
    (parity,) = data["parity"]
    assert parity["passed"] and parity["top1"] == 1.0 and parity["max_abs"] < 1e-5
    assert data["accuracy"] == {"tensorrt": 1.0, "onnxruntime": 1.0, "num_samples": 10}
    assert data["layers"]["int8"] == 1 and data["layers"]["unfused_qdq"] == ["input_q"]
    assert cudart.memory == {}  # every device buffer freed
    assert "parity: PASSED" in out and "layers: 1 INT8" in out

    # a second build reads the timing cache the first one wrote
    code, _, err = run_main([good_model, "--engine", engine, "--timing-cache", cache, "--iterations", "2",
                             "--no-progress"], capsys)
    assert code == 0, err
    assert trt.calls["timing_cache_in"][-1] == b"timing-cache+"


@pytest.mark.parametrize("version, fp16, flags, mode", [
    ("10.3.0", True, ["INT8", "FP16"], "weakly-typed"),
    ("8.6.1", False, ["INT8"], "flag-based"),
    ("8.6.1", True, ["INT8", "FP16"], "flag-based"),
])
def test_standin_flag_based_builds(version, fp16, flags, mode, good_model, tmp_path, capsys, standin):
    trt, _ = standin(version)
    report = tmp_path / "r.json"
    # progress bars on: stderr only
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                             "--iterations", "2"] + (["--fp16"] if fp16 else []), capsys)
    assert code == 0, err
    assert trt.calls["builder_flags"] == [getattr(trt.BuilderFlag, f) for f in flags]
    expected_network = 0 if mode == "weakly-typed" else 1 << trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH
    assert trt.calls["network_flags"] == [expected_network]
    assert json.loads(report.read_text())["build"]["mode"] == mode


def test_standin_skip_validation_builds_without_comparing(good_model, tmp_path, capsys, standin):
    standin("10.3.0")
    report = tmp_path / "r.json"
    code, out, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                               "--skip-validation", "--iterations", "2", "--no-progress"], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["status"] == "built" and data["validation"] is None and data["parity"] == []
    assert "not compared with onnxruntime" in out


def test_standin_too_old_tensorrt_is_one_line(good_model, tmp_path, capsys, standin):
    standin("8.4.3")
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--no-progress"], capsys)
    assert code == 2 and "TensorRT 8.4.3 is too old" in err and len(err.strip().splitlines()) == 1


def test_standin_parser_error_names_the_node(tmp_path, capsys, standin):
    standin("10.3.0")
    model = qdq_conv_model()
    model.graph.node[4].op_type = "NoSuchOp"
    model.graph.node[4].domain = "custom.domain"
    model.opset_import.append(helper.make_opsetid("custom.domain", 1))
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    report = tmp_path / "r.json"
    code, _, err = run_main([path, "--engine", tmp_path / "m.engine", "--report", report, "--skip-validation",
                             "--no-progress"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "ONNX parser rejected" in err and "node 'relu' (NoSuchOp)" in err
    assert json.loads(report.read_text())["status"] == "failed"
    assert not (tmp_path / "m.engine").exists()


def test_standin_no_gpu_is_one_line(good_model, tmp_path, capsys, standin):
    _, cudart = standin("10.3.0")
    cudart.cudaGetDeviceCount = lambda: ("cudaErrorNoDevice", 0)
    code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--no-progress"], capsys)
    assert code == 2 and "no CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_standin_parity_failure_is_exit_1(good_model, tmp_path, capsys, standin):
    standin("10.3.0")
    original = _Context.execute_async_v3

    def perturbed(self, stream):  # the "engine" answers with the classes rolled by one
        original(self, stream)
        name = self.engine.names[-1]
        size = int(np.prod(self.shapes[name])) * 4
        view = np.frombuffer((ctypes.c_char * size).from_address(self.addresses[name]), np.float32)
        rolled = np.roll(view.reshape(self.shapes[name]), 1, axis=-1).copy()
        ctypes.memmove(self.addresses[name], rolled.ctypes.data, rolled.nbytes)
        return True

    _Context.execute_async_v3 = perturbed
    try:
        report = tmp_path / "r.json"
        code, _, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                                 "--iterations", "2", "--no-progress"], capsys)
    finally:
        _Context.execute_async_v3 = original
    assert code == 1 and "differs from onnxruntime" in err
    data = json.loads(report.read_text())
    assert data["status"] == "verification-failed" and data["parity"][0]["passed"] is False


# --------------------------------------------------------------------------- real TensorRT (GPU machines)
def _require_tensorrt_and_gpu():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install '.[tensorrt]')")
    try:
        trt_backend.require_gpu()
    except trt_backend.TensorRTUnavailable as exc:
        pytest.skip(f"no usable GPU: {exc}")


def test_real_build_measure_and_verify(good_model, tmp_path, capsys):
    _require_tensorrt_and_gpu()
    report, cache = tmp_path / "r.json", tmp_path / "timing.cache"
    code, out, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                               "--batch", "4", "--timing-cache", cache, "--iterations", "20", "--warmup", "5",
                               "--no-progress"], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["status"] == "verified" and data["build"]["mode"] in (trt_backend.STRONGLY_TYPED,
                                                                       trt_backend.FLAG_BASED)
    assert data["latency"]["iterations"] == 20 and data["latency"]["mean_ms"] > 0
    assert data["parity"][0]["top1"] >= 0.99
    assert data["layers"]["int8"] >= 1
    assert (tmp_path / "m.engine").stat().st_size > 0 and cache.stat().st_size > 0


def test_real_build_rejects_a_bad_model_with_the_parser_message(tmp_path, capsys):
    _require_tensorrt_and_gpu()
    path = tmp_path / "bad.onnx"
    model = qdq_conv_model()
    model.graph.node[3].op_type = "NoSuchOp"
    onnx.save(model, str(path))
    code, _, err = run_main([path, "--engine", tmp_path / "m.engine", "--skip-validation", "--force"], capsys)
    assert code == 2 and "parser" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- FP8 and INT4 forms
def _formats_model(tmp_path, precision: str) -> Path:
    """A 2-layer MLP (MatMul/Gemm) quantized by onnx_qat in ``precision``."""
    import onnx_qat
    from tests.builders import mlp_model, random_inputs

    model = mlp_model(features=128, hidden=128, classes=CLASSES, batch=4)
    result = onnx_qat.quantize(model, data=random_inputs(model, num=4, seed=1), progress=False,
                               precision=precision)
    path = tmp_path / f"{precision}.onnx"
    onnx.save(result.model, str(path))
    return path


@pytest.mark.parametrize("precision", ["fp8", "int4"])
def test_standin_fp8_and_int4_build_strongly_typed_and_verify(precision, tmp_path, capsys, standin):
    trt, _ = standin("10.3.0")
    model, report = _formats_model(tmp_path, precision), tmp_path / "r.json"
    code, out, err = run_main([model, "--engine", tmp_path / "m.engine", "--report", report,
                               "--iterations", "2", "--no-progress"], capsys)
    assert code == 0, err
    assert trt.calls["network_flags"] == [1 << trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED]
    assert trt.calls["builder_flags"] == []
    data = json.loads(report.read_text())
    assert data["status"] == "verified" and data["build"]["precision"] == precision
    assert data["check"]["passed"] and not data["check"]["findings"]  # the gate knows the F rules
    (parity,) = data["parity"]
    assert parity["passed"] and parity["max_abs"] < 1e-5  # the gate ran it as the stand-in did
    assert f"strongly-typed {precision} engine" in out


@pytest.mark.parametrize("version, extra, words", [
    ("10.3.0", ["--fp16"], "drop it"),
    ("8.6.1", [], "need TensorRT >= 10"),
])
def test_standin_fp8_refuses_weakly_typed_builds(version, extra, words, tmp_path, capsys, standin):
    standin(version)
    code, _, err = run_main([_formats_model(tmp_path, "fp8"), "--engine", tmp_path / "m.engine",
                             "--iterations", "2", "--no-progress"] + extra, capsys)
    assert code == 2 and words in err and "Traceback" not in err


# ------------------------------------------------------------------ TensorRT 11 and the precision map
def test_standin_tensorrt_11_builds_strongly_typed_and_puts_the_map_beside_the_engine(
        good_model, tmp_path, capsys, standin):
    trt, _ = standin("11.4.0")
    report = tmp_path / "r.json"
    code, out, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report,
                               "--iterations", "2", "--no-progress"], capsys)
    assert code == 0, err
    assert trt.calls["network_flags"] == [1 << trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED]
    assert trt.calls["builder_flags"] == []  # TensorRT 11 has no INT8/FP16 flags to set
    data = json.loads(report.read_text())
    assert data["version"] == deploy.REPORT_VERSION == 2
    assert data["build"]["mode"] == "strongly-typed" and data["float_parts"] is None
    precision = data["precision"]
    assert precision["counts"] == {"int8": 2, "fp32": 2}  # conv and its relu; pool and flatten
    assert precision["unfused_qdq"][0]["node"] == "input_q" and precision["unfused_qdq"][0]["rule"] == "U1"
    engine = precision["engine"]
    assert (engine["agree"], engine["differ"], engine["missing"]) == (4, 0, 0)
    rows = {row["node"]: row for row in engine["rows"]}
    assert rows["relu"]["layer"] == "input_dq + weight_dq + conv + relu" and rows["relu"]["engine"] == "INT8"
    assert "precision map vs engine: 4 of 4 compute nodes agree, 0 differ" in out
    assert "precision (strongly typed build): 2 INT8, 2 FP32" in out
    assert "note: 2 compute node(s) run in FP32 under a strongly typed build" in out and "--fp16" in out


def test_standin_tensorrt_11_fp16_converts_the_float_parts(good_model, tmp_path, capsys, standin):
    pytest.importorskip("onnx_qat.formats.float_parts",
                        reason="the FP16 float-parts conversion (onnx_qat.formats.float_parts) is not "
                               "in this tree")
    trt, _ = standin("11.4.0")
    report, engine = tmp_path / "r.json", tmp_path / "m.engine"
    code, out, err = run_main([good_model, "--engine", engine, "--report", report, "--fp16",
                               "--iterations", "2", "--no-progress"], capsys)
    assert code == 0, err
    assert trt.calls["builder_flags"] == [] and "float parts: converted to FP16" in out
    assert "run in FP32 under a strongly typed build" not in out  # --fp16 given: no note
    built = onnx.load_from_string(engine.read_bytes())  # the stand-in's "engine" is the model it was given
    assert TensorProto.FLOAT16 in {i.data_type for i in built.graph.initializer}
    data = json.loads(report.read_text())
    assert data["float_parts"]["float_dtype"] == "fp16"
    assert "fp16" in data["precision"]["counts"] and data["status"] == "verified"


def test_without_tensorrt_the_report_holds_the_precision_map(good_model, tmp_path, capsys, no_tensorrt):
    report = tmp_path / "r.json"
    code, out, err = run_main([good_model, "--engine", tmp_path / "m.engine", "--report", report, "--fp16",
                               "--no-progress"], capsys)
    assert code == 2 and "TensorRT is not installed" in err
    data = json.loads(report.read_text())
    assert data["status"] == "tensorrt-unavailable" and data["float_parts"] is None  # no TensorRT 11: as is
    assert data["precision"]["counts"] == {"int8": 2, "fp32": 2} and "engine" not in data["precision"]


def _precision_map_of(model):
    from onnx_qat.check import check
    return check(model).precision_map


def test_compare_precisions_names_the_layers_that_differ():
    pmap = _precision_map_of(qdq_conv_model())
    fp16 = "Channel major FP16 format where channel % 8 == 0"
    info = json.dumps({"Layers": [
        {"Name": "input_q", "LayerType": "Scale", "Inputs": [_region("input", "Row major linear FP32")]},
        {"Name": "input_dq + weight_dq + conv + relu", "LayerType": "CaskConvolution",
         "Inputs": [_region("x_q", "Thirty-two wide channel vectorized row major Int8 format")]},
        {"Name": "pool", "LayerType": "CaskPooling", "Inputs": [_region("relu_out", fp16)]},
    ], "I/O Tensors": [{"Name": "input"}, {"Name": "output"}]})
    result = trt_backend.compare_precisions(pmap, info)
    rows = {row.node: row for row in result.rows}
    assert rows["conv"].status == rows["relu"].status == "agrees"
    assert (rows["pool"].status, rows["pool"].engine, rows["pool"].expected) == ("differs", "FP16", "fp32")
    assert rows["flatten"].status == "missing"  # no layer names it: folded by TensorRT
    assert "differ: pool (map fp32, engine FP16)" in result.summary()
    names_only = trt_backend.compare_precisions(pmap, json.dumps({"Layers": ["a", "b"]}))
    assert not names_only.detailed and "not compared" in names_only.summary()


# ------------------------------------------------------------------ onnx-qat deploy (the packaged command)
def run_cli(argv, capsys):
    from onnx_qat import cli

    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_onnx_qat_deploy_help_in_a_subprocess():
    listed = subprocess.run([sys.executable, "-m", "onnx_qat", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert listed.returncode == 0 and "deploy" in listed.stdout
    out = subprocess.run([sys.executable, "-m", "onnx_qat", "deploy", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for option in ("--engine", "--report", "--data", "--shapes", "--fp16", "--timing-cache", "--min-top1",
                   "--skip-validation", "--force", "--verbose", "--quiet", "--no-progress"):
        assert option in out.stdout


@pytest.mark.parametrize("extra, words", [
    (["--shapes", "input"], "argument --shapes"),
    (["--shapes", "input:1x4x8x8", "--batch", "2"], "arguments --shapes and --batch"),
    (["--iterations", "0"], "argument --iterations"),
])
def test_onnx_qat_deploy_usage_errors_are_one_line(extra, words, good_model, tmp_path, capsys):
    code, _, err = run_cli(["deploy", good_model, "--engine", tmp_path / "m.engine"] + extra, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("onnx-qat: error: ") and words in lines[0]
    assert not (tmp_path / "m.engine").exists()


def test_onnx_qat_deploy_refusals_and_missing_tensorrt(good_model, uint8_model, tmp_path, capsys,
                                                       no_tensorrt):
    code, _, err = run_cli(["deploy", good_model, "--engine", good_model], capsys)
    assert code == 2 and err.startswith("onnx-qat: error: ") and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["deploy", uint8_model, "--engine", tmp_path / "m.engine"], capsys)
    assert code == 2 and "onnx-qat: error: " in err and "not TensorRT-ready" in err
    report = tmp_path / "r.json"
    code, out, err = run_cli(["deploy", good_model, "--engine", tmp_path / "m.engine", "--report", report,
                              "--no-progress"], capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith("onnx-qat: stopped before the build")
    assert "TensorRT is not installed" in err and "onnxruntime: ok" in out
    data = json.loads(report.read_text())
    assert data["status"] == "tensorrt-unavailable" and data["options"]["progress"] is False
    assert "prog" not in data["options"]


def test_onnx_qat_deploy_builds_with_the_standin(good_model, tmp_path, capsys, standin):
    trt, _ = standin("11.4.0")
    report = tmp_path / "r.json"
    code, out, err = run_cli(["-q", "deploy", good_model, "--engine", tmp_path / "m.engine",
                              "--report", report, "--iterations", "3"], capsys)
    assert code == 0, err
    assert out == "" and err == ""  # -q: only errors, and there are none
    data = json.loads(report.read_text())
    assert data["status"] == "verified" and data["latency"]["iterations"] == 3
    assert data["precision"]["engine"]["agree"] == 4
    code, out, _ = run_cli(["deploy", good_model, "--engine", tmp_path / "m.engine", "--iterations", "2",
                            "--no-progress"], capsys)
    last = out.strip().splitlines()[-1]
    assert code == 0 and last == f"onnx-qat: engine {tmp_path / 'm.engine'} built and verified"


def test_onnx_qat_deploy_parity_failure_is_exit_1(good_model, tmp_path, capsys, standin):
    standin("11.4.0")
    original = _Context.execute_async_v3

    def zeros(self, stream):  # the "engine" answers zeros
        original(self, stream)
        name = self.engine.names[-1]
        size = int(np.prod(self.shapes[name])) * 4
        ctypes.memset(self.addresses[name], 0, size)
        return True

    _Context.execute_async_v3 = zeros
    try:
        code, _, err = run_cli(["deploy", good_model, "--engine", tmp_path / "m.engine", "--iterations", "2",
                                "--no-progress", "--max-abs", "1e-3"], capsys)
    finally:
        _Context.execute_async_v3 = original
    assert code == 1 and err.strip().startswith("onnx-qat: engine") and "differs from onnxruntime" in err


def test_compare_outputs_judges_top1_only_on_class_scores_and_every_output_on_cosine():
    """A detector's [N, 22, 100] output has no classes on its last axis: no top-1 figure and no top-1
    gate there, its cosine judged instead; a softmax output named in class_outputs keeps the top-1."""
    rng = np.random.default_rng(4)
    boxes = rng.standard_normal((2, 22, 100)).astype(np.float32)
    shuffled = boxes.copy()
    shuffled[:, :, :50] += 0.05 * rng.standard_normal((2, 22, 50)).astype(np.float32)  # argmaxes move
    (close,) = deploy.compare_outputs({"boxes": boxes}, {"boxes": shuffled})
    assert close.top1 is None and close.passed and close.cosine > 0.99 and "top-1" not in str(close)
    (far,) = deploy.compare_outputs({"boxes": boxes}, {"boxes": -boxes})
    assert not far.passed and far.reason.startswith("cosine -1.00000 < 0.99")
    probs = rng.uniform(size=(2, 5, 10)).astype(np.float32)
    (judged,) = deploy.compare_outputs({"p": probs}, {"p": probs[..., ::-1].copy()}, class_outputs={"p"})
    assert judged.top1 is not None and "top-1" in judged.reason
