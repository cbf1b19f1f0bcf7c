"""The shared collector interface and the running histogram of |x|.

A collector sees one tensor's values batch by batch (finite magnitudes only: the
runner removes NaN/Inf first) and keeps a fixed-size summary, so memory does not
grow with the number of samples. `RangeCollector.amax` turns the summary into
one range.
"""
from __future__ import annotations

import abc
import threading
from typing import ClassVar

import numpy as np


class RangeCollector(abc.ABC):
    """Running statistics of one tensor's magnitudes, reduced batch by batch.

    Subclasses set `method` and implement `update`, `amax` and
    `state_nbytes`.
    """

    method: ClassVar[str] = ""

    @abc.abstractmethod
    def update(self, magnitudes: np.ndarray) -> None:
        """Add a batch of finite, non-negative values (any shape)."""

    def update_values(self, values: np.ndarray, peak: float, keep: bool = False) -> None:
        """Add a batch of finite values of any sign whose largest magnitude ``peak`` is known.

        The runner's path: a collector that needs only the peak (``max``) never builds
        the array of magnitudes. By default ``update(np.abs(values))``. ``keep``: the caller hands
        ``values`` over (it is not changed afterwards), so a collector may hold it instead of a
        summary of it (`AbsHistogram.update`).
        """
        self.update(np.abs(values))

    @abc.abstractmethod
    def amax(self) -> float:
        """The range chosen from everything seen so far (0.0 when everything was zero)."""

    @abc.abstractmethod
    def state_nbytes(self) -> int:
        """Bytes of state held: constant in the number of samples seen."""

    def describe(self) -> str:
        """Options of this collector, for the ScaleTable's producer/metadata."""
        return self.method

    def merge(self, other: "RangeCollector") -> None:
        """Add what ``other`` (a collector of the same kind and options, fed other batches) has seen:
        the result is the collector of both sets of batches, exactly, in any order (calibration on
        worker processes merges each part's collectors, `onnx_qat.calibration.parallel`)."""
        raise TypeError(f"{type(self).__name__} cannot merge")


#: Below ``this * num_bins`` a top's bin scale no longer fits a float32 (it would overflow).
_FLOAT32_SCALE_FLOOR = 1e-37


