"""workers: ``onnx_qat.sensitivity`` and ``onnx_qat.calibrate`` with 1 worker and with 2, side by side.

The model is the PP-OCRv4 DB text detector (the ``sensitivity`` benchmark's model and inputs: 320x320,
16 calibration and 16 evaluation images); without it (offline) a built YOLOv8n-shaped detector at
160x160 stands in, and the rows say so. Each figure is measured in this process, one worker first, then
two, back to back, with the load average before and after each run (the machine is shared: the
speed-up is only meaningful at a steady load, which the detail says). The goal: sensitivity at least
1.7x faster with 2 workers on a 2-core machine. The rows also check that both runs report the same
figures (bit for bit) and give the peak resident memory of each worker process (read from /proc while
they run). ``--quick`` runs a tiny CNN: it checks the rows, not the goals.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

from . import models
from .table import Goal, Row, ratio

NAME = "workers"
SPEEDUP_GOAL = 1.7


class WorkerMemory:
    """Peak resident memory (VmHWM) of this process's child processes, polled while it runs (Linux)."""

    def __init__(self, every: float = 0.2):
        self.peaks: Dict[int, int] = {}
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "WorkerMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join(5)
        return False

    def _poll(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self._every):
            for pid in _children(me):
                peak = _hwm(pid)
                if peak:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), peak)

    def summary(self) -> str:
        if not self.peaks:
            return "worker memory not seen"
        gib = [v / 2 ** 30 for v in self.peaks.values()]
        return f"peak RSS per worker {min(gib):.2f}-{max(gib):.2f} GiB ({len(gib)} workers)"


def _children(parent: int) -> List[int]:
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _timed(fn: Callable[[], object]):
    """``(result, wall s, load average before, load average after, CPU s)``: the CPU time of this
    process (onnxruntime's threads included) and of the worker processes it reaped."""
    before = os.getloadavg()[0]
    times = os.times()
    start = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - start
    after = os.times()
    cpu = sum(after[:4]) - sum(times[:4])  # user + system, of this process and its reaped children
    return out, wall, before, os.getloadavg()[0], cpu


def _built_detector(workdir: Path):
    """A built YOLOv8n-shaped detector at 160x160 (the stand-in when the PP-OCRv4 detector is missing)
    and its inputs."""
    import onnx

    rng = np.random.default_rng(0)
    calib = {"images": rng.uniform(0, 255, (16, 3, 160, 160)).astype(np.float32)}
    evaluation = {"images": rng.uniform(0, 255, (16, 3, 160, 160)).astype(np.float32)}
    path = workdir / "built_detector.onnx"
    onnx.save(models.detector(160, calib=calib["images"]), str(path))
    return path, calib, evaluation, "built YOLOv8n-shaped detector 160x160 (the PP-OCRv4 detector is missing"


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the rows."""
    import onnx

    import onnx_qat

    from .sensitivity import SIZE, _detector, _detector_inputs

    workdir = Path(workdir)
    if quick:
        path = workdir / "tiny_cnn.onnx"
        onnx.save(models.tiny_cnn(), str(path))
        calib = {"input": models.images(8, 16, seed=2, channels_last=False, channels=16)}
        evaluation = {"input": models.images(8, 16, seed=3, channels_last=False, channels=16)}
        what = "tiny CNN 16x16"
    else:
        path, why = _detector(workdir)
        if path is None:
            path, calib, evaluation, what = _built_detector(workdir)
            what += f": {why})"
        else:
            calib, evaluation = _detector_inputs("calib"), _detector_inputs("eval")
            what = f"PP-OCRv4 detector {SIZE}x{SIZE}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def sens(workers: int):
        return onnx_qat.sensitivity(str(path), calib, eval_data=evaluation, progress=False, workers=workers)

    one, t1, l1a, l1b, cpu1 = _timed(lambda: sens(1))
    with WorkerMemory() as memory:
        two, t2, l2a, l2b, cpu2 = _timed(lambda: sens(2))
    same = one == two and [s.only.cosine for s in one.sites] == [s.only.cosine for s in two.sites]
    rows = [Row(NAME, f"sensitivity 1 worker / 2 workers, {what}, {len(one)} sites", ratio(t1, t2),
                None if quick else Goal(">=", SPEEDUP_GOAL),
                f"wall {t1:.1f} s (load {l1a:.1f}->{l1b:.1f}) vs {t2:.1f} s (load {l2a:.1f}->{l2b:.1f}) on "
                f"{cores} cores; CPU {cpu1:.1f} s vs {cpu2:.1f} s (workers included); {one.runs} runs each; "
                f"figures identical: {'yes' if same else 'NO'}; {memory.summary()}")]
    samples = 64 if not quick else 16
    data = {k: np.concatenate([v] * (samples // len(v))) for k, v in calib.items()}

    def calib_run(workers: int):
        return onnx_qat.calibrate(str(path), data, method="entropy", batch_size=4, workers=workers,
                                  progress=False)

    c1, u1, m1a, m1b, k1 = _timed(lambda: calib_run(1))
    c2, u2, m2a, m2b, k2 = _timed(lambda: calib_run(2))
    rows.append(Row(NAME, f"calibration (entropy, {samples} samples, batches of 4) 1 worker / 2 workers",
                    ratio(u1, u2), None,
                    f"wall {u1:.1f} s (load {m1a:.1f}->{m1b:.1f}) vs {u2:.1f} s (load {m2a:.1f}->{m2b:.1f}); "
                    f"CPU {k1:.1f} s vs {k2:.1f} s; "
                    f"ranges identical: {'yes' if c1.activations == c2.activations else 'NO'}"))
    return rows


__all__ = ["run", "WorkerMemory"]
