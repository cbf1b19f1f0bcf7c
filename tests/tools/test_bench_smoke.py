"""Smoke test of the benchmarks: ``python -m tools.bench --quick`` runs every benchmark on a tiny model and
writes its table. Not a timed test: it checks that each benchmark produces its rows with finite figures."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {
    "cpu_latency": ("ort-cpu target speed-up over FP32", "ort-cpu target time / onnxruntime uint8 asymmetric",
                    "ort-cpu vs tensorrt target: max diff / tensorrt target error",
                    "integer Conv kernels alone: float Conv / QLinearConv kernel time",
                    "ort-cpu target speed-up over FP32, each model alone",
                    "floor: tensorrt target vs itself with each input one float32 ulp up",
                    "ort-cpu vs tensorrt target: top-1 agreement on inputs FP32 decides"),
    "cpu_models": ("tiny ViT: ort-cpu speed-up over FP32, batch 1",
                   "tiny ViT: ort-cpu speed-up over FP32, batch 2",
                   "tiny ViT: ort-cpu time / onnxruntime uint8 form, batch 1",
                   "tiny ViT: ort-cpu error / onnxruntime uint8 form error"),
    "cpu_models_avx2": ("AVX2 path: tiny ViT: ort-cpu speed-up over FP32, batch 1",
                        "AVX2 path: tiny ViT: ort-cpu time / onnxruntime uint8 form, batch 2",
                        "AVX2 path: tiny ViT: ort-cpu error / onnxruntime uint8 form error"),
    "rewrite_speed": ("per-node cost growth",),
    "calibration": ("max time / onnxruntime MinMax", "entropy time / onnxruntime Entropy",
                    "max: peak RSS at"),
    "qat_step": ("QAT train step / float train step",),
    "formats": ("bert: onnx-qat fp8 cosine to FP32", "bert: onnx-qat int4 AWQ file size / FP32",
                "cnn: onnx-qat int8 cosine to FP32", "cnn: onnx-qat int4 AWQ quantize time"),
    "sensitivity": ("sensitivity time, ", "min-cosine time (ranges and float sites)",
                    "min-cosine time / sensitivity time"),
    "export_speed": ("export_onnx time, ", "export_onnx peak memory, "),
    "float_parts": ("quantize --float-dtype fp16 / fp32, time", "float parts' bytes fp16 / fp32",
                    "output cosine drop fp16 vs fp32 float parts"),
    "calibration_scale": ("quantize --method auto / --method max, time, ",
                          "the same, CPU time (user + system), ", "auto's extra cost per node, "),
    "workers": ("sensitivity 1 worker / 2 workers, ", "calibration (entropy, "),
}


def _bench(tmp_path, *names):
    out = tmp_path / "out"
    args = [sys.executable, "-m", "tools.bench", "--quick", "--out", str(out),
            "--workdir", str(tmp_path / "work")]
    for name in names:
        args += ["--only", name]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def _check_rows(doc, markdown, stdout, name):
    rows = [r for r in doc["rows"] if r["bench"] == name]
    assert rows, f"no rows for {name}"
    for prefix in EXPECTED[name]:
        found = [r for r in rows if r["figure"].startswith(prefix)]
        assert found, f"{name}: no row '{prefix}' in {[r['figure'] for r in rows]}"
        for row in found:
            assert row["value"] is not None and math.isfinite(row["value"]), row
            # every figure is a time, ratio or size, except a cosine drop: signed (negative: FP16 better;
            # the tiny CNN's is -5e-7 since the weight scales are on the FP16 grid in both forms)
            assert row["value"] >= 0 or "cosine drop" in row["figure"], row
            assert row["status"] in ("PASS", "BAR", "MISS", "TIE", "INFO"), row
            assert row["figure"] in markdown and row["figure"] in stdout
    for row in rows:
        if row["goal"] is not None and row["value"] is not None:
            assert row["status"] in ("PASS", "BAR", "MISS", "TIE")
            assert row["status"] != "TIE" or row["interval"][0] <= row["goal"]["target"] <= row["interval"][1]


def test_quick_onnx_benchmarks_write_their_tables(tmp_path):
    stdout, doc, markdown = _bench(tmp_path, "cpu_latency", "cpu_models", "rewrite_speed", "calibration")
    assert doc["format"] == "onnx-qat-bench" and doc["quick"] is True and doc["machine"]["cpus"]
    for name in ("cpu_latency", "cpu_models", "rewrite_speed", "calibration"):
        _check_rows(doc, markdown, stdout, name)
    assert markdown.startswith("# onnx-qat benchmarks (quick)")


def test_quick_cpu_models_avx2_writes_its_table(tmp_path):
    """The AVX2-path rows (CPUID mask, tests/tools/test_cpuid_mask.py); where the mask cannot be set up
    (no cpuid_fault flag, as on many CI runners; no C compiler) one SKIP row that says why."""
    from tools.bench import isa

    stdout, doc, markdown = _bench(tmp_path, "cpu_models_avx2")
    why = isa.why_unavailable() or (None if isa.compiler() else "no C compiler")
    if why:
        rows = [r for r in doc["rows"] if r["bench"] == "cpu_models_avx2"]
        assert len(rows) == 1 and rows[0]["status"] == "SKIP" and rows[0]["detail"], rows
        pytest.skip(f"AVX2 path not available here: {why}")
    _check_rows(doc, markdown, stdout, "cpu_models_avx2")
    assert "CPUID mask avx2" in next(r for r in doc["rows"] if r["bench"] == "cpu_models_avx2")["detail"]


def test_quick_calibration_scale_writes_its_table(tmp_path):
    stdout, doc, markdown = _bench(tmp_path, "calibration_scale")
    _check_rows(doc, markdown, stdout, "calibration_scale")


def test_quick_qat_step_writes_its_table(tmp_path):
    pytest.importorskip("tensorflow")
    stdout, doc, markdown = _bench(tmp_path, "qat_step")
    _check_rows(doc, markdown, stdout, "qat_step")
    export = [r for r in doc["rows"] if r["figure"].startswith("export_onnx time")]
    assert len(export) == 1 and (export[0]["value"] is None or export[0]["value"] > 0)


def test_quick_export_speed_writes_its_table(tmp_path):
    """One time row with the export's five steps in its detail, one peak-memory row."""
    pytest.importorskip("tensorflow")
    stdout, doc, markdown = _bench(tmp_path, "export_speed")
    _check_rows(doc, markdown, stdout, "export_speed")
    time_row = next(r for r in doc["rows"] if r["figure"].startswith("export_onnx time, "))
    for step in ("float twin -> tf2onnx", "map quantizers", "insert Q/DQ", "parity in onnxruntime", "write"):
        assert step in time_row["detail"], time_row
    peak = next(r for r in doc["rows"] if r["figure"].startswith("export_onnx peak memory, "))
    assert peak["unit"] == "GiB" and 0 < peak["value"] < 64


