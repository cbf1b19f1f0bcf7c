"""calibration_scale: ``onnx-qat quantize --data`` with ``--method auto`` (the default) against
``--method max`` on the synthetic residual nets of ``rewrite_speed`` (10,000 and 50,000 nodes, and 20,000
between them to show how the cost grows).

Each run is a whole process (``python -m onnx_qat quantize MODEL --data DATA --method M -o OUT``), the two
methods in turn (A B A B), the least disturbed of the repeats counting: the least wall time for the
time rows, the least CPU time (user + system from ``os.wait4``, threads and worker processes
included) for the CPU rows, with the load average at the start and end of each size. The nets are
``models.residual_net(nodes, weight_std=0.04)``: with the rewrite benchmark's default weights the
activations overflow float32 after a few thousand blocks, which no calibration can range. The data:
32 samples of the net's fixed [1, 16, 4, 4] input (one run per sample).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Sequence

import numpy as np

from . import models
from .measure import python_module, run_process
from .table import Goal, Row, ratio

NAME = "calibration_scale"
SAMPLES = 32


def _prepare(workdir: Path, nodes: int):
    import onnx

    model, _ = models.residual_net(nodes, weight_std=0.04)
    path = workdir / f"residual_calib_{nodes}.onnx"
    onnx.save(model, str(path))
    data = workdir / "residual_calib_data.npz"
    if not data.exists():
        rng = np.random.default_rng(0)
        np.savez(data, input=rng.standard_normal((SAMPLES, 16, 4, 4)).astype(np.float32))
    return path, data, len(model.graph.node)


def _measure(workdir: Path, nodes: int, repeats: int):
    """``(node count, {method: least wall-time run}, {method: least CPU-time run}, (load average at
    the start, at the end))``."""
    path, data, count = _prepare(workdir, nodes)
    runs = {"max": [], "auto": []}
    load = os.getloadavg()[0]
    for _ in range(repeats):
        for method in runs:
            runs[method].append(run_process(python_module(
                "onnx_qat", "quantize", str(path), "--data", str(data), "--method", method, "-o",
                str(workdir / f"residual_calib_{nodes}_{method}.onnx"), "--no-progress", "-q"), timeout=3600))
    return (count, {m: min(r, key=lambda run: run.seconds) for m, r in runs.items()},
            {m: min(r, key=lambda run: run.cpu_seconds) for m, r in runs.items()}, (load, os.getloadavg()[0]))


def run(workdir: Path, *, quick: bool = False, sizes: Sequence[int] = ()) -> List[Row]:
    """Measure and return the calibration_scale rows."""
    sizes = tuple(sizes) or ((200, 1000) if quick else (10_000, 20_000, 50_000))
    repeats = 1 if quick else 2
    results = {n: _measure(Path(workdir), n, repeats) for n in sizes}
    rows = []
    for n in sizes:
        count, best, least_cpu, load = results[n]
        rows.append(Row(NAME, f"quantize --method auto / --method max, time, {count} nodes",
                        ratio(best["auto"].seconds, best["max"].seconds), Goal("<=", 2.0),
                        f"whole process, {SAMPLES} samples, best of {repeats}: {best['auto'].seconds:.1f} s "
                        f"vs {best['max'].seconds:.1f} s; peak RSS {best['auto'].peak_rss_mib:.0f} MiB vs "
                        f"{best['max'].peak_rss_mib:.0f} MiB; load average {load[0]:.1f} -> {load[1]:.1f}"))
        cpu_ratio = ratio(least_cpu["auto"].cpu_seconds, least_cpu["max"].cpu_seconds)
        rows.append(Row(NAME, f"the same, CPU time (user + system), {count} nodes", cpu_ratio,
                        Goal("<=", 2.0), f"least of {repeats}: {least_cpu['auto'].cpu_seconds:.1f} s vs "
                        f"{least_cpu['max'].cpu_seconds:.1f} s (less moved by other jobs than wall time)"))
    small, large = sizes[0], sizes[-1]
    extra = {n: (results[n][1]["auto"].seconds - results[n][1]["max"].seconds) / results[n][0] for n in sizes}
    rows.append(Row(NAME, f"auto's extra cost per node, {results[large][0]} vs {results[small][0]} nodes",
                    ratio(max(extra[large], 1e-9), max(extra[small], 1e-9)), Goal("<=", 1.5),
                    f"{1e6 * extra[small]:.0f} us/node at {results[small][0]}, "
                    f"{1e6 * extra[large]:.0f} at {results[large][0]} (auto minus max, whole process)"))
    cpu = {n: (results[n][2]["auto"].cpu_seconds - results[n][2]["max"].cpu_seconds) / results[n][0]
           for n in sizes}
    rows.append(Row(NAME, f"auto's extra CPU time per node, {results[large][0]} vs {results[small][0]} nodes",
                    ratio(max(cpu[large], 1e-9), max(cpu[small], 1e-9)), None,
                    "; ".join(f"{1e6 * cpu[n]:.0f} us/node at {results[n][0]}" for n in sizes)
                    + " (user + system of the same runs: less moved by other jobs than the wall time)"))
    return rows
