"""Calibration collectors against NumPy references on known distributions."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from onnx_qat.calibration import (
    AbsHistogram, EntropyCollector, MaxCollector, MseCollector, PercentileCollector, TensorObserver,
    make_collector,
)
from onnx_qat.calibration.entropy import kl_divergence_at
from onnx_qat.calibration.mse import quantization_mse
from onnx_qat.calibration.runner import MASK_MAGNITUDE, ZERO_TENSOR_AMAX
from onnx_qat.errors import ConfigError, DataError


def _feed(collector, values: np.ndarray, batch: int):
    for start in range(0, values.size, batch):
        collector.update(np.abs(values[start:start + batch]))
    return collector


def _heavy_tailed(n=100_000, seed=0) -> np.ndarray:
    """Mostly N(0, 1) with 0.1 % large outliers up to 60."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    idx = rng.choice(n, n // 1000, replace=False)
    x[idx] = rng.uniform(10, 60, idx.size) * rng.choice([-1, 1], idx.size)
    return x.astype(np.float32)


# --------------------------------------------------------------------------- max
@pytest.mark.parametrize("batch", [1, 7, 1000, 100_000])
def test_max_is_true_max(batch):
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32) * 3
    assert _feed(MaxCollector(), x, batch).amax() == pytest.approx(float(np.abs(x).max()), rel=0, abs=0)


# --------------------------------------------------------------------------- histogram
def test_histogram_growth_matches_one_pass():
    rng = np.random.default_rng(2)
    parts = [rng.uniform(0, 1, 1000), rng.uniform(0, 3.5, 1000), np.zeros(10), rng.uniform(0, 70, 1000)]
    grown = AbsHistogram(256)
    for part in parts:
        grown.update(part)
    assert grown.top == 128.0  # the smallest power of two at or above max |x| (69.9...)
    direct = AbsHistogram(256)
    direct.update(np.concatenate(parts))
    assert grown.total == direct.total == 3010
    np.testing.assert_array_equal(grown.counts, direct.counts)  # power-of-two edges: exact
    assert grown.max_seen == pytest.approx(float(parts[-1].max()))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_histograms_of_parts_merge_into_the_histogram_of_all(seed, parts):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(30_000) * rng.uniform(0.01, 20.0, 30_000)).astype(np.float32)
    x[rng.choice(x.size, 100, replace=False)] = 0.0
    whole = AbsHistogram(2048)
    whole.update(x, peak=float(np.abs(x).max()), signed=True)
    pieces = [AbsHistogram(2048) for _ in range(parts)]
    for k, piece in enumerate(pieces):  # each part in batches of its own size, some smaller than a bin row
        for batch in np.array_split(x[k::parts], 1 + 7 * k):
            piece.update(np.abs(batch))
    merged = pieces[0]
    for piece in pieces[1:]:
        merged.merge(piece)
    assert merged.top == whole.top and merged.max_seen == whole.max_seen
    np.testing.assert_array_equal(merged.counts, whole.counts)
    counts, width = merged.final(2048)
    np.testing.assert_array_equal(counts, whole.final(2048)[0])


