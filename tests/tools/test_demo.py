"""tools/demo.py and tools/demo_report.py: options, measurements on real tiny ONNX models, the report
(files, PNGs, Markdown links, JSON figures), and the whole demo in quick mode in a subprocess."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tools import demo
from tools import demo_report as report

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "demo.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- tiny real models
def conv_model(weight: np.ndarray, *, qdq_scale: float = 0.0, name: str = "stem_conv") -> onnx.ModelProto:
    """image [N,8,8,1] -> Transpose -> Conv (weight input named after ``name``) -> Relu -> GAP -> Flatten ->
    MatMul 'logits'. With ``qdq_scale`` > 0 the Conv's activation input goes through Q/DQ."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(weight.astype(np.float32), f"model/{name}/kernel"),
             numpy_helper.from_array(rng.standard_normal((weight.shape[0], 10)).astype(np.float32),
                                     "model/logits/kernel")]
    nodes = [helper.make_node("Transpose", ["image"], ["nchw"], name="to_nchw", perm=[0, 3, 1, 2])]
    conv_in = "nchw"
    if qdq_scale > 0:
        inits += [numpy_helper.from_array(np.array(qdq_scale, np.float32), "s"),
                  numpy_helper.from_array(np.array(0, np.int8), "zp")]
        nodes += [helper.make_node("QuantizeLinear", ["nchw", "s", "zp"], ["q"], name="q"),
                  helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["dq"], name="dq")]
        conv_in = "dq"
    nodes += [
        helper.make_node("Conv", [conv_in, f"model/{name}/kernel"], ["conv_out"], name="Conv__7",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["relu"], name="relu"),
        helper.make_node("GlobalAveragePool", ["relu"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "model/logits/kernel"], ["logits"], name="model/logits/MatMul"),
    ]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                              ["N", 8, 8, 1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture()
def tiny_pair(tmp_path):
    """A float model and the same model with its Conv input quantized (scale 1/127), saved as files."""
    weight = np.random.default_rng(0).standard_normal((16, 1, 3, 3)).astype(np.float32)
    float_path, qdq_path = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(conv_model(weight), float_path)
    onnx.save(conv_model(weight, qdq_scale=1.0 / 127), qdq_path)
    return float_path, qdq_path


def sample_results(**changes) -> report.DemoResults:
    """A complete DemoResults with plausible figures (what a run produces)."""
    criteria = (report.Criterion("QAT INT8 accuracy within 1 point of float", "drop 0.28", "<= 1", True),
                report.Criterion("QAT INT8 Q/DQ model passes onnx_qat.check", "0 errors", "0 errors", True))
    lat = tuple(report.LatencyResult(m, b, ms, ms * 0.9, ms * 1.2, 5, 4, 1)
                for b, base in ((1, 0.2), (64, 3.0))
                for m, ms in (("float", base), ("ptq", base * 2), ("qat", base * 2)))
    values = dict(
        meta={"date": "2026-01-01 00:00 UTC", "machine": "2 CPU core(s)", "versions": "onnx 1.23.2",
              "seed": 0,
              "epochs": 20, "qat_epochs": 3, "qat_learning_rate": 1e-4, "quick": False,
              "timings": {"float": 12.5, "export": 20.0}, "total_s": 80.0, "model": "CNN"},
        dataset={"train": 1149, "validation": 288, "test": 360, "shape": "8x8x1", "classes": 10},
        onnx_accuracy={"float": 99.17, "ptq": 98.89, "qat": 99.17},
        keras_accuracy={"float": 99.17, "ptq": 98.61, "qat": 99.17},
        latency=lat,
        checks={k: {"passed": True,
                    "summary": "PASSED | 0 errors, 1 warning | 6 QuantizeLinear, 11 DequantizeLinear",
                    "findings": [{"rule": "C11", "severity": "warning", "node": "add", "message": "m"}]}
                for k in ("ptq", "qat")},
        parity={k: {"summary": "PASSED | ratio 0.03", "passed": True,
                    "figures": {"samples": 288, "ratio_limit": 0.1, "top1_limit": 0.99},
                    "outputs": [{"name": "logits", "max_abs_qdq": 0.01, "max_abs_float": 0.2, "ratio": 0.05,
                                 "top1": 1.0, "passed": True}],
                    "mapping": "quantizer  keras  onnx\nimage_quant  image:0  image",
                    "cli_reproducible": True}
                for k in ("ptq", "qat")},
        layer_error={"ptq": (("stem_conv", 40.1), ("logits", 20.5)),
                     "qat": (("stem_conv", 41.0), ("logits", 22.0))},
        activation_amax={"ptq": (("image_quant", 1.0), ("gap_quant", 3.5)),
                         "qat": (("image_quant", 1.0), ("gap_quant", 3.3))},
        confusion=np.diag(np.full(10, 36)),
        history={"float": {"accuracy": [0.8, 0.99], "val_accuracy": [0.7, 0.98]},
                 "qat": {"accuracy": [0.995], "val_accuracy": [0.99]}},
        criteria=criteria, files={"ptq_onnx": "models/ptq.onnx"}, notes=("INT8 note.",))
    values.update(changes)
    return report.DemoResults(**values)


# --------------------------------------------------------------------------- options
def test_parser_defaults_match_options():
    opts = demo.options_from_args(demo.get_parser().parse_args([]))
    assert opts == demo.DemoOptions()
    assert opts.out == Path("demo_report") and opts.threads == 1


def test_quick_shortens_the_run_and_threads_zero_means_default():
    args = demo.get_parser().parse_args(["--quick", "--epochs", "30", "--threads", "0"])
    opts = demo.options_from_args(args)
    assert (opts.epochs, opts.qat_epochs, opts.latency_rounds, opts.threads) == (4, 1, 5, None)
    assert opts.quick


@pytest.mark.parametrize("argv, words", [
    (["--epochs", "0"], "--epochs"),
    (["--qat-learning-rate", "2"], "--qat-learning-rate"),
    (["--latency-batches", "0"], "--latency-batches"),
    (["--threads", "-1"], "--threads"),
])
def test_bad_options_exit_2_with_one_line(argv, words, capsys):
    assert demo.main(argv) == demo.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "report"
    target.write_text("x")
    assert demo.main(["--out", str(target)]) == demo.EXIT_USAGE
    assert "is a file" in capsys.readouterr().err


# --------------------------------------------------------------------------- data and measurements
def test_splits_are_stratified_disjoint_and_deterministic():
    a, b = demo.load_splits(0), demo.load_splits(0)
    assert a.sizes() == {"train": 1149, "validation": 288, "test": 360}
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert a.x_train.shape[1:] == (8, 8, 1) and a.x_train.dtype == np.float32
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
    assert set(np.bincount(a.y_test)) <= {35, 36, 37}  # every digit about equally represented
    assert not np.array_equal(demo.load_splits(1).y_test, a.y_test)


def test_confusion_matrix_counts():
    cm = demo.confusion_matrix(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), classes=3)
    np.testing.assert_array_equal(cm, [[1, 0, 0], [0, 1, 1], [0, 0, 1]])


