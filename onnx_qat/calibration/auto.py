"""``auto``: per tensor, the candidate range (max, percentiles, mse) with the least quantization error.

[`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate] then judges whole tables by the model's output
(`output_check`): this per-tensor choice, ``max`` everywhere and ``entropy`` everywhere, all
read from the same histograms.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from .collector import HistogramCollector
from .entropy import EntropyCollector
from .mse import MseCollector, quantization_mse
from .percentile import PercentileCollector

#: Percentiles of |x| tried as candidates.
PERCENTILES = (99.9, 99.99, 99.999)
#: ``max`` is kept unless a clipping candidate lowers the error by more than this share: clipping
#: costs what the tensor's own error does not show (rare large values may carry the signal).
MAX_PREFERENCE = 0.02


class AutoCollector(HistogramCollector):
    """amax = the candidate with the least expected squared INT8 error on this tensor's histogram of |x|.

    Candidates: ``max`` (max |x|), ``percentile(P)`` for P in `PERCENTILES`, and ``mse``
    (the error-minimising bin edge of the ``num_bins`` histogram). Each is scored on the finer
    running histogram (``RESOLUTION * num_bins`` bins over [0, max |x|]) with the same error model
    as ``mse`` (values rounded to the INT8 grid, values beyond the range clipped to it). ``max`` wins
    unless the best candidate's error is lower by more than `MAX_PREFERENCE`; otherwise the
    lowest error wins (ties go to the wider range). After `amax`, `choice` names the
    winner and `errors` holds every candidate's (amax, error).
    """

    method = "auto"

    def __init__(self, num_bins: int = 2048):
        super().__init__(num_bins)
        self.choice = ""
        self.errors: Dict[str, Tuple[float, float]] = {}
        # the candidate methods read this collector's histogram (one pass over the data for all)
        self._methods = [PercentileCollector(p, self.num_bins) for p in PERCENTILES]
        self._methods.append(MseCollector(self.num_bins))
        for method in self._methods:
            method.hist = self.hist

    def candidates(self) -> Dict[str, float]:
        """``{candidate name: amax}`` from what was seen so far (empty when everything was zero)."""
        if self.hist.max_seen <= 0.0:
            return {}
        found = {"max": self.hist.max_seen}
        counts, width = self.hist.final(self.num_bins)
        for method in self._methods:
            found[method.describe()] = min(max(float(method._threshold(counts, width)), width),
                                           self.hist.max_seen)
        return found

    def max_amax(self) -> float:
        """The ``max`` range (max |x|) from the same histogram."""
        return float(self.hist.max_seen)

    def entropy_amax(self) -> float:
        """The ``entropy`` range (the guarded KL search of `entropy`) from the same histogram."""
        entropy = EntropyCollector(self.num_bins)
        entropy.hist = self.hist
        return float(entropy.amax())

    def _threshold(self, counts: np.ndarray, width: float) -> float:  # pragma: no cover - amax overrides
        raise NotImplementedError

    def amax(self) -> float:
        found = self.candidates()
        if not found:
            self.choice, self.errors = "max", {}
            return 0.0
        fine, fine_width = self.hist.final(self.num_bins * self.RESOLUTION)
        centers = (np.arange(fine.size, dtype=np.float64) + 0.5) * fine_width
        names = list(found)
        errors = quantization_mse(centers, fine, np.array([found[n] for n in names]))
        self.errors = {n: (float(found[n]), float(e)) for n, e in zip(names, errors)}
        best = min(names, key=lambda n: (self.errors[n][1], -found[n]))
        if self.errors["max"][1] <= (1.0 + MAX_PREFERENCE) * self.errors[best][1]:
            best = "max"
        self.choice = best
        return float(found[best])

