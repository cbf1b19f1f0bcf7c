"""The settings of sensitivity and mixed precision, run in this process or on worker processes.

A *setting* is the set of sites quantized in one run of the gated model (`onnx_qat.accuracy.gated`);
its answer is the `OutputError` against the float model's outputs. Settings are independent of each
other, so they are the work units (`onnx_qat.runtime.workers`): each worker receives once the gated
model (`ModelPayload`), the evaluation feeds, the float reference outputs and the state mapping of a
stateful model (`SettingsJob`); builds its own `GatedRunner` (its session, reference runs and cut
cache) with ``cores // workers`` onnxruntime threads; and then gets one setting (a tuple of site
indices) at a time and answers one `OutputError` (three floats). Every setting's answer is computed
exactly as in one process (the same model, feeds, cut plan and arithmetic), and the results come back
in the order asked, so the figures and every decision taken from them are identical for any number of
workers (tested bit for bit).

``workers=None`` chooses with `choose_workers`: one per usable core while `MEMORY_SHARE` of the
available memory holds them at `worker_bytes` each, and one (this process, no worker) when they are
not estimated to finish sooner than this process alone (`pays_off`).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .figures import OutputError, output_error

logger = logging.getLogger(__name__)

#: A worker's overhead before its first setting, in float passes over the evaluation data: building the
#: gated session and its two reference runs (every site float, every site quantized).
OVERHEAD_PASSES = 3


class LocalSettings:
    """Settings run in this process, in one `GatedRunner` (``workers=1``)."""

    workers = 1

    def __init__(self, runner, reference: Mapping[str, np.ndarray]):
        self.runner = runner
        self.reference = reference

    @property
    def runs(self) -> int:
        """Settings run so far."""
        return self.runner.runs

    def errors(self, settings: Iterable[Iterable[int]], on_run: Optional[Callable[[], None]] = None
               ) -> List[OutputError]:
        """The `OutputError` of each setting, in order."""
        out = []
        for quantized in settings:
            out.append(output_error(self.reference, self.runner.run(quantized)))
            if on_run is not None:
                on_run()
        return out

    def run(self, quantized: Iterable[int], scales: Optional[Mapping[str, np.ndarray]] = None
            ) -> Dict[str, np.ndarray]:
        """The outputs of one setting with the activation scales ``scales`` fed (`GatedRunner.run`):
        what the range search (`onnx_qat.accuracy.ranges`) runs, only in this process."""
        return self.runner.run(quantized, scales)

    def set_reference(self, quantized: Iterable[int], scales: Optional[Mapping[str, np.ndarray]] = None,
                      default: bool = False) -> None:
        """`GatedRunner.set_reference` (the range search's accepted changes)."""
        self.runner.set_reference(quantized, scales, default=default)

    def close(self) -> None:
        """Nothing to stop."""


class SettingsJob:
    """What each worker receives once (see the module docstring); picklable."""

    def __init__(self, gated, num_sites: int, feeds: Sequence[Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray], state: Optional[Mapping[str, str]]):
        from ..runtime.workers import ModelPayload

        self.model = ModelPayload(gated)
        self.num_sites = num_sites
        self.feeds = [dict(f) for f in feeds]
        self.reference = dict(reference)
        self.state = dict(state) if state else None

    def start(self, threads: Optional[int]) -> Callable[[Tuple[int, ...]], OutputError]:
        """In the worker: build the gated runner; return the function that answers one setting."""
        from .gated import GatedRunner

        runner = GatedRunner(self.model.model(), self.num_sites, self.feeds, tuple(self.reference),
                             threads=threads, state=self.state)
        reference = self.reference

        def run(quantized: Tuple[int, ...]) -> OutputError:
            return output_error(reference, runner.run(quantized))
        return run


class PooledSettings:
    """Settings run on a `WorkerPool` of ``workers`` processes, or on Ray actors (``spec.ray``;
    ``workers`` None: as many as the cluster's CPUs, at most ``units``)."""

    def __init__(self, job: SettingsJob, workers: Optional[int], spec=None, units: Optional[int] = None):
        from ..runtime.workers import WorkerSpec, start_pool

        self.pool = start_pool(job, spec or WorkerSpec(workers), workers, name="settings", units=units)
        self.workers = self.pool.workers
        self.runs = 0

    def errors(self, settings: Iterable[Iterable[int]], on_run: Optional[Callable[[], None]] = None
               ) -> List[OutputError]:
        """The `OutputError` of each setting, in order (run on the workers)."""
        units = [tuple(sorted(set(int(k) for k in s))) for s in settings]
        out = self.pool.map(units, None if on_run is None else (lambda index, value: on_run()))
        self.runs += len(units)
        return out

    def close(self) -> None:
        """Stop the workers."""
        self.pool.close()


def worker_bytes(gated_bytes: int, feeds: Sequence[Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray], cut_bytes: int, peak_bytes: int = 0) -> int:
    """Estimated memory of one worker beyond its imports: the larger of (the gated model three times:
    its protobuf, the session's weights, the kernels' packed copies; the feeds and the reference twice:
    received, then held by the runner) and ``peak_bytes`` (this process's peak so far, which ran the
    float model on the same feeds: onnxruntime's activations are in it), plus the cut cache's bound."""
    data = sum(np.asarray(v).nbytes for f in feeds for v in f.values())
    data += sum(np.asarray(v).nbytes for v in reference.values())
    return max(3 * gated_bytes + 2 * data, peak_bytes) + cut_bytes


def peak_memory() -> int:
    """This process's peak resident memory in bytes (0 where the system does not say)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
    except (ImportError, OSError, AttributeError):
        return 0


def choose_workers(workers, *, gated_bytes: int, feeds, reference, num_sites: int,
                   float_seconds: float, cut_bytes: int, peak_bytes: int = 0) -> Optional[int]:
    """The worker count of ``workers`` (a count or a `WorkerSpec`): the count when given; with Ray and
    no count, None (the cluster's CPUs decide); else `default_workers` for `worker_bytes` each, when
    that many are estimated to pay off (`pays_off`: the settings take about ``float_seconds``, the
    float model's session and run on the evaluation data, each, ``num_sites + 1`` of them, and each
    worker first pays a start-up and `OVERHEAD_PASSES` such passes), else one."""
    from ..runtime.workers import WORKER_START_SECONDS, default_workers, pays_off, worker_spec

    spec = worker_spec(workers)
    if spec.count is not None or spec.ray is not None:
        return spec.count
    count = default_workers(worker_bytes(gated_bytes, feeds, reference, cut_bytes, peak_bytes),
                            units=num_sites + 1)
    overhead = WORKER_START_SECONDS + OVERHEAD_PASSES * float_seconds
    return count if pays_off(float_seconds * (num_sites + 1), overhead, count) else 1


def settings_runner(gated, num_sites: int, feeds, reference: Dict[str, np.ndarray], state,
                    workers: Optional[int], spec=None):
    """`LocalSettings` for one worker without Ray, else `PooledSettings` on ``workers`` processes
    (or Ray actors, ``spec.ray``)."""
    from .gated import GatedRunner

    if workers == 1 and (spec is None or spec.ray is None):
        return LocalSettings(GatedRunner(gated, num_sites, feeds, tuple(reference), state=state), reference)
    pooled = PooledSettings(SettingsJob(gated, num_sites, feeds, reference, state), workers, spec,
                            units=num_sites + 1)
    logger.info("running the settings on %d workers", pooled.workers)
    return pooled


__all__ = ["LocalSettings", "PooledSettings", "SettingsJob", "settings_runner", "choose_workers",
           "worker_bytes", "peak_memory", "OVERHEAD_PASSES"]