class AbsHistogram:
    """A histogram of |x| over ``[0, top]`` with ``num_bins`` equal bins, grown without a second pass.

    ``top`` is always a power of two: the smallest one at or above the largest value seen. When a
    batch brings a larger maximum, ``top`` doubles (as often as needed) and every group of adjacent
    bins is summed into one: the re-binning is exact because bin edges stay aligned. The largest
    value therefore always lies in the upper half of the range, so at least ``num_bins / 2`` bins
    cover the data. Because the edges depend only on the values (never on the order of the batches),
    two histograms of parts of the data `merge` into exactly the histogram of all of it, and
    batches may be counted in any grouping: small batches are buffered and binned together (one
    pass per ``num_bins`` values instead of one per batch). Zeros count in bin 0.

    A batch given with ``keep=True`` to an empty histogram (`update`) is kept as it is and binned
    when the counts are first needed: the same counts, binned as that one batch (`final_rows` bins
    the kept batches of many histograms in one pass and does not store their counts, so a
    calibration of thousands of tensors never holds a count array for each).
    """

    __slots__ = ("num_bins", "_counts", "_top", "max_seen", "_pending_zeros", "_buffer", "_buffered", "_kept")

    def __init__(self, num_bins: int = 2048):
        if num_bins < 2 or num_bins & (num_bins - 1):
            raise ValueError(f"num_bins must be a power of two >= 2, got {num_bins}")
        self.num_bins = int(num_bins)
        self._counts = _no_counts(self.num_bins)  # allocated when the first value is binned (`_grow`)
        self._top = 0.0
        self._kept = None  # (values, peak, signed): a batch kept by `update`'s ``keep``, not binned yet
        self.max_seen = 0.0
        self._pending_zeros = 0
        self._buffer: list = []  # small batches (their magnitudes or signed values) not binned yet
        self._buffered = 0

    @property
    def top(self) -> float:
        """The upper end of the running bins (0.0 before any positive value was binned)."""
        self._bin_kept()
        return self._top

    def update(self, magnitudes: np.ndarray, *, peak: "float | None" = None, signed: bool = False,
               keep: bool = False) -> None:
        """Add finite, non-negative values (``peak``: their maximum, when already known).

        With ``signed=True`` the values may have any sign and their magnitudes are counted
        (``peak`` must then be the largest magnitude): no separate array of |x| is built.
        With ``keep=True`` the caller hands the array over (it is not changed afterwards): a batch of
        at least ``num_bins`` values reaching an empty histogram is kept and binned later (see the
        class), the same counts.
        """
        if signed and peak is None:
            raise ValueError("signed values need their peak magnitude")
        self._bin_kept()
        values = np.asarray(magnitudes).ravel()
        if values.size == 0:
            return
        batch_max = float(values.max()) if peak is None else float(peak)
        if batch_max <= 0.0:
            if self._top == 0.0:
                self._pending_zeros += values.size
            else:
                self._counts[0] += values.size
            return
        self.max_seen = max(self.max_seen, batch_max)
        if keep and values.size >= self.num_bins and self._top == 0.0 and not self._pending_zeros \
                and not self._buffer:
            self._kept = (values, batch_max, signed)
            return
        if values.size < self.num_bins:  # binned later with others: the counts do not depend on it
            # kept as given (signed or not): `_flush` takes the magnitudes of all of them at once
            self._buffer.append(values if keep else values.copy())
            self._buffered += values.size
            if self._buffered >= self.num_bins:
                self._full()
            return
        self._count(values, batch_max, signed)

    def _bin_kept(self) -> None:
        """Bin the batch `update` kept (``keep``), as it would have been binned then."""
        if self._kept is not None:
            values, peak, signed = self._kept
            self._kept = None
            self._count(values, peak, signed)

    def _full(self) -> None:
        """The buffer holds ``num_bins`` values or more: binned now, or, while nothing was binned
        (nor zero) before them, kept as one batch (`_kept`) to be binned when the counts are needed.
        The same counts: `_flush` would bin their magnitudes with the largest of them, which is
        ``max_seen`` then, and a magnitude's bin is that of the value's magnitude after scaling (the
        scale is a power of two)."""
        if self._top == 0.0 and not self._pending_zeros and self._kept is None:
            values = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
            self._buffer, self._buffered = [], 0
            self._kept = (values, self.max_seen, True)
            return
        self._flush()

    def _flush(self) -> None:
        self._bin_kept()
        if not self._buffer:
            return
        if len(self._buffer) > 1:  # a new array: its magnitudes are taken in place
            values = np.concatenate(self._buffer)
            values = np.abs(values, out=values) if values.dtype.kind == "f" else np.abs(values)
        else:  # possibly shared with a merged histogram: not changed
            values = np.abs(self._buffer[0])
        self._buffer, self._buffered = [], 0
        self._count(values, float(values.max()), False)

    def _count(self, values: np.ndarray, batch_max: float, signed: bool) -> None:
        if batch_max > self._top:
            self._grow(batch_max)
        self._counts += np.bincount(self._bin_index(values, signed), minlength=self.num_bins)

    def _bin_index(self, values: np.ndarray, signed: bool) -> np.ndarray:
        """The bin of each |value| (values at or above ``top`` go to the last bin).

        ``num_bins / top`` is a power of two, so each position is computed exactly (float32 or
        float64 alike): a value's bin never depends on the precision used.
        """
        factor = self.num_bins / self._top
        if values.dtype == np.float32 and _FLOAT32_SCALE_FLOOR < factor < 1.0 / _FLOAT32_SCALE_FLOOR:
            position = values * np.float32(factor)  # float32 throughout
        else:
            position = values.astype(np.float64)
            position *= factor
        if signed:
            np.abs(position, out=position)
        index = position.astype(np.intp)
        return np.minimum(index, self.num_bins - 1, out=index)

    def _grow(self, new_max: float) -> None:
        top = _top_for(new_max)
        if self._top == 0.0:
            self._top = top
            self._counts = np.zeros(self.num_bins, dtype=np.int64)
            self._counts[0] += self._pending_zeros
            self._pending_zeros = 0
            return
        doublings = int(round(np.log2(top / self._top)))
        self._top = top
        if doublings >= 62 or 2 ** doublings >= self.num_bins:
            total = int(self._counts.sum())
            self._counts[:] = 0
            self._counts[0] = total
            return
        factor = 2 ** doublings
        merged = self._counts.reshape(-1, factor).sum(axis=1)
        self._counts[:] = 0
        self._counts[: merged.size] = merged

    def merge(self, other: "AbsHistogram") -> None:
        """Add the counts of ``other`` (a histogram of other values, same ``num_bins``): the result is
        exactly the histogram of both sets of values, in any order."""
        if other.num_bins != self.num_bins:
            raise ValueError(f"cannot merge histograms of {other.num_bins} and {self.num_bins} bins")
        self._bin_kept()
        if other._kept is not None:  # ``other`` is not changed (it may be read-only, from Ray)
            other = other._copy()
            other._bin_kept()
        if other._buffer:  # values not binned yet join this histogram's own (``other`` is not changed:
            # it may be read-only, from Ray); the counts do not depend on how values are grouped
            self._buffer.extend(other._buffer)
            self._buffered += other._buffered
            if other._top == 0.0 and other._pending_zeros == 0:  # nothing counted there yet
                self.max_seen = max(self.max_seen, other.max_seen)
                if self._buffered >= self.num_bins:
                    self._full()
                return
            other = other._copy()
            other._buffer, other._buffered = [], 0
        self.max_seen = max(self.max_seen, other.max_seen)
        if other._top == 0.0:
            if self._top == 0.0:
                self._pending_zeros += other._pending_zeros
            else:
                self._counts[0] += other._pending_zeros
            return
        if other._top > self._top:
            self._grow(other._top)
        counts = other._counts
        if other._top < self._top:
            factor = int(round(self._top / other._top))
            counts = np.zeros(self.num_bins, dtype=np.int64) if factor >= self.num_bins else \
                np.concatenate([counts.reshape(-1, factor).sum(axis=1),
                                np.zeros(self.num_bins - self.num_bins // factor, np.int64)])
            if factor >= self.num_bins:
                counts[0] = int(other._counts.sum())
        self._counts += counts
        if self._buffered >= self.num_bins:
            self._flush()

    def __getstate__(self):
        """A compact state for pickling (calibration workers send their histograms back): the counts
        as their non-empty bins (most bins of a part of the data are empty), the values not binned
        yet as one array."""
        self._bin_kept()
        nonzero = np.flatnonzero(self._counts)
        counts = (nonzero.astype(np.int32), self._counts[nonzero]) if nonzero.size * 3 < self.num_bins \
            else self._counts
        buffer = (np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]) \
            if self._buffer else None
        return (self.num_bins, counts, self._top, self.max_seen, self._pending_zeros, buffer)

    def __setstate__(self, state) -> None:
        self.num_bins, counts, self._top, self.max_seen, self._pending_zeros, buffer = state
        if isinstance(counts, tuple):
            self._counts = np.zeros(self.num_bins, dtype=np.int64) if self._top else _no_counts(self.num_bins)
            if counts[0].size:
                self._counts[counts[0]] = counts[1]
        else:
            self._counts = np.array(counts, dtype=np.int64)
        self._buffer = [] if buffer is None else [buffer]
        self._buffered = 0 if buffer is None else int(buffer.size)
        self._kept = None

    def _copy(self) -> "AbsHistogram":
        copy = AbsHistogram(self.num_bins)
        copy._counts = np.array(self._counts)
        copy._top, copy.max_seen, copy._pending_zeros = self._top, self.max_seen, self._pending_zeros
        copy._buffer, copy._buffered = list(self._buffer), self._buffered
        copy._kept = self._kept
        return copy

    @property
    def counts(self) -> np.ndarray:
        """The ``num_bins`` counts over ``[0, top]`` (buffered values binned first)."""
        self._flush()
        return self._counts

    @property
    def total(self) -> int:
        """Number of values counted."""
        self._flush()
        return int(self._counts.sum()) + self._pending_zeros

    @property
    def bin_width(self) -> float:
        return self.top / self.num_bins

    def edges(self) -> np.ndarray:
        """The ``num_bins + 1`` bin edges."""
        return np.linspace(0.0, self.top, self.num_bins + 1)

    def centers(self) -> np.ndarray:
        """The bin centers."""
        return (np.arange(self.num_bins, dtype=np.float64) + 0.5) * self.bin_width

    def used_bins(self) -> int:
        """Index one past the last non-empty bin (0 when empty)."""
        self._flush()
        nonzero = np.flatnonzero(self._counts)
        return int(nonzero[-1]) + 1 if nonzero.size else 0

    def nbytes(self) -> int:
        """Bytes held: the counts and at most ``num_bins`` buffered values (or the kept batch)."""
        kept = 0 if self._kept is None else int(self._kept[0].nbytes)
        return int(self._counts.nbytes) + max(8 * self.num_bins, kept) + 32

    def final(self, num_bins: int) -> "tuple[np.ndarray, float]":
        """Counts re-binned onto ``num_bins`` equal bins over ``[0, max_seen]``, and their width.

        The cumulative count is interpolated linearly inside the running bins (values
        spread evenly within a bin), so the result barely depends on how the range grew
        across batches. Every value lands in some bin: the total is preserved.
        """
        counts, widths = final_rows([self], num_bins)
        return counts[0], float(widths[0])


def _top_for(new_max: float) -> float:
    """The smallest power of two at or above ``new_max`` (> 0): a histogram's ``top``."""
    top = float(2.0 ** np.ceil(np.log2(new_max)))
    while top < new_max:  # guard against log2 rounding
        top *= 2.0
    return top


_NO_COUNTS: dict = {}


def _no_counts(num_bins: int) -> np.ndarray:
    """The counts of a histogram that has binned nothing yet: one read-only array of zeros per size,
    shared (a calibration part's fresh collectors, thousands of them, allocate nothing until they
    bin a value; `AbsHistogram._grow` gives a histogram its own counts)."""
    zeros = _NO_COUNTS.get(num_bins)
    if zeros is None:
        zeros = _NO_COUNTS[num_bins] = np.zeros(num_bins, dtype=np.int64)
        zeros.flags.writeable = False
    return zeros


def final_rows(hists, num_bins: int) -> "tuple[np.ndarray, np.ndarray]":
    """`AbsHistogram.final` of many histograms of the same number of running bins at once:
    counts ``[R, num_bins]`` and widths ``[R]``.

    The interpolation is ``np.interp``'s arithmetic written out for all rows (the running bins' edges
    are multiples of a power of two, so each position's bin is found exactly by a division): the same
    numbers as ``np.interp`` row by row, without a NumPy call per histogram.

    The batches histograms kept (`AbsHistogram.update`'s ``keep``) are binned here, those of the same
    size together (`_kept_rows`), into these counts only: the histograms keep them unbinned.
    """
    rows, size = len(hists), hists[0].num_bins
    counts = _scratch("counts", (rows, size), np.int64)
    tops = np.empty(rows, dtype=np.float64)
    kept = _kept_rows(hists, counts, tops)
    for r, hist in enumerate(hists):
        if r not in kept:
            hist._flush()
            counts[r] = hist._counts
            tops[r] = hist._top
    peaks = np.array([hist.max_seen for hist in hists], dtype=np.float64)
    cumulative = _scratch("cumulative", (rows, size + 1), np.float64)
    cumulative[:, 0] = 0.0
    # summed as integers, then converted: the same numbers as a float64 sum (every partial sum is a
    # whole number below 2^53), without NumPy's casting loop
    cumulative[:, 1:] = np.cumsum(counts, axis=1, out=counts)
    del counts
    zeros = [hist._pending_zeros for hist in hists]
    if any(zeros):
        cumulative[:, 1:] += np.array(zeros, dtype=np.float64)[:, None]
    steps = tops / size  # the running bins' width: a power of two
    at_edges = _cumulative_at_edges(cumulative, tops, peaks, steps, num_bins)
    return np.diff(at_edges, axis=1), peaks / num_bins


_SCRATCH = threading.local()
#: The largest `_scratch` array kept for reuse, in elements (32 MB of float64).
SCRATCH_ELEMENTS = 1 << 22


def _scratch(name: str, shape: tuple, dtype) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` (contents undefined) that this thread reuses from call to
    call under ``name``: `final_rows` runs once per group of histograms, and fresh arrays of a few MB
    each time cost the kernel's page faults (as much again as the arithmetic on them, measured). The
    largest asked for is kept, a few MB per thread for `onnx_qat.calibration.auto.analyze`'s groups."""
    size = int(np.prod(shape))
    if size > SCRATCH_ELEMENTS:  # a call over many more histograms than a group: not kept
        return np.empty(shape, dtype=dtype)
    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None:
        arrays = _SCRATCH.arrays = {}
    found = arrays.get(name)
    if found is None or found.dtype != dtype or found.size < size:
        found = arrays[name] = np.empty(size, dtype=dtype)
    return found[:size].reshape(shape)


def _kept_rows(hists, counts: np.ndarray, tops: np.ndarray) -> set:
    """Bin the kept batches of ``hists`` that `final_rows` may bin together into ``counts[r]`` and
    ``tops[r]`` (the histogram itself is not changed): ``{r}`` of the rows done.

    A row qualifies when its histogram holds only a kept float32 batch (nothing binned, buffered or
    zero before it) whose bin scale ``num_bins / top`` fits a float32 (`AbsHistogram._bin_index`'s
    float32 arithmetic: every position is the product of a value and an exact power of two, one
    rounding, whether one row or many are multiplied at once). Rows of the same size and sign are
    binned in blocks: one multiplication, one conversion and one ``np.bincount`` per block instead
    of one each per histogram."""
    size = counts.shape[1]
    groups: dict = {}
    for r, hist in enumerate(hists):
        kept = hist._kept
        if kept is None or hist._buffer or hist._pending_zeros or hist._top != 0.0:
            continue
        values, peak, signed = kept
        if values.dtype != np.float32:
            continue
        top = _top_for(peak)
        factor = size / top
        if not _FLOAT32_SCALE_FLOOR < factor < 1.0 / _FLOAT32_SCALE_FLOOR:
            continue
        groups.setdefault((values.size, signed), []).append((r, top, factor))
    done = set()
    for (length, signed), members in groups.items():
        for block in row_blocks(len(members), max(length, size) // 16):  # a few MB at a time
            part = members[block]
            index = [r for r, _, _ in part]
            stack = _scratch("values", (len(index), length), np.float32)
            np.concatenate([hists[r]._kept[0] for r in index], out=stack.reshape(-1))
            stack *= np.array([factor for _, _, factor in part], dtype=np.float32)[:, None]
            if signed:
                np.abs(stack, out=stack)
            position = _scratch("bins", stack.shape, np.intp)
            np.copyto(position, stack, casting="unsafe")  # as stack.astype(np.intp)
            np.minimum(position, size - 1, out=position)
            position += (np.arange(len(index), dtype=np.intp) * size)[:, None]
            counts[index] = np.bincount(position.ravel(), minlength=len(index) * size).reshape(-1, size)
            tops[index] = [top for _, top, _ in part]
            done.update(index)
    return done


def _cumulative_at_edges(cumulative, tops, peaks, steps, num_bins: int) -> np.ndarray:
    """The running cumulative counts ``[R, size + 1]`` interpolated at the ``num_bins + 1`` edges of
    equal bins over ``[0, peaks[r]]`` (``np.interp``'s numbers)."""
    rows, size = cumulative.shape[0], cumulative.shape[1] - 1
    blocks = row_blocks(rows, 8 * (num_bins + 1))
    if len(blocks) > 1:  # rows in blocks that stay in the processor's cache
        return np.concatenate([_cumulative_at_edges(cumulative[b], tops[b], peaks[b], steps[b], num_bins)
                               for b in blocks])
    edges = np.arange(num_bins + 1, dtype=np.float64)[None, :] * (peaks / num_bins)[:, None]
    edges[:, -1] = peaks  # as np.linspace(0, max_seen, num_bins + 1) has them
    if not np.all(steps >= np.finfo(np.float64).tiny):  # subnormal steps: divisions may round
        at_edges = np.stack([np.interp(e, np.linspace(0.0, t, size + 1), c)
                             for e, t, c in zip(edges, tops, cumulative)])
    else:
        lower = (edges / steps[:, None]).astype(np.intp)
        np.minimum(lower, size - 1, out=lower)
        offsets = (np.arange(rows, dtype=np.intp) * (size + 1))[:, None]  # rows in the flat cumulative
        flat = cumulative.ravel()
        left = flat.take(lower + offsets)
        right = flat.take(lower + (offsets + 1))
        knots = lower * steps[:, None]
        slope = (right - left) / steps[:, None]
        at_edges = np.where(knots == edges, left, slope * (edges - knots) + left)
    at_edges[:, -1] = cumulative[:, -1]
    return at_edges


class HistogramCollector(RangeCollector):
    """Base of the histogram methods.

    Keeps an `AbsHistogram` with ``RESOLUTION`` times ``num_bins`` running bins;
    at the end it is re-binned onto ``num_bins`` bins over ``[0, max |x|]`` and the
    method's `_threshold` reads that.
    """

    RESOLUTION = 4

    def __init__(self, num_bins: int = 2048):
        self.num_bins = int(num_bins)
        self.hist = AbsHistogram(self.num_bins * self.RESOLUTION)

    def update(self, magnitudes: np.ndarray) -> None:
        self.hist.update(magnitudes)

    def update_values(self, values: np.ndarray, peak: float, keep: bool = False) -> None:
        self.hist.update(values, peak=peak, signed=True, keep=keep)

    def state_nbytes(self) -> int:
        return self.hist.nbytes()

    def merge(self, other: "HistogramCollector") -> None:
        """Merge ``other``'s histogram (`AbsHistogram.merge`: exact)."""
        self.hist.merge(other.hist)

    def amax(self) -> float:
        if self.hist.max_seen <= 0.0:
            return 0.0
        counts, width = self.hist.final(self.num_bins)
        value = float(self._threshold(counts, width))
        # a threshold never exceeds the largest value seen, and never collapses to zero
        return min(max(value, width), self.hist.max_seen)

    @abc.abstractmethod
    def _threshold(self, counts: np.ndarray, width: float) -> float:
        """The method's threshold from ``num_bins`` counts of width ``width`` starting at 0."""


#: Elements of one ``[rows, thresholds, levels]`` array `onnx_qat.calibration.entropy.kl_rows`
#: and `onnx_qat.calibration.mse.edge_mse_rows` hold at once: their rows are taken in blocks of about this
#: size, which stay in the processor's cache (twice as fast as one block of 32 histograms, measured on
#: the benchmark's 10,000-node net; the numbers do not depend on the blocks).
BLOCK_ELEMENTS = 1 << 16


def row_blocks(rows: int, per_row: int):
    """Slices of ``range(rows)`` each holding about `BLOCK_ELEMENTS` / ``per_row`` rows (at least one)."""
    step = max(1, BLOCK_ELEMENTS // max(int(per_row), 1))
    return [slice(start, start + step) for start in range(0, rows, step)]


#: `coarse_to_fine` scores every ``COARSE_STRIDE``-th candidate first ...
COARSE_STRIDE = 8
#: ... then every candidate within one stride of the ``COARSE_KEEP`` best of those.
COARSE_KEEP = 4


def coarse_to_fine(score, start: int, stop: int, *, widest: bool = True):
    """The candidate in ``start..stop`` (whole bins) with the least finite ``score``, or None when no
    score is finite: `coarse_to_fine_rows` of one row (``score`` maps an array of candidates
    ``[1, K]`` to their scores ``[1, K]``)."""
    best = coarse_to_fine_rows(score, np.array([start]), np.array([stop]), widest=widest)[0]
    return None if best < 0 else int(best)


def coarse_to_fine_rows(score, start: np.ndarray, stop: np.ndarray, *, widest: bool = True) -> np.ndarray:
    """For each row ``r``, the candidate in ``start[r]..stop[r]`` (whole bins) with the least finite
    score (-1 when none is finite, or when ``stop[r] < start[r]``).

    ``score`` maps candidates ``[R, K]`` (one row of candidates per row) to scores ``[R, K]``. Every
    `COARSE_STRIDE`-th candidate from ``start`` (and ``stop``) is scored, then every candidate
    within one stride of the `COARSE_KEEP` best of those: about 1/6 of an exhaustive search
    over 2048 bins, the same answer wherever the score varies smoothly at the scale of 8 bins (a
    quantization error or divergence over 128 levels does; a jagged score may land on a
    near-minimum). ``widest``: among equal scores the largest candidate (clips least), else the
    smallest. Many rows at once cost little more than one: the histograms of all tensors are searched
    together (`onnx_qat.calibration.auto.analyze`).

    The windows around neighbouring kept candidates overlap: each candidate is scored once.
    """
    start = np.asarray(start, dtype=np.intp)
    stop = np.asarray(stop, dtype=np.intp)
    rows = start.size
    grid = np.arange(0, max(int((stop - start).max()), 0) + 1, COARSE_STRIDE, dtype=np.intp)
    coarse = start[:, None] + grid[None, :]
    valid = coarse <= stop[:, None]
    on_grid = (stop - start) % COARSE_STRIDE == 0
    candidates = np.concatenate([np.where(valid, coarse, stop[:, None]), stop[:, None]], axis=1)
    valid = np.concatenate([valid, (~on_grid & (stop >= start))[:, None]], axis=1)
    scores = np.where(valid, np.asarray(score(candidates), dtype=np.float64), np.inf)
    scores = np.where(np.isfinite(scores), scores, np.inf)
    none = ~np.isfinite(scores).any(axis=1)
    count = min(COARSE_KEEP, candidates.shape[1])
    order = np.argsort(scores, axis=1, kind="stable")[:, :count]
    picked = np.take_along_axis(candidates, order, axis=1)
    offsets = np.arange(-(COARSE_STRIDE - 1), COARSE_STRIDE, dtype=np.intp)
    candidates = (picked[:, :, None] + offsets[None, None, :]).reshape(rows, -1)
    candidates = _distinct_rows(np.clip(candidates, start[:, None], np.maximum(stop, start)[:, None]))
    scores = np.asarray(score(candidates), dtype=np.float64)
    scores = np.where(np.isfinite(scores), scores, np.inf)
    best = scores.min(axis=1, keepdims=True)
    ties = (scores == best) & np.isfinite(best)
    chosen = np.where(ties, candidates, -1).max(axis=1) if widest else \
        np.where(ties, candidates, np.iinfo(np.intp).max).min(axis=1)
    return np.where(none | ~ties.any(axis=1), -1, chosen)


def _distinct_rows(candidates: np.ndarray) -> np.ndarray:
    """Each row's distinct values in increasing order, the rows padded with their smallest value to
    the longest row's count (windows around neighbouring candidates overlap: each is scored once)."""
    ordered = np.sort(candidates, axis=1)
    repeat = np.zeros(ordered.shape, dtype=bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    order = np.argsort(repeat, axis=1, kind="stable")  # the first of each value, in order, come first
    count = int((~repeat).sum(axis=1).max())
    distinct = np.take_along_axis(ordered, order[:, :count], axis=1)
    first = np.take_along_axis(~repeat, order[:, :count], axis=1)
    return np.where(first, distinct, ordered[:, :1])