def test_onnx_predictions_match_numpy(tiny_pair):
    float_path, _ = tiny_pair
    x = np.random.default_rng(2).random((20, 8, 8, 1)).astype(np.float32)
    import onnxruntime as ort

    session = ort.InferenceSession(str(float_path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"image": x})[0]
    np.testing.assert_array_equal(demo.onnx_predictions(float_path, x), logits.argmax(-1))


def test_layer_errors_name_layers_and_rank_the_quantized_one(tiny_pair):
    float_path, qdq_path = tiny_pair
    x = np.random.default_rng(3).random((32, 8, 8, 1)).astype(np.float32)
    errors = dict(demo.layer_errors(float_path, qdq_path, x, ["stem", "stem_conv", "logits"]))
    assert set(errors) == {"stem_conv", "logits"}  # longest Keras name wins
    # input quantized with step 1/127 on values in [0, 1): SQNR about 6 dB * 7 bits, far from 0 and from inf
    assert 25.0 < errors["stem_conv"] < 60.0
    assert errors["logits"] > 20.0
    same = dict(demo.layer_errors(float_path, float_path, x, []))
    assert set(same) == {"Conv #0", "MatMul #1"} and all(v == float("inf") for v in same.values())


def test_latency_is_positive_ordered_and_interleaved(tiny_pair):
    float_path, qdq_path = tiny_pair
    x = np.random.default_rng(4).random((10, 8, 8, 1)).astype(np.float32)
    rows = demo.measure_latency({"float": float_path, "qat": qdq_path}, x, (1, 16), rounds=3, threads=1)
    assert [(r.model, r.batch) for r in rows] == [("float", 1), ("qat", 1), ("float", 16), ("qat", 16)]
    for r in rows:
        assert 0 < r.p10_ms <= r.median_ms <= r.p90_ms < 1000
        assert r.rounds == 3 and r.threads == 1
    assert rows[0].runs_per_round == 64 and rows[2].runs_per_round == 4


