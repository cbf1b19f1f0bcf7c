"""``mse``: the threshold minimising the expected squared quantization error."""
from __future__ import annotations

import numpy as np

from .collector import HistogramCollector, coarse_to_fine_rows, row_blocks


class MseCollector(HistogramCollector):
    """amax = argmin over thresholds T of E[(x - fake_quant(x; T))^2] over the histogram of |x|.

    Each bin is represented by its center c with its count; with scale s = T / 127,
    values inside the range are rounded to a multiple of s (error (c - round(c/s) s)^2)
    and values beyond T are clipped to T (error (c - T)^2). Every bin edge from
    bin 1 up to the last non-empty bin is a candidate, searched by `coarse_to_fine_rows`
    (every 8th edge ranked by a uniform-density estimate of the error, then every edge near the best of
    those scored exactly).
    """

    method = "mse"

    def __init__(self, num_bins: int = 2048):
        super().__init__(num_bins)

    def _threshold(self, counts: np.ndarray, width: float) -> float:
        return float(mse_thresholds(counts[None, :])[0]) * width


def mse_thresholds(counts: np.ndarray, *, prefix=None) -> np.ndarray:
    """The least-error threshold (in bins) of each row of ``counts`` ``[R, n]`` (rows not all zero),
    searched by `coarse_to_fine_rows` over the bin edges ``1..last non-empty`` (``prefix``:
    `moment_prefixes` of ``counts`` when already computed)."""
    counts = np.asarray(counts, dtype=np.float64)
    last = counts.shape[1] - np.argmax(counts[:, ::-1] > 0, axis=1)
    if prefix is None:
        prefix = moment_prefixes(counts)
    coarse = _coarse_mse(prefix)
    calls = []

    def score(edges):  # the first call scores the coarse candidates, the second the fine ones
        calls.append(1)
        return coarse(edges) if len(calls) == 1 else edge_mse_rows(counts, edges, prefix=prefix)

    return coarse_to_fine_rows(score, np.ones_like(last), last, widest=False)


def moment_prefixes(counts: np.ndarray):
    """The prefix sums of ``n``, ``n c`` and ``n c^2`` (``c`` the bin centers in bins) of each row of
    ``counts`` ``[R, n]``, each ``[R, n + 1]`` starting at 0: what `edge_mse_rows` and the coarse
    estimate read."""
    counts = np.asarray(counts, dtype=np.float64)
    rows, n = counts.shape
    centers = np.arange(n, dtype=np.float64) + 0.5
    sums = np.empty((3, rows, n + 1))
    sums[:, :, 0] = 0.0
    np.cumsum(counts, axis=1, out=sums[0, :, 1:])  # n c^0: the counts themselves
    np.cumsum(counts * centers, axis=1, out=sums[1, :, 1:])
    np.cumsum(counts * centers ** 2, axis=1, out=sums[2, :, 1:])
    return [sums[0], sums[1], sums[2]]


def _coarse_mse(prefix):
    """A cheap stand-in for `edge_mse_rows` that ranks the coarse candidates: the values beyond
    the threshold clip (their exact squared error, from prefix sums), the values inside cost the
    rounding error of a uniform density, ``s^2 / 12`` each: O(1) per threshold instead of 128 terms.
    Only the best few coarse candidates matter; every fine candidate is scored exactly."""

    def score(edges):
        edges = np.asarray(edges, dtype=np.intp)
        inside = [np.take_along_axis(p, edges, axis=1) for p in prefix]  # centers below each edge
        beyond = [p[:, -1:] - q for p, q in zip(prefix, inside)]
        t = edges.astype(np.float64)
        clipped = beyond[2] - 2.0 * t * beyond[1] + t * t * beyond[0]
        scale = t / 127.0
        error = np.maximum(clipped, 0.0) + inside[0] * scale * scale / 12.0
        return error / np.maximum(prefix[0][:, -1:], 1.0)

    return score


def edge_mse(counts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """`edge_mse_rows` of one histogram."""
    return edge_mse_rows(np.asarray(counts, dtype=np.float64)[None, :], np.asarray(edges)[None, :])[0]


def edge_mse_rows(counts: np.ndarray, edges: np.ndarray, *, prefix=None) -> np.ndarray:
    """`quantization_mse` of the bin centers of each row of ``counts`` ``[R, n]`` for the
    thresholds at bin edges ``edges`` ``[R, K]`` (in bins), in units of the bin width squared,
    computed level by level (``prefix``: `moment_prefixes` of ``counts`` when already computed).

    With scale ``s = T / 127`` the centers rounding to level ``q`` form one run of bins, bounded
    where ``c / s`` crosses ``q + 0.5``; a run's squared error ``sum n (c - q s)^2`` comes from prefix
    sums of ``n``, ``n c`` and ``n c^2``, so a threshold costs 128 terms instead of one per bin (the
    centers at or beyond 126.5 steps all clip to level 127, as ``min(round(c / s), 127)`` has it).
    A center exactly halfway between two levels, where rounding goes to the even one, is counted
    with the upper level; the errors agree with `quantization_mse` to float rounding otherwise.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if prefix is None:
        prefix = moment_prefixes(counts)
    edges = np.asarray(edges, dtype=np.float64)
    blocks = row_blocks(counts.shape[0], edges.shape[1] * 129)
    if len(blocks) == 1:
        return _edge_mse_block(counts.shape[1], edges, prefix)
    n = counts.shape[1]
    return np.concatenate([_edge_mse_block(n, edges[b], [p[b] for p in prefix]) for b in blocks])


_LEVELS = np.arange(128, dtype=np.float64)
_LOWER = _LEVELS - 0.5  # each level's lower bound, in steps


def _edge_mse_block(n: int, edges: np.ndarray, prefix) -> np.ndarray:
    """`edge_mse_rows` of one block of rows. Written with arrays reused in place (each operation as
    the expression ``s2 - 2 at s1 + at^2 s0`` orders it: the same numbers as that expression, with a
    third of its temporary arrays)."""
    rows = edges.shape[0]
    scale = edges / 127.0
    # bins below level q's lower bound (q - 0.5) s: the first center index at or above it
    bounds = np.empty(edges.shape + (129,), dtype=np.intp)
    below = np.multiply(_LOWER[None, None, :], scale[:, :, None])
    below -= 0.5
    np.ceil(below, out=below)
    np.clip(below, 0, n, out=below)
    bounds[..., :128] = below
    bounds[..., 128] = n
    bounds += (np.arange(rows, dtype=np.intp) * (n + 1))[:, None, None]  # flat indices into the prefixes
    sums = []
    for p in prefix:
        g = p.ravel().take(bounds)
        sums.append(np.subtract(g[..., 1:], g[..., :-1], out=below))  # one array at a time
        below = g[..., :-1]  # the next difference goes into this (a gathered array, no longer read)
    s0, s1, s2 = sums
    at = np.multiply(_LEVELS[None, None, :], scale[:, :, None])
    term = np.multiply(2.0, at)
    term *= s1
    np.subtract(s2, term, out=term)  # s2 - 2 at s1
    at *= at
    at *= s0
    term += at  # ... + at^2 s0
    error = term.sum(axis=2)
    return np.maximum(error, 0.0) / np.maximum(prefix[0][:, -1:], 1.0)


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