@pytest.mark.parametrize("seed", [0, 3])
def test_histograms_pickled_small_merge_exactly(seed):
    """Workers send their histograms back pickled: a part's few values (unbinned, or in few bins) make a
    small message, and histograms that went through pickle merge into the one-pass histogram exactly,
    whichever of them held counts, unbinned values or only zeros."""
    import pickle

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(40_000) * rng.uniform(0.001, 50.0, 40_000)).astype(np.float32)
    whole = AbsHistogram(8192)
    whole.update(x, peak=float(np.abs(x).max()), signed=True)
    parts = [x[:16], x[16:5000], x[5000:5200], x[5200:]]  # unbinned only, binned, unbinned, binned
    pieces = []
    for part in parts:
        piece = AbsHistogram(8192)
        for batch in np.array_split(part, 1 + part.size // 3000):
            piece.update(batch, peak=float(np.abs(batch).max()), signed=True)
        pieces.append(pickle.loads(pickle.dumps(piece)))
    zeros = AbsHistogram(8192)
    zeros.update(np.zeros(30))
    pieces.append(pickle.loads(pickle.dumps(zeros)))
    assert len(pickle.dumps(AbsHistogram(8192))) < 1024  # nothing binned: no 64 KiB of zero counts
    assert len(pickle.dumps(pieces[0])) < 1024
    merged = AbsHistogram(8192)
    for piece in pieces:
        kept = [np.array(piece.counts), piece.top, piece.max_seen]
        merged.merge(piece)
        np.testing.assert_array_equal(piece.counts, kept[0])  # the merged-in histogram is not changed
        assert (piece.top, piece.max_seen) == (kept[1], kept[2])
    assert merged.top == whole.top and merged.max_seen == whole.max_seen
    np.testing.assert_array_equal(merged.counts, whole.counts + np.eye(1, 8192, 0, dtype=np.int64)[0] * 30)
    assert merged.total == whole.total + 30


def test_fresh_histograms_share_no_written_counts():
    """A histogram allocates its counts when it bins its first value: the shared empty counts of the
    others stay zero."""
    first, second = AbsHistogram(256), AbsHistogram(256)
    first.update(np.zeros(5))
    first.update(np.full(300, 2.0))
    assert first.counts.sum() == 305 and second.counts.sum() == 0 and second.total == 0
    second.merge(first)
    np.testing.assert_array_equal(second.counts, first.counts)
    assert AbsHistogram(256).counts.sum() == 0


@pytest.mark.parametrize("method", ["auto", "percentile", "entropy", "mse"])
def test_observer_holding_small_batches_gives_the_same_numbers(method, caplog):
    """In front of a histogram, small batches are held and reduced together: the range, bounds, counts
    of values left out and the candidates are those of reducing every batch at once, with a
    non-finite batch, a zero batch, integer and float64 batches among them, and across a merge."""
    rng = np.random.default_rng(11)
    batches = [(rng.standard_normal((1, 16, 4, 4)) * rng.uniform(0.1, 30.0)).astype(np.float32)
               for _ in range(70)]
    batches[5] = batches[5].copy()
    batches[5][0, 0, 0, :2] = [np.nan, -np.inf]
    batches[9] = np.zeros((1, 16, 4, 4), np.float32)
    batches[12] = batches[12].copy()
    batches[12][0, 1, 1, 1] = -3.4e38
    batches.append(rng.integers(-40, 40, (3, 5)).astype(np.int64))
    batches.append(rng.standard_normal((2, 7)) * 1e3)
    held, each = TensorObserver("t", make_collector(method)), TensorObserver("t", make_collector(method))
    each._limit = 0  # every batch reduced as it comes
    first, second = TensorObserver("t", make_collector(method)), TensorObserver("t", make_collector(method))
    for k, batch in enumerate(batches):
        held.update(batch)
        each.update(batch)
        (first if k < 40 else second).update(batch)
    first.merge(second)
    with caplog.at_level(logging.WARNING):
        results = [(o.result(), o.bounds(), o.ignored, o.seen) for o in (held, each, first)]
    assert results[0] == results[1] == results[2]
    assert results[0][2] == 3 and results[0][3] == sum(b.size for b in batches)
    hists = [o.collector.hist for o in (held, each, first)]
    for hist in hists[1:]:
        np.testing.assert_array_equal(hist.counts, hists[0].counts)
        assert hist.top == hists[0].top and hist.max_seen == hists[0].max_seen
    if method == "auto":
        assert held.collector.errors == each.collector.errors
        assert held.collector.choice == each.collector.choice


def test_histogram_zeros_before_first_value_kept():
    hist = AbsHistogram(256)
    hist.update(np.zeros(50))
    assert hist.top == 0.0 and hist.total == 50
    hist.update(np.array([1.0, 0.5]))
    assert hist.counts[0] == 50 and hist.total == 52


def test_collector_state_does_not_grow_with_samples():
    rng = np.random.default_rng(3)
    for method in ("max", "percentile", "entropy", "mse"):
        collector = make_collector(method)
        collector.update(np.abs(rng.standard_normal(100)))
        size = collector.state_nbytes()
        for _ in range(200):
            collector.update(np.abs(rng.standard_normal(1000) * rng.uniform(0.5, 4)))
        assert collector.state_nbytes() == size, method
        assert size <= 2 * 4 * 2048 * 8 + 64  # the counts and at most one row of buffered values


# --------------------------------------------------------------------------- percentile
@pytest.mark.parametrize("pct", [90.0, 99.0, 99.9, 99.99])
@pytest.mark.parametrize("batch", [500, 100_000])
def test_percentile_close_to_numpy(pct, batch):
    x = _heavy_tailed()
    collector = _feed(PercentileCollector(pct), x, batch)
    expected = float(np.percentile(np.abs(x), pct))
    tolerance = 2 * float(np.abs(x).max()) / collector.num_bins
    assert abs(collector.amax() - expected) <= tolerance, (collector.amax(), expected)


def test_percentile_100_is_max():
    x = _heavy_tailed()
    assert _feed(PercentileCollector(100.0), x, 1000).amax() == pytest.approx(float(np.abs(x).max()))


# --------------------------------------------------------------------------- entropy
def _kl_reference(counts: np.ndarray, i: int, levels: int) -> float:
    """Plain-loop version of the TensorRT entropy step, for checking the vectorised one."""
    p = [float(v) for v in counts[:i]]
    p[i - 1] += float(counts[i:].sum())
    q = [0.0] * i
    for level in range(levels):
        members = [j for j in range(i) if (j * levels) // i == level]
        total = sum(float(counts[j]) for j in members)
        nonzero = [j for j in members if p[j] > 0]
        for j in nonzero:
            q[j] = total / len(nonzero)
    if any(pj > 0 and qj == 0 for pj, qj in zip(p, q)):
        return np.inf
    ps, qs = sum(p), sum(q)
    return sum((pj / ps) * np.log((pj / ps) / (qj / qs)) for pj, qj in zip(p, q) if pj > 0)


def test_kl_step_matches_loop_reference():
    rng = np.random.default_rng(4)
    counts = rng.poisson(5, 400).astype(np.float64)
    counts[rng.choice(400, 60, replace=False)] = 0
    for i in (128, 129, 200, 333, 400):
        expected = _kl_reference(counts, i, 128)
        got = kl_divergence_at(counts, i, 128)
        assert got == expected if np.isinf(expected) else got == pytest.approx(expected, rel=1e-9)


def test_entropy_clips_heavy_tail_and_is_stable_across_batches():
    x = _heavy_tailed()
    true_max = float(np.abs(x).max())
    results = [_feed(EntropyCollector(), x, batch).amax() for batch in (100_000, 3000, 257)]
    for amax in results:  # the search starts at half the range: the outliers beyond it are clipped
        assert 0.5 * true_max <= amax < 0.53 * true_max
    assert max(results) / min(results) < 1.02
    unguarded = [_feed(EntropyCollector(start_bin=128, max_clipped=0), x, batch).amax()
                 for batch in (100_000, 3000, 257)]
    for amax in unguarded:  # TensorRT's start at bin 128 clips the 0.1 % of outliers down to the body
        assert 3.0 < amax < 0.5 * true_max
    assert max(unguarded) / min(unguarded) < 1.1


def test_entropy_keeps_range_of_uniform_data():
    x = np.random.default_rng(5).uniform(-1, 1, 200_000).astype(np.float32)
    assert _feed(EntropyCollector(), x, 10_000).amax() > 0.9


# --------------------------------------------------------------------------- mse
def _fake_quant_mse(values: np.ndarray, threshold: float) -> float:
    scale = threshold / 127
    q = np.clip(np.round(values / scale), -127, 127) * scale
    return float(np.mean((values - q) ** 2))


def test_mse_threshold_near_numpy_optimum_and_below_max():
    x = _heavy_tailed().astype(np.float64)
    collector = _feed(MseCollector(), x, 5000)
    chosen = collector.amax()
    grid = np.linspace(1.0, float(np.abs(x).max()), 400)
    best = min(_fake_quant_mse(x, t) for t in grid)
    assert chosen < float(np.abs(x).max())
    assert _fake_quant_mse(x, chosen) <= best * 1.05


def test_mse_stable_across_batch_sizes():
    x = _heavy_tailed()
    results = [_feed(MseCollector(), x, batch).amax() for batch in (100_000, 3000, 257)]
    assert max(results) / min(results) < 1.15


def test_quantization_mse_formula():
    centers = np.array([0.5, 1.0, 3.0])
    counts = np.array([1.0, 1.0, 2.0])
    t = np.array([2.0])
    s = 2.0 / 127
    rounding = (0.5 - np.round(0.5 / s) * s) ** 2 + (1.0 - np.round(1.0 / s) * s) ** 2
    expected = (rounding + 2 * (3.0 - 2.0) ** 2) / 4
    assert quantization_mse(centers, counts, t)[0] == pytest.approx(expected)


# --------------------------------------------------------------------------- non-finite guard
@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse"])
def test_observer_ignores_nonfinite_and_warns(method, caplog):
    rng = np.random.default_rng(6)
    clean = rng.standard_normal(10_000).astype(np.float32)
    dirty = clean.copy()
    dirty[:100] = -np.inf
    dirty[100:150] = np.nan
    dirty[150:200] = -3.4e38  # a masking constant
    observer = TensorObserver("scores", make_collector(method))
    reference = make_collector(method)
    with caplog.at_level(logging.WARNING, logger="onnx_qat.calibration.runner"):
        observer.update(dirty)
        amax = observer.result()
    reference.update(np.abs(clean[200:]))
    assert np.isfinite(amax) and amax == pytest.approx(reference.amax())
    assert any("'scores'" in r.getMessage() and "200 of 10000" in r.getMessage() for r in caplog.records)


def test_observer_all_nonfinite_is_data_error():
    observer = TensorObserver("mask_out", MaxCollector())
    observer.update(np.array([np.inf, -np.inf, np.nan, MASK_MAGNITUDE], np.float32))
    with pytest.raises(DataError, match="'mask_out'"):
        observer.result()


def test_observer_all_zero_gets_small_positive_amax(caplog):
    observer = TensorObserver("zeros", EntropyCollector())
    observer.update(np.zeros((4, 8), np.float32))
    with caplog.at_level(logging.WARNING):
        assert observer.result() == ZERO_TENSOR_AMAX > 0
    assert any("'zeros'" in r.getMessage() for r in caplog.records)


def test_unknown_method():
    with pytest.raises(ConfigError, match="unknown calibration method"):
        make_collector("median")


@pytest.mark.parametrize("method", ["percentile", "entropy", "mse"])
def test_extreme_magnitudes_stay_finite(method):
    collector = make_collector(method)
    collector.update(np.array([0.0, 1e-310, 5e-311]))  # denormal range first
    collector.update(np.abs(np.random.default_rng(7).standard_normal(1000)) * 1e6)
    amax = collector.amax()
    assert np.isfinite(amax) and 0 < amax <= collector.hist.max_seen


@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse"])
def test_observer_signed_batches_match_collector_on_magnitudes(method):
    """The runner's path (signed values, peak from min/max) gives the range of the plain |x| path."""
    rng = np.random.default_rng(8)
    batches = [(rng.standard_normal((4, 16, 5, 5)) * scale).astype(np.float32) for scale in (0.5, 3.0, 1.0)]
    batches.append(rng.integers(-20, 20, (4, 7)).astype(np.int64))  # integer tensors go through float32
    observer = TensorObserver("t", make_collector(method))
    reference = make_collector(method)
    for batch in batches:
        observer.update(batch)
        reference.update(np.abs(batch.astype(np.float64)))
    assert observer.ignored == 0 and observer.seen == sum(b.size for b in batches)
    assert observer.result() == pytest.approx(reference.amax(), rel=2e-3)
    if method == "max":
        assert observer.result() == float(max(np.abs(b).max() for b in batches))


def test_float32_and_float64_bins_agree():
    values = np.abs(np.random.default_rng(9).standard_normal(50_000)).astype(np.float32)
    single, double = AbsHistogram(1024), AbsHistogram(1024)
    single.update(values)
    double.update(values.astype(np.float64))
    assert single.total == double.total == values.size
    np.testing.assert_array_equal(single.counts, double.counts)  # power-of-two bin scale: exact in both
    tiny = AbsHistogram(1024)
    tiny.update(np.array([0.0, 1e-40, 3e-41], np.float32))  # a top whose float32 bin scale overflows
    assert tiny.total == 3 and tiny.counts[512:].sum() == 1 and tiny.counts[0] == 1  # max in the upper half


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 7.5, 1e30])
def test_final_rows_are_np_interp_row_by_row(scale):
    """The vectorised re-binning gives np.interp's numbers bit for bit, and the percentile of many
    rows the one-row search's."""
    from onnx_qat.calibration.collector import final_rows
    from onnx_qat.calibration.percentile import percentile_rows

    rng = np.random.default_rng(int(np.log10(scale) + 40))
    hists = []
    for i in range(12):
        hist = AbsHistogram(8192)
        for b in range(4):
            values = np.abs(rng.standard_t(3, 3000) * scale * (1 + i) * (b + 1))
            values[: 100 * (i % 3)] = 0.0
            hist.update(values.astype(np.float32 if i % 2 else np.float64))
        hists.append(hist)
    for num_bins in (2048, 8192):
        counts, widths = final_rows(hists, num_bins)
        for row, hist in enumerate(hists):
            fine = np.concatenate([[0.0], np.cumsum(hist.counts, dtype=np.float64)]) + \
                np.r_[0.0, np.full(hist.num_bins, float(hist._pending_zeros))]
            edges = np.linspace(0.0, hist.max_seen, num_bins + 1)
            at = np.interp(edges, np.linspace(0.0, hist.top, 8193), fine)
            at[-1] = fine[-1]
            np.testing.assert_array_equal(counts[row], np.diff(at))
            assert widths[row] == hist.max_seen / num_bins
        for pct in (99.0, 99.99):
            rows = percentile_rows(counts, widths, pct)
            for row in range(len(hists)):
                cumulative = np.cumsum(counts[row])
                target = cumulative[-1] * pct / 100.0
                index = min(int(np.searchsorted(cumulative, target, side="left")), num_bins - 1)
                below = cumulative[index - 1] if index else 0.0
                inside = (target - below) / counts[row][index] if counts[row][index] else 1.0
                assert rows[row] == (index + inside) * widths[row]


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_kept_batches_give_the_counts_of_batches_binned_at_once(scale):
    """A batch handed over with ``keep`` (binned when first needed, `final_rows` many at once without
    storing them) and a buffer filled by small batches or merges (kept whole) give the counts, tops and
    final rows of histograms that binned them at once, whatever is read first."""
    from onnx_qat.calibration.collector import final_rows

    rng = np.random.default_rng(int(np.log10(scale) + 40))
    batches = [(rng.standard_t(3, 2048) * scale * (1 + i)).astype(np.float32 if i % 4 else np.float64)
               for i in range(8)]
    batches[2][:] = 2.0 ** 3  # a power of two at the top: its own bin only when binned alone
    kept, at_once, small, merged = ([AbsHistogram(2048) for _ in batches] for _ in range(4))
    for values, k, a, s, m in zip(batches, kept, at_once, small, merged):
        peak = float(np.abs(values).max())
        k.update(values, peak=peak, signed=True, keep=True)
        a.update(values, peak=peak, signed=True)
        for part in np.array_split(values, 5):
            s.update(part, peak=float(np.abs(part).max()), signed=True, keep=True)
            other = AbsHistogram(2048)
            other.update(np.abs(part))
            m.merge(other)
        assert k._kept is not None and s._kept is not None and m._kept is not None
    got = final_rows(kept, 2048)
    want = final_rows(at_once, 2048)
    for rows in (final_rows(small, 2048), final_rows(merged, 2048), got):
        np.testing.assert_array_equal(rows[0], want[0])
        np.testing.assert_array_equal(rows[1], want[1])
    # final_rows binned the float32 batches without storing their counts (float64 ones were binned one
    # by one, into the histogram)
    assert [k._kept is not None for k in kept] == [v.dtype == np.float32 for v in batches]
    for k, s, a in zip(kept, small, at_once):
        assert k.top == a.top and s.top == a.top and k._kept is None
        np.testing.assert_array_equal(k.counts, a.counts)
        np.testing.assert_array_equal(s.counts, a.counts)
    again = AbsHistogram(2048)
    again.update(batches[0], peak=float(np.abs(batches[0]).max()), signed=True, keep=True)
    again.update(np.abs(batches[1]))  # a later batch bins the kept one first: as binned one by one
    one_by_one = AbsHistogram(2048)
    one_by_one.update(np.abs(batches[0]))
    one_by_one.update(np.abs(batches[1]))
    np.testing.assert_array_equal(again.counts, one_by_one.counts)
