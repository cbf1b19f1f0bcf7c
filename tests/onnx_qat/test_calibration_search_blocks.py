"""The searches ``auto`` runs over many tensors at once (one re-binning for both histogram sizes, the
KL and mse searches in blocks of rows) give the numbers of one tensor at a time, bit for bit, on
varied histograms: seeds, skewed, heavy-tailed, spiky, a single value, tiny and huge scales, and
all-zero tensors beside them."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_qat.calibration import auto as auto_module
from onnx_qat.calibration.auto import AutoCollector, analyze
from onnx_qat.calibration.collector import AbsHistogram, final_rows
from onnx_qat.calibration.entropy import kl_divergence_at, kl_rows, zero_bin_suppressed
from onnx_qat.calibration.mse import edge_mse_rows, moment_prefixes


def _values(kind: str, rng: np.random.Generator, scale: float) -> np.ndarray:
    size = int(rng.integers(300, 6000))
    if kind == "normal":
        return rng.standard_normal(size) * scale
    if kind == "skewed":  # a ReLU output: most values zero, a long right tail
        return np.maximum(rng.standard_normal(size) * scale + 0.3 * scale, 0.0) ** 2
    if kind == "heavy":
        return rng.standard_t(1.5, size) * scale
    if kind == "spiky":  # a constant background repeated, a few real values
        values = np.full(size, 0.25 * scale)
        values[: size // 20] = rng.uniform(0, scale, size // 20)
        return values
    if kind == "single":
        return np.full(size, 0.7 * scale)
    if kind == "zero":
        return np.zeros(size)
    raise ValueError(kind)


KINDS = ("normal", "skewed", "heavy", "spiky", "single", "zero")


def _histograms(seed: int, scale: float, count: int = 24):
    rng = np.random.default_rng(seed)
    hists = []
    for i in range(count):
        hist = AbsHistogram(8192)
        kind = KINDS[i % len(KINDS)]
        for batch in range(int(rng.integers(1, 5))):  # ranges that grow over the batches
            values = _values(kind, rng, scale * (1 + batch))
            hist.update(np.abs(values).astype(np.float32 if i % 2 else np.float64))
        hists.append(hist)
    return hists


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 1e-3), (2, 37.5), (3, 1e-30), (4, 1e12)])
def test_rebinning_many_histograms_is_each_ones_rebinning(seed, scale):
    hists = [h for h in _histograms(seed, scale) if h.max_seen > 0]
    for bins in (8192, 2048):
        counts, widths = final_rows(hists, bins)
        for row, hist in enumerate(hists):
            own, width = hist.final(bins)
            np.testing.assert_array_equal(counts[row], own)
            assert widths[row] == width


def _kl_rows_straightforward(counts, thresholds, levels):
    """The KL search over many rows as it was written before the blocks: one array pass per step,
    floor divisions, masked divide and log (kept here as the reference the blocked form must match)."""
    from onnx_qat.calibration.entropy import _xlogx

    counts = np.asarray(counts, dtype=np.float64)
    thresholds = np.asarray(thresholds, dtype=np.intp)
    rows, n = counts.shape
    zero = np.zeros((rows, 1))
    prefix = np.concatenate([zero, np.cumsum(counts, axis=1)], axis=1).ravel()
    prefix_nonzero = np.concatenate([zero, np.cumsum(counts > 0, axis=1, dtype=np.float64)], axis=1).ravel()
    prefix_plogp = np.concatenate([zero, np.cumsum(_xlogx(counts), axis=1)], axis=1).ravel()
    row_start = np.arange(rows, dtype=np.intp)[:, None] * (n + 1)
    total = prefix[row_start + n]
    last = thresholds - 1
    tail = total - prefix[row_start + thresholds]
    at_last = counts.ravel()[row_start // (n + 1) * n + last]
    p_last = at_last + tail
    edges = -((-np.arange(levels + 1)[None, None, :] * thresholds[:, :, None]) // levels)
    edges += row_start[:, :, None]
    summed = prefix[edges]
    level_sum = summed[..., 1:] - summed[..., :-1]
    nonzero = prefix_nonzero[edges]
    level_nonzero = nonzero[..., 1:] - nonzero[..., :-1]
    level_nonzero[..., -1] += (p_last > 0) & (at_last <= 0)
    used = level_nonzero > 0
    q_sum = level_sum.sum(axis=2)
    per_bin = np.divide(level_sum, level_nonzero, out=np.zeros_like(level_sum), where=used)
    positive = per_bin > 0
    bad = (q_sum <= 0) | (used & ~positive).any(axis=2) | (total <= 0)
    log_q = np.log(per_bin, out=np.zeros_like(per_bin), where=positive)
    level_sum[..., -1] += tail
    log_q *= level_sum
    p_log_p = prefix_plogp[row_start + last] + _xlogx(p_last)
    safe_total = np.where(total > 0, total, 1.0)
    kl = ((p_log_p - log_q.sum(axis=2)) / safe_total - np.log(safe_total)
          + np.log(np.where(q_sum > 0, q_sum, 1.0)))
    return np.where(bad, np.inf, kl)


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (5, 1e-3), (6, 1e4)])
def test_blocked_kl_search_is_the_straightforward_one_bit_for_bit(seed, scale):
    hists = [h for h in _histograms(seed, scale, 30) if h.max_seen > 0]
    counts = zero_bin_suppressed(final_rows(hists, 2048)[0])
    rng = np.random.default_rng(seed)
    thresholds = np.sort(rng.integers(128, 2049, (counts.shape[0], 150)), axis=1)
    got = kl_rows(counts, thresholds, 128)
    np.testing.assert_array_equal(got, _kl_rows_straightforward(counts, thresholds, 128))
    for row in range(counts.shape[0]):  # one row alone: one block
        np.testing.assert_array_equal(got[row], kl_rows(counts[row:row + 1], thresholds[row:row + 1], 128)[0])
    # and the divergences are the per-threshold definition's, where finite
    for row in range(0, counts.shape[0], 5):
        for k in range(0, thresholds.shape[1], 37):
            expected = kl_divergence_at(counts[row], int(thresholds[row, k]), 128)
            if np.isfinite(expected):
                assert got[row, k] == pytest.approx(expected, rel=1e-9, abs=1e-12)
            else:
                assert not np.isfinite(got[row, k])


def test_kl_search_with_levels_not_a_power_of_two():
    hists = [h for h in _histograms(7, 1.0, 12) if h.max_seen > 0]
    counts = zero_bin_suppressed(final_rows(hists, 2048)[0])
    thresholds = np.tile(np.arange(100, 2049, 29), (counts.shape[0], 1))
    np.testing.assert_array_equal(kl_rows(counts, thresholds, 100),
                                  _kl_rows_straightforward(counts, thresholds, 100))


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (8, 1e-2)])
def test_blocked_mse_scores_are_one_row_at_a_time(seed, scale):
    hists = [h for h in _histograms(seed, scale, 30) if h.max_seen > 0]
    counts = final_rows(hists, 2048)[0]
    rng = np.random.default_rng(seed)
    edges = rng.uniform(1, 2048, (counts.shape[0], 70))
    got = edge_mse_rows(counts, edges)
    np.testing.assert_array_equal(got, edge_mse_rows(counts, edges, prefix=moment_prefixes(counts)))
    for row in range(counts.shape[0]):
        np.testing.assert_array_equal(got[row], edge_mse_rows(counts[row:row + 1], edges[row:row + 1])[0])


def _collectors(hists):
    collectors = []
    for hist in hists:
        collector = AutoCollector(2048)
        collector.hist = hist
        collectors.append(collector)
    return collectors


def _analysis(collectors):
    return [(c.amax(), c.choice, c.entropy_amax(), sorted(c.errors.items())) for c in collectors]


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (9, 1e-4), (10, 250.0)])
def test_analysis_of_many_tensors_is_each_tensor_alone(seed, scale, monkeypatch):
    monkeypatch.setattr(auto_module, "ANALYSIS_THREADS", 1)
    hists = _histograms(seed, scale, 40)
    together = _collectors(hists)
    analyze(together)
    alone = _collectors(hists)
    for collector in alone:
        analyze([collector])
    assert _analysis(together) == _analysis(alone)
    assert {c.choice for c in together if c.hist.max_seen > 0} <= {"max", "mse", "percentile(99.9)",
                                                                    "percentile(99.99)", "percentile(99.999)"}
    assert all(c.amax() == 0.0 for c in together if c.hist.max_seen <= 0)
