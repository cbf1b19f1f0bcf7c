"""``max``: the largest magnitude seen (no clipping)."""
from __future__ import annotations

import numpy as np

from .collector import RangeCollector


class MaxCollector(RangeCollector):
    """amax = max |x| over all samples.

    Keeps every value representable; a single outlier widens the scale for all
    the others. The right choice for tensors without outliers (after ReLU6,
    normalised inputs) and the safest default.
    """

    method = "max"

    def __init__(self):
        self._max = 0.0

    def update(self, magnitudes: np.ndarray) -> None:
        values = np.asarray(magnitudes)
        if values.size:
            self._max = max(self._max, float(values.max()))

    def update_values(self, values: np.ndarray, peak: float, keep: bool = False) -> None:
        self._max = max(self._max, float(peak))

    def amax(self) -> float:
        return self._max

    def state_nbytes(self) -> int:
        return 8

    def merge(self, other: "MaxCollector") -> None:
        """The larger of the two maxima (exact)."""
        self._max = max(self._max, other._max)
