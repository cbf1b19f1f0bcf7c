"""SIGINT and SIGTERM during ``--ray`` work on a local Ray cluster (issue 30, item 2): the CLI exits
130 / 143 within `BOUND` seconds of the signal, writes nothing, and leaves no process behind (the
Ray actors, the raylet, the GCS server: every process the run started). Skipped when Ray is not
installed."""
from __future__ import annotations

import signal
import subprocess
import time

import numpy as np
import pytest

from tests.reliability import support
from tests.reliability.test_atomic_and_signals import StderrReader, slow_model

pytest.importorskip("ray", reason="Ray is not installed (pip install -c constraints.txt '.[ray]')")

#: Seconds from the signal to the exit (docs/performance.md, "Interrupts and errors").
BOUND = 2.0
#: Seconds after the exit within which every process the run started must have ended: the run kills
#: what is left of the cluster it started before it exits (``ray_workers._ClusterProcesses``), so
#: nothing waits on the raylet's agents noticing their raylet is gone (seconds on a loaded machine).
ORPHAN_GRACE = 1.0
#: Seconds to wait for the local cluster to start and its actors to run.
START = 180


def _actors(pid: int) -> list:
    """The Ray actor processes (process title ``ray::_Actor...``) below ``pid``."""
    return [p for p in support.descendants(pid) if support.cmdline(p).startswith("ray::_Actor")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["sensitivity", "calibrate"])
def test_a_signal_during_ray_work_stops_everything_within_the_bound(tmp_path, sig, command):
    support.save(slow_model(layers=6, channels=32), tmp_path / "model.onnx")
    samples, extra = (256, ["--method", "max"]) if command == "sensitivity" else \
        (1024, ["--method", "entropy", "--batch-size", "4"])
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input=rng.standard_normal((samples, 32, 32, 32)).astype(np.float32))
    before = support.snapshot(tmp_path)
    env = support.cli_env()
    env.pop("RAY_ADDRESS", None)  # a local cluster of this run's own
    args = [command, "model.onnx", "--data", "calib.npz", "-o", "out.json", "--ray", "--workers", "2",
            "--no-progress", *extra]
    proc = subprocess.Popen(support.cli_command(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    reader = StderrReader(proc)
    started = []
    try:
        deadline = time.monotonic() + START
        while len(_actors(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_actors(proc.pid)) >= 2, f"the Ray actors never started:\n{reader.text}"
        time.sleep(1.0)  # the actors are running units
        started = support.descendants(proc.pid)
        assert proc.poll() is None, "the work finished before the signal; make it longer"
        elapsed, stderr = support.signal_and_time(proc, sig, lambda: reader.finish(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic() + ORPHAN_GRACE  # the cluster's processes end with the process that started them
    while any(support.alive(p) for p in started) and time.monotonic() < end:
        time.sleep(0.1)
    left = [p for p in started if support.alive(p)]
    left_lines = [f"{p} {support.cmdline(p)[:80]}" for p in left]
    support.kill_all(left)
    print(f"{command}, {signal.Signals(sig).name}: exit {proc.returncode} {elapsed:.2f} s after the signal")
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), stderr
    assert elapsed < BOUND, f"exit {elapsed:.1f} s after the signal"
    assert "Traceback" not in stderr and len(support.error_lines(stderr)) == 1, stderr
    assert not left, "left running: " + "; ".join(left_lines)
    assert support.snapshot(tmp_path) == before and not support.partial_files(tmp_path)
