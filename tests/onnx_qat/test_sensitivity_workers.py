"""Sensitivity and --min-cosine with their settings on worker processes: the same figures, bit for
bit, as in one process; the default worker count; the CLI option; signals stop the workers."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

import onnx_qat
from onnx_qat.accuracy.parallel import OVERHEAD_PASSES, choose_workers, worker_bytes
from onnx_qat.cli import EXIT_OK, EXIT_USAGE, main
from onnx_qat.runtime.workers import WORKER_START_SECONDS, default_workers, pays_off
from tests.builders import mobilenet_v2_model, outlier_channel_model
from tests.onnx_qat.test_real_models import det_model  # noqa: F401  (the cached PP-OCRv4 detector)
from tests.reliability import support


def _images(n: int, seed: int, size: int, channels: int = 3, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, channels, size, size)) * scale).astype(np.float32)


def _figures(result) -> list:
    """Every reported figure of every site, as exact floats, with the site's rank and group sizes."""
    return [(s.rank, s.name, s.only.cosine, s.only.sqnr_db, s.only.max_abs, s.all_but.cosine,
             s.all_but.sqnr_db, s.all_but.max_abs, s.only_group, s.all_but_group) for s in result.sites]


def _same(one, two) -> None:
    assert one == two  # the dataclass equality: every site, error, group size and the run count
    assert _figures(one) == _figures(two)
    assert one.all_int8 == two.all_int8 and one.runs == two.runs


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (3, 40.0)])
def test_two_workers_give_the_figures_of_one_on_a_small_graph(seed, scale):
    """Exhaustive (2n + 1 settings) on a graph with a sensitive layer, two seeds and input scales."""
    model = outlier_channel_model("conv3", seed=seed)
    data = {"input": _images(24, seed, 8, channels=16, scale=scale)}
    one = onnx_qat.sensitivity(model, data, progress=False, workers=1)
    two = onnx_qat.sensitivity(model, data, progress=False, workers=2)
    _same(one, two)
    assert one.sites[0].name == "conv3" and one.runs == 2 * len(one) + 1


def test_two_workers_give_the_figures_of_one_with_group_bisection():
    """More than 16 sites: the settings bisection measures depend on earlier answers, level by level."""
    model = mobilenet_v2_model(size=16, width=0.5, seed=1)
    data = {"input": _images(8, 5, 16)}
    one = onnx_qat.sensitivity(model, data, progress=False, workers=1)
    two = onnx_qat.sensitivity(model, data, progress=False, workers=2)
    assert len(one) > 16 and any(s.only_group > 1 for s in one.sites)  # the bisection path
    _same(one, two)


def test_min_cosine_chooses_the_same_sites_with_two_workers():
    model = mobilenet_v2_model(size=16, width=0.5, seed=2)
    data = {"input": _images(8, 7, 16)}
    kw = dict(data=data, min_cosine=0.999, method="max", progress=False)
    one = onnx_qat.quantize(model, workers=1, **kw).accuracy
    two = onnx_qat.quantize(model, workers=2, **kw).accuracy
    assert one["float_sites"] and one["float_sites"] == two["float_sites"]
    for key in ("cosine_before", "cosine_estimate", "cosine_after", "runs", "before", "after"):
        assert one[key] == two[key], key


@pytest.mark.parametrize("seed", [4, 9])
def test_min_cosine_range_search_with_two_workers_matches_one(seed):
    """The default method (auto): the range search's settings run in this process, its calibration pass
    on the workers; the candidate ranges, the search and the model written are those of one process."""
    model = mobilenet_v2_model(size=16, width=0.5, seed=seed)
    data = {"input": _images(12, seed + 1, 16)}
    kw = dict(data=data, min_cosine=0.9995, progress=False)
    one = onnx_qat.quantize(model, workers=1, **kw)
    two = onnx_qat.quantize(model, workers=2, **kw)
    assert "ranges" in one.accuracy and one.accuracy["ranges"]["runs"]["whole_tables"] == 5
    for key in ("float_sites", "cosine_before", "cosine_estimate", "cosine_after", "runs", "ranges"):
        assert one.accuracy[key] == two.accuracy[key], key
    assert one.model.SerializeToString() == two.model.SerializeToString()


def test_the_detector_on_two_workers_matches_one(det_model):  # noqa: F811
    """The real PP-OCRv4 text detector (cached by tests/onnx_qat/test_real_models.py, skipped offline)."""
    data = {"x": _images(6, 11, 96)}
    evaluation = {"x": _images(2, 12, 96)}
    one = onnx_qat.sensitivity(str(det_model), data, eval_data=evaluation, progress=False, workers=1)
    two = onnx_qat.sensitivity(str(det_model), data, eval_data=evaluation, progress=False, workers=2)
    assert len(one) > 50
    _same(one, two)


