"""The shared collector interface and the running histogram of |x|.

A collector sees one tensor's values batch by batch (finite magnitudes only: the
runner removes NaN/Inf first) and keeps a fixed-size summary, so memory does not
grow with the number of samples. `RangeCollector.amax` turns the summary into
one range.
"""
from __future__ import annotations

import abc
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

    def update_values(self, values: np.ndarray, peak: float) -> None:
        """Add a batch of finite values of any sign whose largest magnitude ``peak`` is known.

        The runner's path: a collector that needs only the peak (``max``) never builds
        the array of magnitudes. By default ``update(np.abs(values))``.
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


#: Below ``this * num_bins`` a top's bin scale no longer fits a float32 (it would overflow).
_FLOAT32_SCALE_FLOOR = 1e-37


class AbsHistogram:
    """A histogram of |x| over ``[0, top]`` with ``num_bins`` equal bins, grown without a second pass.

    ``top`` starts at the first non-zero maximum. When a batch brings a larger
    maximum, ``top`` doubles (as often as needed) and every group of adjacent bins
    is summed into one: the re-binning is exact because bin edges stay aligned.
    The largest value therefore always lies in the upper half of the range, so at
    least ``num_bins / 2`` bins cover the data. Zeros seen before the first
    non-zero value are kept and added to bin 0.
    """

    __slots__ = ("num_bins", "counts", "top", "max_seen", "_pending_zeros")

    def __init__(self, num_bins: int = 2048):
        if num_bins < 2 or num_bins & (num_bins - 1):
            raise ValueError(f"num_bins must be a power of two >= 2, got {num_bins}")
        self.num_bins = int(num_bins)
        self.counts = np.zeros(self.num_bins, dtype=np.int64)
        self.top = 0.0
        self.max_seen = 0.0
        self._pending_zeros = 0

    def update(self, magnitudes: np.ndarray, *, peak: "float | None" = None, signed: bool = False) -> None:
        """Add finite, non-negative values (``peak``: their maximum, when already known).

        With ``signed=True`` the values may have any sign and their magnitudes are counted
        (``peak`` must then be the largest magnitude): no separate array of |x| is built.
        """
        if signed and peak is None:
            raise ValueError("signed values need their peak magnitude")
        values = np.asarray(magnitudes).ravel()
        if values.size == 0:
            return
        batch_max = float(values.max()) if peak is None else float(peak)
        if batch_max <= 0.0:
            if self.top == 0.0:
                self._pending_zeros += values.size
            else:
                self.counts[0] += values.size
            return
        self.max_seen = max(self.max_seen, batch_max)
        if self.top == 0.0:
            self.top = batch_max
            self.counts[0] += self._pending_zeros
            self._pending_zeros = 0
        elif batch_max > self.top:
            self._grow(batch_max)
        self.counts += np.bincount(self._bin_index(values, signed), minlength=self.num_bins)

    def _bin_index(self, values: np.ndarray, signed: bool) -> np.ndarray:
        """The bin of each |value| (values at or above ``top`` go to the last bin)."""
        if values.dtype == np.float32 and self.top > _FLOAT32_SCALE_FLOOR * self.num_bins:
            position = values * np.float32(self.num_bins / self.top)  # float32 throughout
        else:  # divide before scaling: num_bins / top would overflow for denormal tops
            position = values.astype(np.float64)
            position /= self.top
            position *= self.num_bins
        if signed:
            np.abs(position, out=position)
        index = position.astype(np.intp)
        return np.minimum(index, self.num_bins - 1, out=index)

    def _grow(self, new_max: float) -> None:
        top, doublings = self.top, 0
        while top < new_max:
            top *= 2.0
            doublings += 1
        self.top = top
        if 2 ** min(doublings, 62) >= self.num_bins:
            total = int(self.counts.sum())
            self.counts[:] = 0
            self.counts[0] = total
            return
        factor = 2 ** doublings
        merged = self.counts.reshape(-1, factor).sum(axis=1)
        self.counts[:] = 0
        self.counts[: merged.size] = merged

    @property
    def total(self) -> int:
        """Number of values counted."""
        return int(self.counts.sum()) + self._pending_zeros

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
        nonzero = np.flatnonzero(self.counts)
        return int(nonzero[-1]) + 1 if nonzero.size else 0

    def nbytes(self) -> int:
        return int(self.counts.nbytes) + 32

    def final(self, num_bins: int) -> "tuple[np.ndarray, float]":
        """Counts re-binned onto ``num_bins`` equal bins over ``[0, max_seen]``, and their width.

        The cumulative count is interpolated linearly inside the running bins (values
        spread evenly within a bin), so the result barely depends on how the range grew
        across batches. Every value lands in some bin: the total is preserved.
        """
        top = self.max_seen
        fine_edges = np.linspace(0.0, self.top, self.num_bins + 1)
        cumulative = np.concatenate([[0.0], np.cumsum(self.counts, dtype=np.float64)])
        cumulative[1:] += self._pending_zeros
        edges = np.linspace(0.0, top, num_bins + 1)
        at_edges = np.interp(edges, fine_edges, cumulative)
        at_edges[-1] = cumulative[-1]
        return np.diff(at_edges), top / num_bins


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

    def update_values(self, values: np.ndarray, peak: float) -> None:
        self.hist.update(values, peak=peak, signed=True)

    def state_nbytes(self) -> int:
        return self.hist.nbytes()

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
