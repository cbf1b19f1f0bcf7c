"""SIGINT and SIGTERM during ``--ray`` work on a local Ray cluster (issue 30, item 2): the CLI exits
130 / 143 within `BOUND` seconds of the signal, writes nothing, and leaves no process behind (the
Ray actors, the raylet, the GCS server: every process the run started). Skipped when Ray is not
installed."""
from __future__ import annotations

import signal
import subprocess
import threading
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


def _gcs_servers(pid: int) -> list:
    """The GCS server processes (one per local cluster) below ``pid``."""
    return [p for p in support.descendants(pid) if "/gcs_server" in support.cmdline(p).split(" ")[0]]


def _left_after_exit(pids) -> list:
    """``"PID command"`` of each of ``pids`` still running `ORPHAN_GRACE` seconds after the CLI's exit
    (the cluster's processes end with the process that started them), killed once listed."""
    end = time.monotonic() + ORPHAN_GRACE
    while any(support.alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    left = [p for p in pids if support.alive(p)]
    lines = [f"{p} {support.cmdline(p)[:80]}" for p in left]
    support.kill_all(left)
    return lines


def _assert_stopped(proc, sig, elapsed: float, stderr: str, pids, directory, before) -> None:
    """The run ``sig`` stopped: exit 130 / 143 within `BOUND` seconds, one line on stderr (no traceback,
    no stack dump), none of ``pids`` (the processes seen below it) running `ORPHAN_GRACE` seconds after
    the exit, and ``directory`` as it was (``before``, `support.snapshot`), no partial file."""
    left = _left_after_exit(pids)
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), stderr
    assert elapsed < BOUND, f"exit {elapsed:.1f} s after the signal"
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr
    assert len(support.error_lines(stderr)) == 1, stderr
    assert not left, "left running: " + "; ".join(left)
    assert support.snapshot(directory) == before and not support.partial_files(directory)


def _sensitivity_run(tmp_path, samples: int = 256):
    """``sensitivity --ray --workers 2`` of a small slow model on ``samples`` random images, started
    in ``tmp_path`` (its calibration and its settings each run on Ray actors): the process and the
    reader of its stderr."""
    support.save(slow_model(layers=6, channels=32), tmp_path / "model.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input=rng.standard_normal((samples, 32, 32, 32)).astype(np.float32))
    env = support.cli_env()
    env.pop("RAY_ADDRESS", None)  # a local cluster of this run's own
    args = ["sensitivity", "model.onnx", "--data", "calib.npz", "-o", "out.json", "--ray", "--workers", "2",
            "--no-progress", "--method", "max"]
    proc = subprocess.Popen(support.cli_command(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    return proc, StderrReader(proc)


def test_one_call_starts_one_local_cluster_for_all_its_pools(tmp_path):
    """``sensitivity`` runs its calibration and then its settings on Ray actors: both on the one
    local cluster the call started (one GCS server seen over the whole run, two sets of actors), not
    a cluster each, whose shutdown and start between the two used to leave the CLI without its
    signal handlers for seconds."""
    proc, reader = _sensitivity_run(tmp_path)
    servers, actors = set(), set()
    try:
        while proc.poll() is None:
            servers.update(_gcs_servers(proc.pid))
            actors.update(_actors(proc.pid))
            time.sleep(0.05)
        stderr = reader.finish(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert len(servers) == 1, f"GCS servers seen: {sorted(servers)}"
    assert len(actors) >= 4, f"actors seen: {sorted(actors)} (two for the calibration, two for the settings)"
    assert (tmp_path / "out.json").is_file()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_local_cluster_starts_stops_everything_within_the_bound(tmp_path, sig):
    """A signal as soon as the cluster's first process (its GCS server) runs, in the middle of
    ``ray.init``: the run ends with 130 / 143 within `BOUND` seconds and one line, writes nothing, prints
    no stack dump and leaves no process of the cluster. With ``ray.init`` on the main thread a signal
    there was acted on only part-way (the raylet's agents left running), or at the end of the start
    (3.6 s later), or, taken by Ray's own handler inside a fork hook, not at all (the run finished)."""
    proc, reader = _sensitivity_run(tmp_path)
    before = support.snapshot(tmp_path)
    seen, watching = set(), threading.Event()

    def watch():  # every process below the CLI while it runs (the agents start after the signal)
        while not watching.is_set():
            seen.update(support.descendants(proc.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        deadline = time.monotonic() + START
        while not _gcs_servers(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gcs_servers(proc.pid), f"no GCS server started:\n{reader.text}"
        elapsed, stderr = support.signal_and_time(proc, sig, lambda: reader.finish(timeout=60))
    finally:
        watching.set()
        watcher.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"{signal.Signals(sig).name} during the start: exit {proc.returncode} {elapsed:.2f} s after")
    _assert_stopped(proc, sig, elapsed, stderr, seen, tmp_path, before)


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
    print(f"{command}, {signal.Signals(sig).name}: exit {proc.returncode} {elapsed:.2f} s after the signal")
    _assert_stopped(proc, sig, elapsed, stderr, started, tmp_path, before)
