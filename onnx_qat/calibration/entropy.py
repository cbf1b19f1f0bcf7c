"""``entropy``: the threshold whose 8-bit quantization loses the least information (KL divergence).

The search follows the entropy calibration TensorRT describes (NVIDIA, "8-bit
Inference with TensorRT", GTC 2017): over a histogram of |x|, for every candidate
threshold ``i`` (in bins) from the start bin up to the number of bins,

* the reference distribution P is the first ``i`` bins, with all counts beyond the
  threshold added to the last one (clipping);
* the candidate Q merges those ``i`` bins into 128 quantization levels and spreads
  each level's count evenly over the bins of P that were non-empty;
* the threshold with the smallest KL(P || Q) wins (the largest such, when several tie).

Two guards keep the search where the KL divergence measures what it is meant to (both measured on
real models, see docs/sensitivity.md "Calibration methods on real models"; ``start_bin=128,
max_clipped=0`` gives the unguarded search of TensorRT's description):

* **the search starts at half the histogram** (bin 1024 of 2048: amax >= max |x| / 2), where TensorRT
  starts at bin 128. KL compares the *shape* of P and Q bin by bin: where a histogram has spikes
  (a constant background repeats one value per channel thousands of times, as text images do),
  every wide range spreads each spike over its level's bins and scores badly, so the divergence
  falls towards the narrowest candidates and clips a fifth of the values of such tensors;
* **at most** `MAX_CLIPPED` **of the values are clipped** (amax >= the 99.9th percentile of
  |x|). KL counts how many values are clipped, not how far: a separate cluster of large values
  (a gate that is fully open on a few positions) folds into P's last bin at a small divergence,
  although clipping it halves exactly the values that carry the signal. Rare outliers, the case
  the method is made for, stay clippable.

Before the search bin 0 takes bin 1's count (`zero_bin_suppressed`), as NVIDIA's reference
implementation of this calibrator does (pytorch-quantization, ``calib/histogram.py``): the spike of
exact zeros after a ReLU would otherwise drive the threshold far too low.

onnxruntime's ``EntropyCalibrater`` differs on purpose-neutral details, measured in
``tests/onnx_qat/test_entropy_vs_onnxruntime.py``: by default it builds a signed histogram of only
128 bins and searches windows of 128 quantized bins, so its only candidate is the whole range (its
"entropy" is then ``max``); with more bins it keeps the zero spike and smooths P and Q, so on ReLU
outputs it clips more than this calibrator, on symmetric tensors it lands within a few percent.
"""
from __future__ import annotations

import numpy as np

from .collector import HistogramCollector, coarse_to_fine_rows, row_blocks

#: Positive int8 levels a symmetric quantizer has for |x| (0..127).
NUM_QUANT_LEVELS = 128
#: Share of the histogram below the first candidate threshold (TensorRT's description: 128 / 2048).
START_SHARE = 0.5
#: Largest share of the values a threshold may clip (amax >= the 99.9th percentile of |x|).
MAX_CLIPPED = 1e-3


class EntropyCollector(HistogramCollector):
    """amax = the threshold minimising KL(P || Q) over the histogram (TensorRT's entropy calibrator),
    searched from half the range and clipping at most `MAX_CLIPPED` of the values."""

    method = "entropy"

    def __init__(self, num_bins: int = 2048, num_quant_levels: int = NUM_QUANT_LEVELS, *,
                 start_bin: "int | None" = None, max_clipped: float = MAX_CLIPPED):
        """``start_bin``: first candidate threshold in bins of the ``num_bins`` histogram (None:
        ``START_SHARE * num_bins``, never below ``num_quant_levels``); ``max_clipped``: largest share
        of the values the threshold may clip (0 turns the guard off)."""
        super().__init__(num_bins)
        self.levels = int(num_quant_levels)
        start = int(START_SHARE * self.num_bins) if start_bin is None else int(start_bin)
        self.start_bin = max(start, self.levels)
        self.max_clipped = float(max_clipped)

    def _threshold(self, counts: np.ndarray, width: float) -> float:
        return float(self.thresholds(counts[None, :])[0]) * width

    def thresholds(self, counts: np.ndarray) -> np.ndarray:
        """The threshold (in bins) of each row of ``counts`` ``[R, num_bins]`` (rows not all zero): the
        guarded KL search of many histograms at once."""
        counts = np.asarray(counts, dtype=np.float64)
        last = counts.shape[1] - np.argmax(counts[:, ::-1] > 0, axis=1)
        suppressed = zero_bin_suppressed(counts)
        start = np.full(last.shape, self.start_bin, dtype=np.intp)
        prefixes = kl_prefixes(suppressed)  # built once for both stages of the search
        best = coarse_to_fine_rows(lambda t: kl_rows(suppressed, t, self.levels, prefixes=prefixes),
                                   start, last)
        floor = clip_floor(counts, self.max_clipped)
        # no candidate below the whole range, or no finite divergence: the whole range
        return np.where((last <= self.start_bin) | (best < 0), last, np.maximum(best, floor))


