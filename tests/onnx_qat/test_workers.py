"""onnx_qat.runtime.workers: work units on worker processes, in order, with errors, signals and no
orphans."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_qat.errors import DataError, WorkerError
from onnx_qat.runtime.workers import (
    WORKER_BASE_BYTES, ModelPayload, WorkerPool, default_workers, map_units, threads_per_worker,
)
from tests.builders import residual_block_model

ROOT = Path(__file__).resolve().parents[2]


class SquareJob:
    """Units are ``(value, seconds)``: the worker sleeps, then answers ``value ** 2`` with its pid, the
    threads it was given and how many times its ``start`` ran."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def start(self, threads):
        started = {"count": getattr(os, "_test_workers_starts", 0) + 1}
        os._test_workers_starts = started["count"]

        def run(unit):
            value, seconds = unit
            if isinstance(seconds, tuple):  # ("wait", path): until the file exists (10 s at most);
                kind, path = seconds        # ("mark", path): create it
                if kind == "mark":
                    open(path, "w").close()
                deadline = time.monotonic() + 10.0
                while kind == "wait" and not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                time.sleep(seconds)
            if value == "value-error":
                raise ValueError("bad unit\nsecond line")
            if value == "data-error":
                raise DataError("key 'x' is missing")
            if value == "die":
                os._exit(7)
            return value * value + self.offset, os.getpid(), threads, started["count"]
        return run


class FailingStart:
    def start(self, threads):
        raise RuntimeError("cannot build the session")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(pool) -> list:
    return [p.pid for p in pool._procs]


def test_results_come_in_submission_order_and_match_one_process(tmp_path):
    # later units finish first: the first waits until the last has run (on the other worker), whatever
    # the machine's load
    marker = str(tmp_path / "last-ran")
    units = [(k, ("wait", marker) if k == 0 else ("mark", marker) if k == 11 else 0.0) for k in range(12)]
    with WorkerPool(SquareJob(offset=5), workers=2, threads=1) as pool:
        seen = []
        results = pool.map(units, on_result=lambda i, r: seen.append(i))
        pids = _pids(pool)
    assert [r[0] for r in results] == [k * k + 5 for k in range(12)]
    assert sorted(seen) == list(range(12)) and seen != list(range(12))  # arrived out of order
    assert {r[1] for r in results} == set(pids)  # both workers worked
    assert {r[3] for r in results} == {1}  # each worker started the job once
    assert {r[2] for r in results} == {1}
    local = map_units(SquareJob(offset=5), units, 1)
    assert [r[0] for r in local] == [r[0] for r in results]
    with WorkerPool(SquareJob(), workers=2, threads=1) as pool:  # a generator, results not kept
        got = {}
        assert pool.map(((k, 0.0) for k in range(7)), on_result=got.__setitem__, keep=False) == []
        assert {i: r[0] for i, r in got.items()} == {k: k * k for k in range(7)}
    assert local[0][1] == os.getpid() and local[0][2] is None  # in this process, default threads
    assert not any(_alive(pid) for pid in pids)


def test_a_pool_serves_several_maps_and_shares_the_cores():
    assert threads_per_worker(2, cores=16) == 8 and threads_per_worker(3, cores=2) == 1
    with WorkerPool(SquareJob(), workers=2) as pool:
        assert pool.threads == threads_per_worker(2)
        assert [r[0] for r in pool.map([(3, 0), (4, 0)])] == [9, 16]
        assert [r[0] for r in pool.map([(k, 0) for k in range(5)])] == [0, 1, 4, 9, 16]
        assert pool.map([]) == []


def test_a_unit_error_is_one_line_naming_worker_and_unit_and_our_errors_keep_their_class():
    with WorkerPool(SquareJob(), workers=2, name="sensitivity") as pool:
        with pytest.raises(WorkerError) as info:
            pool.map([(1, 0), (2, 0), ("value-error", 0)])
        pids = _pids(pool)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("sensitivity: worker ") and "(unit 3)" in message
    assert "ValueError: bad unit second line" in message
    assert not any(_alive(pid) for pid in pids)
    with WorkerPool(SquareJob(), workers=2) as pool:
        with pytest.raises(DataError, match=r"^key 'x' is missing$"):
            pool.map([(1, 0), ("data-error", 0)])


def test_a_failing_start_and_a_dying_worker_are_worker_errors():
    with WorkerPool(FailingStart(), workers=2, name="calibration") as pool:
        with pytest.raises(WorkerError, match=r"calibration: worker \d of 2 failed \(starting\): "
                                              r"RuntimeError: cannot build the session"):
            pool.map([(1, 0)])
    with WorkerPool(SquareJob(), workers=2) as pool:
        with pytest.raises(WorkerError, match=r"worker \d of 2 ended unexpectedly \(exit code 7\)"):
            pool.map([("die", 0), (1, 0.3)])
        with pytest.raises(WorkerError, match="already stopped"):
            pool.map([(1, 0)])


def test_a_job_that_cannot_be_pickled_is_refused_before_any_process_starts():
    class Local:  # a class inside a function cannot be pickled
        def start(self, threads):
            return abs

    with pytest.raises(WorkerError, match="cannot be sent to worker processes"):
        WorkerPool(Local(), workers=2)


def test_sigint_in_the_main_process_stops_the_map_within_two_seconds_and_reaps_the_workers():
    pool = WorkerPool(SquareJob(), workers=2)
    pids = _pids(pool)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with pool:
                pool.map([(k, 30.0) for k in range(4)])
    finally:
        timer.cancel()
    assert time.monotonic() - start < 2.5  # 0.5 s before the signal
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_script_without_main_guard_works_and_its_workers_die_with_it_killed_outright(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from onnx_qat.runtime.workers import WorkerPool
        from tests.onnx_qat.test_workers import SquareJob
        # no `if __name__ == "__main__"` guard: workers never import the caller's script again
        pool = WorkerPool(SquareJob(), workers=2)
        pool.map([(1, 0), (2, 0)])
        print(" ".join(str(p.pid) for p in pool._procs), flush=True)
        pool.map([(k, 60.0) for k in range(2)])
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_default_workers_rule():
    gib = 1 << 30
    assert default_workers(gib - WORKER_BASE_BYTES, cores=16, memory=64 * gib) == 16  # 32 GiB / 1 GiB
    assert default_workers(gib - WORKER_BASE_BYTES, cores=16, memory=8 * gib) == 4  # memory bound
    assert default_workers(4 * gib, cores=16, memory=4 * gib) == 1  # at least one
    assert default_workers(0, cores=16, memory=None, units=3) == 3  # no more than the units
    assert default_workers(0, cores=2, memory=64 * gib, units=100) == 2
    with pytest.raises(Exception, match="workers must be a whole number >= 1, got 0"):
        WorkerPool(SquareJob(), workers=0)


def test_model_payload_carries_the_model_unchanged(tmp_path):
    model = residual_block_model(projection=True)
    payload = ModelPayload(model)
    assert payload.nbytes >= sum(len(t.SerializeToString()) for t in model.graph.initializer)
    rebuilt = payload.model()
    assert rebuilt.SerializeToString() == model.SerializeToString()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    from_path = ModelPayload(path)
    assert from_path.nbytes == path.stat().st_size
    loaded = from_path.model()
    for a, b in zip(loaded.graph.initializer, model.graph.initializer):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