def test_parity_of_reads_verdict_and_figures():
    @dataclasses.dataclass(frozen=True)
    class Rep:
        max_abs_vs_qat: float
        top1: float
        passed: bool

        def __str__(self):
            return "PASSED | max abs 1e-4\nsecond line"

    par = demo.parity_of(Rep(1e-4, 1.0, True))
    assert par == {"summary": "PASSED | max abs 1e-4", "passed": True,
                   "figures": {"max_abs_vs_qat": 0.0001, "top1": 1.0, "passed": True}, "outputs": [],
                   "mapping": "", "deployed": ""}
    assert demo.parity_of(Rep(1.0, 0.5, False))["passed"] is False
    assert demo.parity_of(object())["passed"] is False  # no verdict: never counted as a pass


# --------------------------------------------------------------------------- report
def test_criterion_verdicts():
    assert str(report.Criterion("a", "1", "2", True)).startswith("PASS")
    assert report.Criterion("a", "1", "2", False).verdict == "FAIL"
    assert report.Criterion("a", "1", "2", False, gating=False).verdict == "INFO"
    ok = sample_results()
    assert ok.passed
    missed = sample_results(criteria=ok.criteria + (report.Criterion("x", "1", "2", False),))
    assert not missed.passed
    info = report.Criterion("x", "1", "2", False, gating=False)
    assert sample_results(criteria=ok.criteria + (info,)).passed


def test_write_report_files_pngs_and_links(tmp_path):
    written = report.write_report(tmp_path / "rep", sample_results())
    out = tmp_path / "rep"
    for name in report.PLOTS.values():
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    md = (out / "report.md").read_text()
    for name in report.PLOTS.values():
        assert f"]({name})" in md
    assert "99.17%" in md and "PASS  QAT INT8 accuracy" in md and "INT8 note." in md
    assert "C11" in md and "| QAT INT8 | 64 |" in md and "image_quant  image:0" in md
    assert "| QAT INT8 | logits | 0.01 | 0.2 | 5.00% | 100.00% | PASSED |" in md
    assert "- QAT INT8: `PASSED | ratio 0.03`" in md
    assert "2.00x" in md  # INT8 latency relative to FP32
    data = json.loads((out / "results.json").read_text())
    assert data["onnx_accuracy"] == {"float": 99.17, "ptq": 98.89, "qat": 99.17} and data["passed"] is True
    assert data["confusion_qat"][3][3] == 36 and data["criteria"][0]["verdict"] == "PASS"
    assert set(written) == set(report.PLOTS) | {"report", "results"}
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]


def test_report_shows_the_sensitivity_chart(tmp_path):
    import onnx_qat
    from tests.builders import outlier_channel_model

    x = np.random.default_rng(0).standard_normal((16, 16, 8, 8)).astype(np.float32)
    sens = onnx_qat.sensitivity(outlier_channel_model("conv3"), x[:12], eval_data=x[12:], progress=False)
    written = report.write_report(tmp_path, sample_results(sensitivity=sens))
    chart = (tmp_path / report.SENSITIVITY_PLOT).read_bytes()
    assert chart.startswith(PNG_MAGIC) and len(chart) > 5000 and "sensitivity" in written
    md = (tmp_path / "report.md").read_text()
    assert f"]({report.SENSITIVITY_PLOT})" in md and "| 1 | `conv3` | Conv | weighted |" in md
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["sensitivity"]["sites"][0]["name"] == "conv3"
    assert "sensitivity" not in report.render_markdown(sample_results()).lower()


