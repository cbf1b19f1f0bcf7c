"""Calibration split over worker processes: contiguous parts of the data, one collector set per part,
merged exactly.

The main process always runs the first batch itself (in the session it builds anyway); when the worker
count is to be estimated it runs the second too and times that one (the first batch also pays every
collector's first allocation and a piece-by-piece runner's session builds, which later batches do not),
the lesser of its wall and CPU time (on a machine loaded by other jobs the wall time grows, and workers
on the same cores would not win it back).
The remaining batches are cut into contiguous parts of a few batches each, read lazily (no more parts
in memory than there are workers, plus one) and sent to whichever worker is free
(`onnx_qat.runtime.workers`). Each worker holds the model once (`ModelPayload`) with
``cores // workers`` onnxruntime threads, runs a part through the same loop as one process
(`onnx_qat.calibration.runner.observe_feeds`) into fresh collectors, and answers them; the main
process merges every part's collectors into its own as they arrive: a maximum is a maximum, and the
histograms merge exactly (`AbsHistogram.merge`: power-of-two ranges, aligned bins), so the ranges are
those of one pass over the data, bit for bit, whatever the order the parts come back in. ``auto``'s
check batches (the first `CHECK_SAMPLES` samples and the float outputs on them) are put back in the
order of the data.

Not split: a stateful model (``state``: each step needs the state the previous step produced, so its
feeds run in order in one process), a model whose observed tensors lie in If branches or Loop/Scan
bodies (`BranchRunner`), and, with ``workers=None``, data whose remaining batches workers are not
estimated to finish sooner (`pays_off`: the second batch's time times the batches left, against a
worker's start-up and session build, timed on this process's own build).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..runtime.workers import worker_spec  # noqa: F401  (the API's workers/ray keywords, for quantize)

logger = logging.getLogger(__name__)

#: Parts per worker the data is cut into (several, so that a slow part does not leave the others idle).
PARTS_PER_WORKER = 4


class CollectJob:
    """What each worker receives once: the model, the tensors to observe and fetch, and the two
    functions of `onnx_qat.calibration.runner` a part goes through (``new_observers()``: fresh
    collectors of the method and its options; ``observe``: `observe_feeds`); picklable."""

    def __init__(self, model, fetched: Sequence[str], outputs: Sequence[str], run_outputs: Sequence[str],
                 new_observers: Callable[[], Dict[str, object]], observe: Callable, dataset):
        from ..runtime.workers import ModelPayload

        self.model = ModelPayload(model)
        self.fetched, self.outputs, self.run_outputs = tuple(fetched), tuple(outputs), tuple(run_outputs)
        self.new_observers, self.observe = new_observers, observe
        self.part = _PartSource(dataset.source, _per_sample(dataset))
        self.batch_axis = dict(getattr(dataset, "batch_axis", None) or {})

    def start(self, threads: Optional[int]):
        """In the worker: build the session; return the function that observes one part."""
        from .branches import make_runner

        session = make_runner(self.model.model(), list(self.run_outputs), threads=threads,
                              batch_axis=self.batch_axis)
        job = self

        def run(part):
            first_batch, samples, feeds = part
            observers = job.new_observers()
            reached, kept, _ = job.observe(session, job.part, feeds, observers, job.fetched, job.outputs,
                                           samples, first_batch)
            return observers, reached, kept, len(feeds)
        return run


class _PartSource:
    """What `observe_feeds` asks of the dataset inside a worker: its name and how to count samples."""

    def __init__(self, source: str, per_sample: bool):
        self.source = source
        self.per_sample = per_sample


def _per_sample(dataset) -> bool:
    """True when a feed's first axis counts samples (as `_samples_in` counts them)."""
    from ..io.data import Dataset

    return isinstance(dataset, Dataset) and not dataset.unbatched and not dataset.state


def split_reason(model, dataset, run_outputs) -> str:
    """Why calibration cannot be split over workers here (empty when it can)."""
    from .branches import in_main_graph

    if getattr(dataset, "state", None):
        return ("a stateful model (--state) runs its feeds in order, each step from the state the previous "
                "one produced, so its calibration stays in one process")
    if not in_main_graph(model, run_outputs):
        return "tensors of If branches or Loop/Scan bodies are observed in one process"
    return ""


