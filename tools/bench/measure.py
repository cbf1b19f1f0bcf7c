"""Timing and memory: whole-process wall time and peak RSS of a child, interleaved medians in process."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence


@dataclass(frozen=True)
class ProcessRun:
    """One child process: wall seconds, peak resident memory (MiB), exit code, its stdout, and the CPU
    seconds it used (user + system, its own threads included; on a machine shared with other jobs
    the wall time grows with their load, the CPU time much less)."""

    seconds: float
    peak_rss_mib: float
    returncode: int
    stdout: str
    cpu_seconds: float = 0.0


def run_process(args: Sequence[str], *, env: Optional[Mapping[str, str]] = None, timeout: float = 1800,
                cwd=None) -> ProcessRun:
    """Run ``args`` and measure it alone: wall time, and its own peak RSS.

    The child is started by a small launcher process (``python -m tools.bench.measure``) that waits for it
    with ``os.wait4``: Linux carries a process's peak RSS across fork and exec, so a child forked straight
    from this (large) process would report at least this process's size.

    Raises:
        RuntimeError: the child failed (with the end of its stderr) or ran over ``timeout`` seconds.
    """
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **dict(env or {})}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".json") as usage:
        launcher = [sys.executable, "-m", "tools.bench.measure", usage.name, "--", *args]
        start = time.perf_counter()
        proc = subprocess.Popen(launcher, stdout=out, stderr=err, env=full_env, cwd=cwd,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(args)}") from None
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
        measured = json.loads(usage.read() or "{}")
    if proc.returncode != 0 or "returncode" not in measured:
        tail = stderr.strip().splitlines()[-6:]
        raise RuntimeError(f"{' '.join(args[:5])} ... exited {proc.returncode}: {' | '.join(tail)}")
    return ProcessRun(measured.get("seconds", seconds), measured["peak_rss_mib"], 0, stdout,
                      measured.get("cpu_seconds", 0.0))


def _launch(argv) -> int:
    """``python -m tools.bench.measure USAGE.json -- CMD...``: run CMD, write its seconds and peak RSS."""
    usage_path, command = argv[0], argv[2:]
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    with open(usage_path, "w") as handle:
        json.dump({"seconds": seconds, "peak_rss_mib": usage.ru_maxrss / 1024.0, "returncode": code,
                   "cpu_seconds": usage.ru_utime + usage.ru_stime}, handle)
    return code


def python_module(module: str, *args: str) -> list:
    """The argument list running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def interleaved_medians(runs: Mapping[str, Callable[[], object]], *, repeats: int,
                        warmup: int = 1) -> Dict[str, float]:
    """Median seconds of each callable, run in turn (A B C A B C ...) so drift hits all alike."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    times: Dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def interleaved_rounds(runs: Mapping[str, Callable[[], object]], *, min_rounds: int, max_rounds: int,
                       seconds: float = 0.0, warmup: int = 1,
                       settled: Optional[Callable[[Dict[str, list]], bool]] = None) -> Dict[str, list]:
    """Seconds of every run of each callable, in rounds: each round runs every callable once, the order
    rotated from round to round (A B C, B C A, C A B ...) so that neither drift nor the slot after a
    given callable favours one. At least ``min_rounds``; then more, up to ``max_rounds``, while less than
    ``seconds`` have passed and ``settled(times)`` (when given) is not yet true."""
    names = list(runs)
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    times: Dict[str, list] = {name: [] for name in names}
    start = time.perf_counter()
    done = 0
    while done < min_rounds or (done < max_rounds and time.perf_counter() - start < seconds
                                and not (settled is not None and settled(times))):
        shift = done % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
        done += 1
    return times


def median_interval(values: Sequence[float], confidence: float = 0.95):
    """``(median, low, high)``: the median of ``values`` and a distribution-free confidence interval
    for it from order statistics (the binomial sign-test interval: the largest ``k`` with
    ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2`` gives ``[x(k), x(n-k+1)]``; with fewer than 6
    values no such ``k`` exists at 95% and the interval is the whole range)."""
    import math

    data = sorted(values)
    n = len(data)
    tail = (1.0 - confidence) / 2.0
    k, below = 0, 0.0
    while k < n // 2:  # below = P(X < k + 1) for X ~ Binomial(n, 1/2)
        below += math.comb(n, k) / 2.0 ** n
        if below > tail:
            break
        k += 1
    k = max(k, 1)
    return statistics.median(data), data[k - 1], data[n - k]


def paired_ratio(times: Mapping[str, Sequence[float]], numerator: str, denominator: str):
    """``(median, low, high)`` of the per-round ratios ``times[numerator][i] / times[denominator][i]``
    (`median_interval`): pairing the two runs of one round cancels the slower and faster phases of a
    shared machine, which a ratio of two medians keeps."""
    return median_interval([a / b for a, b in zip(times[numerator], times[denominator]) if b > 0])


def back_to_back_medians(runs: Mapping[str, Callable[[], object]], *, repeats: int,
                         warmup: int = 1) -> Dict[str, float]:
    """Median seconds of each callable run alone: its warm-up and all its ``repeats`` in a row, then
    the next one (A A A B B B ...): no other work between two runs of the same callable."""
    return {name: interleaved_medians({name: fn}, repeats=repeats, warmup=warmup)[name]
            for name, fn in runs.items()}


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
