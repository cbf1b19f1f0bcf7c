"""``mse``: the threshold minimising the expected squared quantization error."""
from __future__ import annotations

import numpy as np

from .collector import HistogramCollector

#: Candidate thresholds evaluated together (bounds the temporary memory).
_CHUNK = 128


class MseCollector(HistogramCollector):
    """amax = argmin over thresholds T of E[(x - fake_quant(x; T))^2] over the histogram of |x|.

    Each bin is represented by its center c with its count; with scale s = T / 127,
    values inside the range are rounded to a multiple of s (error (c - round(c/s) s)^2)
    and values beyond T are clipped to T (error (c - T)^2). Every bin edge from
    bin 1 up to the last non-empty bin is a candidate.
    """

    method = "mse"

    def __init__(self, num_bins: int = 2048):
        super().__init__(num_bins)

    def _threshold(self, counts: np.ndarray, width: float) -> float:
        last = int(np.flatnonzero(counts)[-1]) + 1
        counts = counts[:last]
        centers = (np.arange(last, dtype=np.float64) + 0.5) * width
        candidates = np.arange(1, last + 1, dtype=np.float64) * width
        errors = np.concatenate([
            quantization_mse(centers, counts, candidates[start:start + _CHUNK])
            for start in range(0, candidates.size, _CHUNK)
        ])
        return float(candidates[int(np.argmin(errors))])


def quantization_mse(centers: np.ndarray, counts: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Expected squared error of symmetric int8 fake quantization for each threshold.

    Errors are computed in quantization steps (one scratch matrix, updated in place) and
    weighted by the counts with one matrix-vector product.
    """
    scale = np.asarray(thresholds, dtype=np.float64) / 127.0
    steps = np.asarray(centers, dtype=np.float64)[None, :] / scale[:, None]
    error = np.round(steps)
    np.minimum(error, 127.0, out=error)  # beyond the threshold: clipped to it
    np.subtract(steps, error, out=error)
    np.square(error, out=error)
    counts = np.asarray(counts, dtype=np.float64)
    return (error @ counts) * scale ** 2 / max(float(counts.sum()), 1.0)