def test_parity_table_shows_the_tensorflow_column_when_it_differs():
    base = sample_results()
    parity = {k: dict(v, outputs=[dict(v["outputs"][0], max_abs_tf=0.0123)]) for k, v in base.parity.items()}
    md = report.render_markdown(sample_results(parity=parity))
    assert "max abs Q/DQ vs Keras in TensorFlow" in md
    assert "| QAT INT8 | logits | 0.01 | 0.2 | 5.00% | 0.0123 | 100.00% | PASSED |" in md
    assert "in TensorFlow" not in report.render_markdown(base)
    same = {k: dict(v, outputs=[dict(v["outputs"][0], max_abs_tf=0.01)]) for k, v in base.parity.items()}
    assert "in TensorFlow" not in report.render_markdown(sample_results(parity=same))  # nothing to add


def test_report_handles_non_finite_sqnr_and_missing_figures(tmp_path):
    results = sample_results(layer_error={"ptq": (("stem_conv", float("inf")),), "qat": ()},
                             keras_accuracy={}, parity={}, notes=())
    report.write_report(tmp_path, results)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["layer_error"]["ptq"] == [["stem_conv", None]]
    assert "n/a" in (tmp_path / "report.md").read_text()


# --------------------------------------------------------------------------- the whole demo (quick)
def test_quick_demo_end_to_end(tmp_path):
    """The real pipeline (digits, Keras training, PTQ, QAT, export, onnxruntime) in quick mode."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    out = tmp_path / "demo report"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--no-progress",
                           "--latency-rounds", "2"], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"report: {(out / 'report.md').resolve()}" in proc.stdout
    assert "[1/9]" in proc.stdout and "[9/9]" in proc.stdout  # stage lines
    data = json.loads((out / "results.json").read_text())
    sites = data["sensitivity"]["sites"]  # the float model's sensitivity, and its chart
    assert sites and sites[0]["rank"] == 1 and (out / "sensitivity.png").stat().st_size > 5000
    # the exit code follows the gating criteria (in quick mode: check and export parity)
    gating = [c for c in data["criteria"] if c["gating"]]
    assert len(gating) == 5 and proc.returncode == (0 if all(c["passed"] for c in gating) else 1)
    assert ("FAIL  " in proc.stdout) == (proc.returncode == 1)
    for key in ("float", "ptq", "qat"):
        assert 80.0 <= data["onnx_accuracy"][key] <= 100.0, data["onnx_accuracy"]
        assert abs(data["onnx_accuracy"][key] - data["keras_accuracy"][key]) <= 2.0
    # the FP32 baseline is the float Keras model itself, not a twin with int8-grid weights
    assert data["onnx_accuracy"]["float"] == pytest.approx(data["keras_accuracy"]["float"], abs=0.3)
    for key in ("ptq", "qat"):
        assert data["checks"][key]["passed"] and data["checks"][key]["num_q"] > 0
        # parity figures from the export: numbers, top-1 agreement with the Keras model >= 99%. (Whether the
        # max-abs ratio meets its 10% limit after 4 epochs decides the exit code, checked above.)
        (row,) = data["parity"][key]["outputs"]
        assert row["top1"] >= 0.99 and 0.0 <= row["ratio"] < 1.0 and row["max_abs_qdq"] < row["max_abs_float"]
        assert data["parity"][key]["figures"]["samples"] == 288
        assert len(data["layer_error"][key]) == 5  # four Conv and the Dense, all named
        assert all(v is None or v > 10.0 for _, v in data["layer_error"][key])
    # the QAT model in the ort-cpu form: its own check rules, parity as deployed, accuracy like QAT's
    assert data["checks"]["qat_cpu"]["passed"] and data["parity"]["qat_cpu"]["passed"]
    assert "ort-cpu as deployed" in data["parity"]["qat_cpu"]["deployed"]
    assert abs(data["onnx_accuracy"]["qat_cpu"] - data["onnx_accuracy"]["qat"]) <= 1.0
    cpu_ops = {n.op_type for n in onnx.load(out / data["files"]["qat_cpu_onnx"]).graph.node}
    assert "QuantizeLinear" in cpu_ops and "Mul" not in cpu_ops  # BatchNorm scales folded into the Convs
    assert {r["model"] for r in data["latency"]} == {"float", "ptq", "qat", "qat_cpu"}
    assert all(r["median_ms"] > 0 for r in data["latency"])
    md = (out / "report.md").read_text()
    for name in report.PLOTS.values():
        assert f"]({name})" in md and (out / name).read_bytes().startswith(PNG_MAGIC)
    for rel in data["files"].values():
        assert (out / rel).is_file(), rel
    onnx.checker.check_model(onnx.load(out / data["files"]["qat_onnx"]))