def observe_split(model, dataset, observers: Dict[str, object], fetched: Sequence[str],
                  outputs: Sequence[str], run_outputs: Sequence[str], *,
                  new_observers: Callable[[], Dict[str, object]], observe_feeds: Callable,
                  count_samples: Callable, check_samples: int, batch_size: int, progress: bool, desc: str,
                  workers: Optional[int]):
    """Observe every batch of ``dataset`` into ``observers`` (the main process's, merged into), on
    ``workers`` processes where they pay (see the module docstring); returns ``(names reached, kept
    check batches)`` as one pass would. The calibration runner gives its own functions:
    ``new_observers()`` (fresh collectors), ``observe_feeds`` (its loop over a part),
    ``count_samples(dataset, feed)`` and ``check_samples`` (``auto``'s check batches)."""
    from .branches import make_runner

    total = dataset.num_batches(batch_size)  # None: a stream of feeds not read to its end yet
    feeds = iter(dataset.batches(batch_size))
    bar = _bar(total, progress, desc)
    try:
        started = time.perf_counter()
        session = make_runner(model, list(run_outputs),
                              batch_axis=dict(getattr(dataset, "batch_axis", None) or {}))
        build = time.perf_counter() - started
        first = next(feeds, None)
        started = time.perf_counter()
        reached, kept, samples = observe_feeds(session, dataset, [] if first is None else [first], observers,
                                               fetched, outputs)
        bar.update(1)
        seconds = time.perf_counter() - started
        built = getattr(session, "build_seconds", 0.0)  # a piece-by-piece runner builds on its first run
        build, seconds = build + built, max(seconds - built, 0.0)
        done = 1
        rest = None if total is None else total - 1
        if first is not None and workers.count is None and workers.ray is None and (rest or 0) > 1:
            # the estimate times the second batch: the first also paid every collector's first
            # allocation (auto's histograms: 64 KiB per tensor), which no later batch pays again
            second = next(feeds, None)
            if second is not None:  # (None only when the data held fewer batches than it said)
                started, cpu = time.perf_counter(), time.process_time()
                more, more_kept, samples = observe_feeds(session, dataset, [second], observers, fetched,
                                                         outputs, samples, 1)
                bar.update(1)
                again = getattr(session, "build_seconds", 0.0) - built  # a smaller batch's own sessions
                # the lesser of its wall and CPU time: other jobs stretch the wall time of a loaded
                # machine, which workers on the same cores would not win back
                elapsed = min(time.perf_counter() - started, time.process_time() - cpu)
                build, seconds = build + again, max(elapsed - again, 0.0)
                reached, kept, done = reached | more, kept + more_kept, 2
                rest -= 1
        count = 1 if first is None else _worker_count(workers, model, first, observers, seconds, rest, build)
        if (count == 1 and workers.ray is None) or rest == 0:
            more, more_kept, _ = observe_feeds(session, dataset, _counted(feeds, bar), observers, fetched,
                                               outputs, samples, done)
            return reached | more, kept + more_kept
        del session

        job = CollectJob(model, fetched, outputs, run_outputs, new_observers, observe_feeds, dataset)
        parts_kept: Dict[int, list] = {}

        def merge(index: int, answer) -> None:
            their_observers, their_reached, their_kept, batches = answer
            for name, observer in their_observers.items():
                observers[name].merge(observer)
            reached.update(their_reached)
            if their_kept:
                parts_kept[index] = their_kept
            bar.update(batches)

        from ..runtime.workers import start_pool

        with start_pool(job, workers, count, name="calibration", units=rest) as pool:
            logger.info("calibration: the batches after the first on %d workers", pool.workers)
            size = max(1, -(-rest // (pool.workers * PARTS_PER_WORKER))) if rest else 1
            counting = (lambda feed: count_samples(dataset, feed)) if outputs else None
            pool.map(_parts(feeds, size, done, samples, counting, check_samples), merge, keep=False)
        for index in sorted(parts_kept):
            kept.extend(parts_kept[index])
        return reached, kept
    finally:
        bar.close()


def _parts(feeds, size: int, first_batch: int, samples: int, count: Optional[Callable], check_samples: int):
    """Contiguous parts of ``size`` batches: ``(first batch index, first sample, feeds)``. The first
    sample is counted (``count(feed)``) only while ``auto``'s check batches are being kept (as
    `observe_feeds` does)."""
    part: List[dict] = []
    start = first_batch
    for index, feed in enumerate(feeds, first_batch):
        part.append(feed)
        if len(part) == size:
            yield start, samples, part
            if count is not None and samples < check_samples:
                samples += sum(count(f) for f in part)
            part, start = [], index + 1
    if part:
        yield start, samples, part


def _counted(feeds, bar):
    for feed in feeds:
        yield feed
        bar.update(1)


def _worker_count(workers, model, first: dict, observers, seconds: float, batches: Optional[int],
                  build: float = 0.0) -> Optional[int]:
    """The count of ``workers`` (a `WorkerSpec`) when given (no more than the batches left); with Ray
    and no count, None (the cluster's CPUs decide); else one when the batches left are unknown (a
    stream), and otherwise `default_workers` (each holding the model three times over, two parts of
    data in flight and its collectors) when they pay off (`pays_off`: ``seconds``, the timed batch's
    run, times the ``batches`` left, against a worker's start-up and a session ``build`` as long as
    this process's), else one."""
    from ..runtime.workers import WORKER_START_SECONDS, default_workers, pays_off

    if workers.count is not None:
        return max(1, workers.count if batches is None else min(workers.count, batches))
    if workers.ray is not None:
        return None
    if not batches:
        return 1
    batch_bytes = sum(np.asarray(v).nbytes for v in first.values())
    per_part = batch_bytes * max(1, batches // PARTS_PER_WORKER)
    state = sum(o.collector.state_nbytes() for o in observers.values())
    count = default_workers(3 * model.ByteSize() + 2 * per_part + 2 * state, units=batches)
    return count if pays_off(seconds * batches, WORKER_START_SECONDS + build, count) else 1


def _bar(total: int, enabled: bool, desc: str):
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not enabled)


__all__ = ["observe_split", "split_reason", "CollectJob", "PARTS_PER_WORKER"]
