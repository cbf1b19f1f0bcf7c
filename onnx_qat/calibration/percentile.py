"""``percentile``: the given percentile of |x| (clips the rarest outliers)."""
from __future__ import annotations

import numpy as np

from .collector import HistogramCollector


class PercentileCollector(HistogramCollector):
    """amax = the ``percentile``-th percentile of |x|, read from the running histogram.

    The value is linearly interpolated inside the bin where the cumulative count
    reaches the percentile, so the error is about one bin width (max |x| / num_bins).
    ``percentile=100`` gives the maximum.
    """

    method = "percentile"

    def __init__(self, percentile: float = 99.99, num_bins: int = 2048):
        super().__init__(num_bins)
        self.percentile = float(percentile)

    def _threshold(self, counts: np.ndarray, width: float) -> float:
        if self.percentile >= 100.0:
            return self.hist.max_seen
        return float(percentile_rows(counts[None, :], np.array([width]), self.percentile)[0])

    def describe(self) -> str:
        return f"percentile({self.percentile:g})"


def percentile_rows(counts: np.ndarray, widths: np.ndarray, percentile: float, *,
                    cumulative=None) -> np.ndarray:
    """The ``percentile``-th percentile (below 100) of each row of ``counts`` ``[R, n]`` (bins of width
    ``widths[r]`` from 0), linearly interpolated inside the bin where the cumulative count reaches it
    (``cumulative``: ``np.cumsum(counts, axis=1)`` when already computed, e.g. the first of
    `onnx_qat.calibration.mse.moment_prefixes` less its leading 0)."""
    counts = np.asarray(counts)
    if cumulative is None:
        cumulative = np.cumsum(counts, axis=1)
    target = cumulative[:, -1] * percentile / 100.0
    index = np.minimum((cumulative < target[:, None]).sum(axis=1), counts.shape[1] - 1)  # searchsorted, left
    rows = np.arange(counts.shape[0])
    below = np.where(index > 0, cumulative[rows, index - 1], 0.0)
    at = counts[rows, index]
    inside = np.divide(target - below, at, out=np.ones_like(target, dtype=np.float64), where=at != 0)
    return (index + inside) * widths