def clip_floor(counts: np.ndarray, max_clipped: float):
    """The smallest threshold (in bins) beyond which at most ``max_clipped`` of the counts lie (per row
    of a 2-D ``counts``)."""
    counts = np.asarray(counts, dtype=np.float64)
    if max_clipped <= 0.0:
        return 0 if counts.ndim == 1 else np.zeros(counts.shape[0], dtype=np.intp)
    cumulative = np.cumsum(counts, axis=-1)
    if counts.ndim == 1:
        return int(np.searchsorted(cumulative, cumulative[-1] * (1.0 - max_clipped), side="left")) + 1
    target = cumulative[:, -1:] * (1.0 - max_clipped)
    return (cumulative < target).sum(axis=1) + 1


def zero_bin_suppressed(counts: np.ndarray) -> np.ndarray:
    """``counts`` (or each row of it) with bin 0 given bin 1's count.

    After a ReLU most values are exactly zero; left in, that spike dominates P, and every merge of
    bin 0 with its neighbours into one level of Q spreads it out, so the divergence favours
    thresholds so small that a level holds bin 0 almost alone: the range collapses and most of the
    real values clip. NVIDIA's reference entropy calibrator (pytorch-quantization's
    ``HistogramCalibrator``, the TensorRT calibration algorithm for PyTorch users) replaces bin 0
    by bin 1 for this reason; the zeros are exactly representable whatever the threshold.
    """
    out = np.array(counts, dtype=np.float64)
    if out.shape[-1] > 1:
        out[..., 0] = out[..., 1]
    return out


def kl_divergence_at(counts: np.ndarray, i: int, levels: int) -> float:
    """KL(P || Q) for the threshold at bin ``i`` (see the module docstring)."""
    p = counts[:i].copy()
    p[i - 1] += counts[i:].sum()
    nonzero = p > 0
    group = (np.arange(i) * levels) // i
    level_sum = np.bincount(group, weights=counts[:i], minlength=levels)
    level_nonzero = np.bincount(group, weights=nonzero.astype(np.float64), minlength=levels)
    per_bin = np.divide(level_sum, level_nonzero, out=np.zeros(levels), where=level_nonzero > 0)
    q = np.where(nonzero, per_bin[group], 0.0)
    p_sum, q_sum = p.sum(), q.sum()
    if p_sum <= 0 or q_sum <= 0:
        return np.inf
    p = p[nonzero] / p_sum
    q = q[nonzero] / q_sum
    if np.any(q <= 0):
        return np.inf
    return float(np.sum(p * np.log(p / q)))


def kl_divergences(counts: np.ndarray, start: int, stop: int, levels: int) -> np.ndarray:
    """KL(P || Q) of `kl_divergence_at` for every threshold ``start..stop`` at once.

    Per threshold ``i`` the sums reduce to ``levels`` terms read from prefix sums built once:
    ``KL = (sum p log p - sum_j p_j log q_j) / sum p - log sum p + log sum q``, where ``p_j`` is
    level ``j``'s share of P and ``q_j`` the value Q spreads over each of its non-empty bins. The
    same values as the per-threshold form up to float rounding (about 1e-11 relative), at a
    fraction of the cost (one array pass instead of a dozen NumPy calls per threshold).
    """
    return kl_at(counts, np.arange(start, stop + 1), levels)


def kl_at(counts: np.ndarray, thresholds: np.ndarray, levels: int) -> np.ndarray:
    """`kl_divergences` for the given thresholds (bins, each in ``levels..counts.size``)."""
    return kl_rows(np.asarray(counts, dtype=np.float64)[None, :], np.asarray(thresholds)[None, :], levels)[0]