def test_quick_sensitivity_writes_its_table(tmp_path):
    stdout, doc, markdown = _bench(tmp_path, "sensitivity")
    _check_rows(doc, markdown, stdout, "sensitivity")


def test_quick_workers_writes_its_table(tmp_path):
    stdout, doc, markdown = _bench(tmp_path, "workers")
    _check_rows(doc, markdown, stdout, "workers")
    for row in (r for r in doc["rows"] if r["bench"] == "workers"):
        assert "identical: yes" in row["detail"], row  # the same figures with 2 workers


def test_a_goal_inside_the_measured_interval_is_a_tie():
    from tools.bench.table import Goal, Row

    assert Row("b", "f", 1.05, Goal("<=", 1.0), interval=(0.93, 1.2)).status == "TIE"
    assert Row("b", "f", 0.97, Goal("<=", 1.0), interval=(0.93, 1.02)).status == "TIE"  # not a PASS
    assert Row("b", "f", 0.9, Goal("<=", 1.0), interval=(0.85, 0.95)).status == "PASS"
    assert Row("b", "f", 1.2, Goal("<=", 1.0, 1.25), interval=(1.1, 1.3)).status == "BAR"
    assert Row("b", "f", 0.8, Goal(">=", 1.0), interval=(0.7, 0.9)).status == "MISS"
    assert Row("b", "f", 0.8, Goal(">=", 1.0), interval=(0.7, 0.9)).to_dict()["interval"] == [0.7, 0.9]


def test_median_interval_and_paired_ratios():
    """The sign-test interval of the median: [x(k), x(n-k+1)] with coverage >= 95%; paired ratios are
    taken round by round, so a slow phase that hits both runs of a round cancels."""
    from tools.bench.measure import interleaved_rounds, median_interval, paired_ratio

    assert median_interval([3, 1, 2, 5, 4]) == (3, 1, 5)  # n < 6: the whole range
    assert median_interval(range(1, 10)) == (5, 2, 8)  # n = 9: coverage 0.961
    assert median_interval(range(1, 16)) == (8, 4, 12)  # n = 15: coverage 0.965
    slow = [1.0, 5.0, 1.0, 9.0, 1.0, 1.0, 3.0]  # a loaded machine: some rounds 3-9x slower for both
    times = {"a": [2 * t for t in slow], "b": slow}
    assert paired_ratio(times, "a", "b") == (2.0, 2.0, 2.0)
    calls = []
    order = interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                                "c": lambda: calls.append("c")}, min_rounds=3, max_rounds=3, warmup=0)
    assert calls == list("abcbcacab") and all(len(v) == 3 for v in order.values())
    more = interleaved_rounds({"a": lambda: None}, min_rounds=2, max_rounds=9, seconds=60,
                              settled=lambda t: len(t["a"]) >= 4)
    assert len(more["a"]) == 4


def test_goal_statuses_follow_the_values():
    from tools.bench.table import Goal, Row

    assert Row("b", "f", 3.2, Goal(">=", 3.0, 2.0)).status == "PASS"
    assert Row("b", "f", 2.5, Goal(">=", 3.0, 2.0)).status == "BAR"
    assert Row("b", "f", 1.5, Goal(">=", 3.0, 2.0)).status == "MISS"
    assert Row("b", "f", 1.1, Goal("<=", 1.0, 1.25)).status == "BAR"
    assert Row("b", "f", float("nan"), Goal("<=", 1.0)).status == "SKIP"
    assert Row("b", "f", 0.5, None).status == "INFO"


def test_quick_formats_benchmark_writes_its_table(tmp_path):
    stdout, doc, markdown = _bench(tmp_path, "formats")
    _check_rows(doc, markdown, stdout, "formats")
    modelopt = [r for r in doc["rows"] if "ModelOpt" in r["figure"]]
    assert modelopt and all(r["status"] in ("SKIP", "PASS", "MISS", "INFO") for r in modelopt)
    assert all(r["detail"] for r in modelopt if r["status"] == "SKIP")  # skipped with a reason


def test_quick_float_parts_benchmark_writes_its_table(tmp_path):
    stdout, doc, markdown = _bench(tmp_path, "float_parts")
    _check_rows(doc, markdown, stdout, "float_parts")
    rows = {r["figure"]: r for r in doc["rows"] if r["bench"] == "float_parts"}
    assert rows["float parts' bytes fp16 / fp32, tiny CNN"]["value"] == pytest.approx(0.5, abs=0.01)
