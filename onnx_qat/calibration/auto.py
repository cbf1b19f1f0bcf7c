"""``auto``: per tensor, the candidate range (max, percentiles, mse) with the least quantization error.

[`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate] then judges two whole tables by the model's
output (`choice`): this per-tensor choice and ``max`` everywhere, both read from the same histograms.
The ``entropy`` range of each tensor (the KL search) is computed only when asked for
(`analyze`'s ``entropy``, `AutoCollector.entropy_amax`): the search over each tensor's range
(``--optimize accuracy``, ``--min-cosine``) offers it as a candidate.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from .collector import HistogramCollector, final_rows
from .entropy import EntropyCollector
from .mse import edge_mse_rows, moment_prefixes, mse_thresholds
from .percentile import percentile_rows

#: Percentiles of |x| tried as candidates.
PERCENTILES = (99.9, 99.99, 99.999)
#: ``max`` is kept unless a clipping candidate lowers the error by more than this share: clipping
#: costs what the tensor's own error does not show (rare large values may carry the signal).
MAX_PREFERENCE = 0.02


class AutoCollector(HistogramCollector):
    """amax = the candidate with the least expected squared INT8 error on this tensor's histogram of |x|.

    Candidates: ``max`` (max |x|), ``percentile(P)`` for P in `PERCENTILES`, and ``mse``
    (the error-minimising bin edge of the ``num_bins`` histogram). Each is scored on that same
    ``num_bins`` histogram over [0, max |x|] (the running histogram re-binned) with the error model
    of ``mse`` (values rounded to the INT8 grid, values beyond the range clipped to it). ``max`` wins
    unless the best candidate's error is lower by more than `MAX_PREFERENCE`; otherwise the
    lowest error wins (ties go to the wider range). After `amax`, `choice` names the
    winner and `errors` holds every candidate's (amax, error).
    """

    method = "auto"

    def __init__(self, num_bins: int = 2048):
        super().__init__(num_bins)
        self.choice = ""
        self.errors: Dict[str, Tuple[float, float]] = {}
        # every candidate is read from this collector's one histogram (one pass over the data for all)
        self._analysis = None  # (amax, choice, errors, entropy amax or None) from analyze()

    def update(self, magnitudes: np.ndarray) -> None:
        self._analysis = None
        super().update(magnitudes)

    def update_values(self, values: np.ndarray, peak: float, keep: bool = False) -> None:
        self._analysis = None
        self.hist.update(values, peak=peak, signed=True, keep=keep)

    def merge(self, other: "AutoCollector") -> None:
        """Merge ``other``'s histogram (exact); the candidates are searched again."""
        self._analysis = None
        super().merge(other)

    def candidates(self) -> Dict[str, float]:
        """``{candidate name: amax}`` from what was seen so far (empty when everything was zero)."""
        if self.hist.max_seen <= 0.0:
            return {}
        analyze([self])
        return {name: amax for name, (amax, _) in self.errors.items()}

    def max_amax(self) -> float:
        """The ``max`` range (max |x|) from the same histogram."""
        return float(self.hist.max_seen)

    def entropy_amax(self) -> float:
        """The ``entropy`` range (the guarded KL search of `entropy`) from the same histogram (searched
        now unless `analyze` searched it with ``entropy=True``)."""
        if self.hist.max_seen <= 0.0:
            return 0.0
        if self._analysis is None or self._analysis[3] is None:
            analyze([self], entropy=True)
        return self._analysis[3]

    def _threshold(self, counts: np.ndarray, width: float) -> float:  # pragma: no cover - amax overrides
        raise NotImplementedError

    def amax(self) -> float:
        if self.hist.max_seen <= 0.0:
            self.choice, self.errors = "max", {}
            return 0.0
        if self._analysis is None:
            analyze([self])
        return self._analysis[0]


#: Histograms searched together by `analyze` (bounds its temporary memory to a few tens of MB).
ANALYSIS_ROWS = 32


#: Threads `analyze` searches groups of histograms on at most (NumPy releases the interpreter lock in
#: its array work, so the groups run side by side on as many cores).
ANALYSIS_THREADS = 4


def analyze(collectors, *, entropy: bool = False) -> None:
    """Compute the candidates, their errors, the choice and, with ``entropy``, the ``entropy`` range of
    many `AutoCollector` at once (each then answers `amax`,
    `choice`, `errors` and
    `entropy_amax` from it): the searches of `mse` and `entropy` run
    on `ANALYSIS_ROWS` histograms per NumPy call, which costs a few times less than one call
    per tensor on graphs of thousands of tensors, and the groups run on up to `ANALYSIS_THREADS`
    threads (one per core). The same numbers as one collector alone, whatever the threads."""
    import functools

    live = [c for c in collectors if c.hist.max_seen > 0.0]
    groups = [live[start:start + ANALYSIS_ROWS] for start in range(0, len(live), ANALYSIS_ROWS)]
    threads = min(ANALYSIS_THREADS, len(groups), _cores())
    search = functools.partial(_analyze_rows, entropy=entropy)
    if threads <= 1:
        for group in groups:
            search(group)
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(threads, thread_name_prefix="onnx-qat-analyze")
    try:
        for _ in pool.map(search, groups):
            pass
    finally:  # on an interrupt, the groups not started yet are dropped
        pool.shutdown(wait=True, cancel_futures=True)


def _cores() -> int:
    """CPU cores this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _analyze_rows(group, entropy: bool = False) -> None:
    first = group[0]
    hists = [c.hist for c in group]
    # the running histogram re-binned onto num_bins bins: the candidates are searched and scored on it
    counts, widths = final_rows(hists, first.num_bins)
    prefix = moment_prefixes(counts)
    peaks = np.array([c.hist.max_seen for c in group])
    found = {"max": peaks}
    cumulative = prefix[0][:, 1:]  # np.cumsum(counts, axis=1) bit for bit (the sums of counts * 1.0)
    for percentile in PERCENTILES:  # named as PercentileCollector describes itself
        found[f"percentile({percentile:g})"] = percentile_rows(counts, widths, percentile,
                                                               cumulative=cumulative) \
            if percentile < 100.0 else peaks
    found["mse"] = mse_thresholds(counts, prefix=prefix) * widths
    for name in found:
        if name != "max":
            found[name] = np.minimum(np.maximum(found[name], widths), peaks)
    names = list(found)
    candidates = np.stack([found[n] for n in names], axis=1)  # [R, candidates]
    # quantization_mse of the bin centers, level by level (the thresholds in bins)
    errors = edge_mse_rows(counts, candidates / widths[:, None], prefix=prefix) * widths[:, None] ** 2
    entropy_amax = None
    if entropy:
        found_kl = EntropyCollector(first.num_bins).thresholds(counts) * widths
        entropy_amax = np.minimum(np.maximum(found_kl, widths), peaks)
    for r, collector in enumerate(group):
        table = {n: (float(candidates[r, k]), float(errors[r, k])) for k, n in enumerate(names)}
        best = min(names, key=lambda n: (table[n][1], -table[n][0]))
        if table["max"][1] <= (1.0 + MAX_PREFERENCE) * table[best][1]:
            best = "max"
        collector.choice, collector.errors = best, table
        collector._analysis = (table[best][0], best, table,
                               None if entropy_amax is None else float(entropy_amax[r]))