def kl_rows(counts: np.ndarray, thresholds: np.ndarray, levels: int, *, prefixes=None) -> np.ndarray:
    """`kl_divergences` of many histograms at once: ``counts`` ``[R, n]``, ``thresholds``
    ``[R, K]`` (bins, each in ``levels..n``) -> ``[R, K]`` (``prefixes``: `kl_prefixes` of
    ``counts`` when already built).

    The prefix sums are read by flat indices (one gather per array for all rows of a block,
    `row_blocks`) and every elementwise step writes into its own result: the values of the
    straightforward form, bit for bit, at a fraction of its cost on thousands of histograms.
    """
    counts = np.asarray(counts, dtype=np.float64)
    thresholds = np.asarray(thresholds, dtype=np.intp)
    if prefixes is None:
        prefixes = kl_prefixes(counts)
    blocks = row_blocks(counts.shape[0], thresholds.shape[1] * (levels + 1))
    if len(blocks) == 1:
        return _kl_block(counts, thresholds, levels, prefixes)
    return np.concatenate([_kl_block(counts[b], thresholds[b], levels, [p[b] for p in prefixes])
                           for b in blocks])


def kl_prefixes(counts: np.ndarray):
    """The prefix sums `kl_rows` reads, each ``[R, n + 1]`` from 0: of the counts, of the non-empty
    bins and of ``count * log(count)``."""
    counts = np.asarray(counts, dtype=np.float64)
    zero = np.zeros((counts.shape[0], 1))
    return (np.concatenate([zero, np.cumsum(counts, axis=1)], axis=1),
            np.concatenate([zero, np.cumsum(counts > 0, axis=1, dtype=np.float64)], axis=1),
            np.concatenate([zero, np.cumsum(_xlogx(counts), axis=1)], axis=1))


def _kl_block(counts: np.ndarray, thresholds: np.ndarray, levels: int, prefixes) -> np.ndarray:
    rows, n = counts.shape
    prefix, prefix_nonzero, prefix_plogp = (np.ascontiguousarray(p).ravel() for p in prefixes)
    row_start = np.arange(rows, dtype=np.intp)[:, None] * (n + 1)  # each row's offset in the flat prefixes
    total = prefix[row_start + n]
    last = thresholds - 1
    tail = total - prefix[row_start + thresholds]
    at_last = counts.ravel()[row_start // (n + 1) * n + last]
    p_last = at_last + tail  # the last bin of P takes the clipped tail
    # ceil(j * i / levels), as flat indices into the prefixes
    edges = np.multiply(np.arange(levels + 1, dtype=np.intp)[None, None, :], thresholds[:, :, None])
    edges += levels - 1
    if levels & (levels - 1) == 0:  # a power of two (128): a shift
        edges >>= levels.bit_length() - 1
    else:
        edges //= levels
    edges += row_start[:, :, None]
    summed = prefix[edges]
    level_sum = np.subtract(summed[..., 1:], summed[..., :-1])
    del summed
    nonzero = prefix_nonzero[edges]
    del edges
    level_nonzero = np.subtract(nonzero[..., 1:], nonzero[..., :-1])
    del nonzero
    level_nonzero[..., -1] += (p_last > 0) & (at_last <= 0)
    used = level_nonzero > 0
    # a level with no non-empty bin sums to exactly 0: the sum over used levels is the sum over all
    q_sum = level_sum.sum(axis=2)
    # dividing by at least 1 leaves the used levels as they are and the others at their sum (0, or a
    # rounding below it): neither is positive, and only the positive ones are read below
    np.maximum(level_nonzero, 1.0, out=level_nonzero)
    per_bin = np.divide(level_sum, level_nonzero, out=level_nonzero)
    positive = per_bin > 0
    bad = (q_sum <= 0) | (used > positive).any(axis=2) | (total <= 0)
    del used
    per_bin[~positive] = 1.0  # log 1 = 0: these levels add nothing
    log_q = np.log(per_bin, out=per_bin)
    del positive
    level_sum[..., -1] += tail  # level_sum is P's levels from here on
    log_q *= level_sum
    p_log_p = prefix_plogp[row_start + last] + _xlogx(p_last)
    safe_total = np.where(total > 0, total, 1.0)
    kl = ((p_log_p - log_q.sum(axis=2)) / safe_total - np.log(safe_total)
          + np.log(np.where(q_sum > 0, q_sum, 1.0)))
    return np.where(bad, np.inf, kl)


def _xlogx(x: np.ndarray) -> np.ndarray:
    """``x * log(x)``, 0 where ``x <= 0``."""
    positive = x > 0
    return np.where(positive, x * np.log(np.where(positive, x, 1.0)), 0.0)
