"""The vectorized entropy search gives the per-threshold KL divergences and the same threshold; the
two guards (search from half the range, at most 0.1 % clipped) on the histograms they are made for."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_qat.calibration.entropy import (
    MAX_CLIPPED, EntropyCollector, clip_floor, kl_divergence_at, kl_divergences,
)


def _histograms():
    rng = np.random.default_rng(0)
    for case in range(12):
        used = int(rng.integers(200, 2048))
        values = np.abs(rng.standard_normal(int(rng.integers(500, 50_000))) * rng.uniform(0.1, 3))
        counts = np.zeros(2048, np.int64)
        counts[:used] = np.histogram(values, bins=used, range=(0, values.max()))[0]
        if case % 3 == 0:
            counts[rng.integers(0, used, 40)] = 0  # empty bins inside
        if case % 4 == 0:
            counts[used - 1], counts[used - 3] = 0, 5  # an empty bin where the tail is folded in
        yield counts


@pytest.mark.parametrize("counts", list(_histograms()))
def test_all_thresholds_match_the_per_threshold_form(counts):
    stop = int(np.flatnonzero(counts)[-1]) + 1
    expected = np.array([kl_divergence_at(counts, i, 128) for i in range(128, stop + 1)])
    got = kl_divergences(counts, 128, stop, 128)
    assert np.array_equal(np.isinf(expected), np.isinf(got))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-9, atol=1e-12)
    assert int(np.argmin(got)) == int(np.argmin(expected))


def _loop_minimum(counts, start):
    stop = int(np.flatnonzero(counts)[-1]) + 1
    divergences = [(kl_divergence_at(counts, i, 128), -i) for i in range(start, stop + 1)]
    return -min(divergences)[1]  # the last smallest: the widest of equal divergences


def test_unguarded_collector_threshold_is_the_loop_minimum():
    counts = next(iter(_histograms()))
    unguarded = EntropyCollector(start_bin=128, max_clipped=0)
    assert unguarded._threshold(counts, 0.5) == _loop_minimum(counts, 128) * 0.5


@pytest.mark.parametrize("counts", list(_histograms())[:6])
def test_default_threshold_is_the_loop_minimum_from_half_above_the_clip_floor(counts):
    stop = int(np.flatnonzero(counts)[-1]) + 1
    collector = EntropyCollector()
    assert collector.start_bin == 1024
    floor = clip_floor(counts, MAX_CLIPPED)
    assert counts[floor:].sum() <= MAX_CLIPPED * counts.sum() < counts[floor - 1:].sum()
    expected = stop if stop <= 1024 else max(_loop_minimum(counts, 1024), floor)
    assert collector._threshold(counts, 0.5) == expected * 0.5


def _spiky(seed):
    """A feature map over a constant background: each of 48 channels repeats one value 3000 times,
    around 30 000 varied values (the histogram of a text image's early layers)."""
    rng = np.random.default_rng(seed)
    background = np.repeat(rng.uniform(-0.6, 0.6, 48), 3000)
    return np.concatenate([background, rng.standard_normal(30_000)]).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spiky_histogram_no_longer_clips_a_tenth_of_the_values(seed):
    magnitudes = np.abs(_spiky(seed))
    amax = {}
    for name, collector in (("unguarded", EntropyCollector(start_bin=128, max_clipped=0)),
                            ("default", EntropyCollector())):
        collector.update(magnitudes)
        amax[name] = collector.amax()
    assert np.mean(magnitudes > amax["unguarded"]) > 0.09  # the spikes pull KL to the narrowest ranges
    assert np.mean(magnitudes > amax["default"]) <= MAX_CLIPPED + 1e-4
    assert 0.5 * magnitudes.max() <= amax["default"] < magnitudes.max()  # still clips the rarest values