def test_default_worker_count_rule():
    feeds = [{"input": np.zeros((4, 3, 8, 8), np.float32)}]
    reference = {"output": np.zeros(40, np.float64)}
    kw = dict(gated_bytes=10 << 20, feeds=feeds, reference=reference, num_sites=30, cut_bytes=1 << 20)
    assert choose_workers(3, float_seconds=0.0, **kw) == 3  # given: kept
    # 31 settings of t s each in one process, against t * 31 / n + start + 3 t on n workers
    assert not pays_off(31 * 0.01, WORKER_START_SECONDS + OVERHEAD_PASSES * 0.01, 2)
    assert choose_workers(None, float_seconds=0.01, **kw) == 1  # too short to gain from workers
    assert pays_off(31 * 1.0, WORKER_START_SECONDS + OVERHEAD_PASSES * 1.0, 2)
    assert not pays_off(100.0, 0.0, 1) and not pays_off(10.0, 4.5, 2) and pays_off(10.0, 3.0, 2)
    need = worker_bytes(10 << 20, feeds, reference, 1 << 20)
    assert need == 3 * (10 << 20) + 2 * (4 * 3 * 8 * 8 * 4 + 40 * 8) + (1 << 20)
    expected = default_workers(need, units=31)
    assert choose_workers(None, float_seconds=1.0, **kw) == (expected if expected > 1 else 1)
    peak = 2 << 30  # this process's peak, when larger, stands for the activations
    assert worker_bytes(10 << 20, feeds, reference, 1 << 20, peak) == peak + (1 << 20)
    with pytest.raises(onnx_qat.ConfigError, match="workers must be a whole number >= 1, got 0"):
        onnx_qat.sensitivity(outlier_channel_model(), {"input": _images(8, 0, 8, 16)}, workers=0,
                             progress=False)


def test_cli_workers_option(tmp_path, capsys):
    support.save(outlier_channel_model("conv2"), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=_images(16, 1, 8, channels=16))
    args = ["sensitivity", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--no-progress"]
    assert main(args + ["--workers", "2", "-o", str(tmp_path / "two.json")]) == EXIT_OK
    assert main(args + ["--workers", "1", "-o", str(tmp_path / "one.json")]) == EXIT_OK
    import json

    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    one.pop("seconds"), two.pop("seconds")
    assert one == two
    capsys.readouterr()
    assert main(args + ["--workers", "0"]) == EXIT_USAGE
    assert "--workers" in capsys.readouterr().err


def _children(pid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["sensitivity", "calibrate"])
def test_a_signal_while_workers_run_stops_them_within_2_s(tmp_path, sig, command):
    """The signal goes to the main process only (as `kill` sends it) while its two workers run the
    settings or calibration's batches."""
    from tests.reliability.test_atomic_and_signals import StderrReader, slow_model

    support.save(slow_model(layers=6, channels=32), tmp_path / "model.onnx")
    samples, extra = (64, ["--method", "max"]) if command == "sensitivity" else \
        (512, ["--method", "entropy", "--batch-size", "4"])
    np.savez(tmp_path / "calib.npz", input=_images(samples, 0, 32, channels=32))
    before = support.snapshot(tmp_path)
    proc = subprocess.Popen(support.cli_command(command, "model.onnx", "--data", "calib.npz", "-o",
                                                "out.json", "--workers", "2", *extra),
                            cwd=tmp_path, env=support.cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    reader = StderrReader(proc)
    try:
        assert reader.wait_for(command[:9], timeout=120), reader.text
        deadline = time.monotonic() + 30
        workers = _children(proc.pid)
        while len([p for p in workers if _cmdline(p)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = _children(proc.pid)
        workers = [p for p in workers if _cmdline(p)]
        assert len(workers) == 2, workers
        time.sleep(0.5)
        assert proc.poll() is None, "the settings finished before the signal"
        proc.send_signal(sig)
        sent = time.monotonic()
        stderr = reader.finish()
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), stderr
    assert elapsed < 2.0, f"exit {elapsed:.1f} s after the signal"
    assert "Traceback" not in stderr and len(support.error_lines(stderr)) == 1, stderr
    assert not [p for p in workers if _state(p) not in ("Z", "gone")], "workers left behind"
    assert support.snapshot(tmp_path) == before and not support.partial_files(tmp_path)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return text if "onnx_qat.runtime.workers" in text else ""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
