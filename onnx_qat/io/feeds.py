"""Data as a stream of feeds: one onnxruntime run per feed, in order, memory bounded by one feed.

Besides an ``.npz`` file whose arrays hold samples on their first axis (`onnx_qat.io.data`), the
data can be a stream of *feeds*, each a complete input of one run:

* a list or tuple of dicts ``{input name: array}``,
* an iterator or generator of such dicts, or any object with ``get_next()`` returning one dict per
  call and ``None`` at the end (onnxruntime's ``CalibrationDataReader`` protocol),
* a directory of ``.npz`` files, one feed each, taken in natural name order (``chunk_2.npz``
  before ``chunk_10.npz``), or a list of ``.npz`` paths, one feed each, in the order given.

Files are read one at a time when their feed is run (their headers are all checked first); an
iterator is read once, keeping only its first `KEPT_FEEDS` feeds so that ``auto``
calibration's output check can run them again. A scalar or fixed-shape input (silero-vad's
``sr``, a 0-d int64) is given once, in the first feed, and used for every later feed that omits it.

The layout (`onnx_qat.io.layout`) says which outputs feed which inputs back (``state``: the
feeds run in order, the first gives the initial state, later feeds omit it) and which inputs have
their batch axis elsewhere than first (``batch_axis``).

Contract: `is_feed_source` tells a stream from samples; `open_feeds` validates a source
into a `FeedStream`, whose `batches` yields the feeds (the interface of a
`Dataset`).
"""
from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from ..errors import DataError, QatError, brief
from .layout import DataLayout
from .values import check_dtype, convert

#: Feeds of an iterator kept for a second run (``auto`` calibration checks its tables on the first 64).
KEPT_FEEDS = 64


# --------------------------------------------------------------------------- sources
def is_feed_source(source) -> bool:
    """True when ``source`` is a stream of feeds rather than samples (see the module docstring)."""
    if isinstance(source, (str, os.PathLike)):
        return Path(source).is_dir()
    if isinstance(source, (list, tuple)):
        return bool(source) and all(isinstance(s, (str, os.PathLike, Mapping)) for s in source)
    if isinstance(source, (Mapping, np.ndarray)) or hasattr(source, "batches"):
        return False
    return hasattr(source, "get_next") or hasattr(source, "__next__") or hasattr(source, "__iter__")


def _natural(path: Path):
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", path.name)]


def _items(source, what: str):
    """``(label, items, one_shot)``: each item a ``(label, dict or path)`` pair."""
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        files = sorted((p for p in folder.iterdir() if p.suffix == ".npz" and p.is_file()), key=_natural)
        if not files:
            raise DataError(f"{what} {folder} holds no .npz files; give one .npz file per feed")
        return f"{what} {folder}", tuple((f"{what} {p}", p) for p in files), False
    if isinstance(source, (list, tuple)):
        items = []
        for i, item in enumerate(source):
            if isinstance(item, Mapping):
                items.append((f"{what}: feed {i}", item))
                continue
            path = Path(item)
            if not path.is_file():
                raise DataError(f"{what} {path} " + ("is a directory; list .npz files" if path.is_dir()
                                                      else "does not exist"))
            items.append((f"{what} {path}", path))
        return what, tuple(items), False
    if hasattr(source, "get_next") and callable(source.get_next):
        return f"{what} (get_next)", iter(source.get_next, None), True
    try:
        return what, iter(source), True
    except TypeError:
        raise DataError(f"{what} must be an .npz path, a directory or list of .npz files, a dict of arrays, "
                        f"a sequence or iterator of feed dicts, or an object with get_next(); got "
                        f"{type(source).__name__}") from None


class _OneShot:
    """An iterator read once; its first `KEPT_FEEDS` items are kept for a later run."""

    def __init__(self, iterator, label: str):
        self.iterator, self.label = iterator, label
        self.head: List = []
        self.pulled = 0
        self.done = False

    @property
    def count(self) -> Optional[int]:
        """The number of items, once the iterator is exhausted (None before)."""
        return self.pulled if self.done else None

    def __iter__(self):
        i = 0
        while True:
            if i < len(self.head):
                item = self.head[i]
            elif i < self.pulled:
                raise DataError(f"{self.label}: an iterator of feeds is read once, and this run needs its "
                                f"feed {i} again; give a list of feeds or a directory of .npz files")
            elif self.done:
                return
            else:
                try:
                    item = next(self.iterator)
                except StopIteration:
                    self.done = True
                    return
                except QatError:
                    raise
                except Exception as exc:
                    raise DataError(f"{self.label}: reading feed {i} failed "
                                    f"({brief(exc, first_line=True)})") from None
                item = (f"{self.label}: feed {i}", item)
                self.pulled += 1
                if len(self.head) < KEPT_FEEDS:
                    self.head.append(item)
            yield item
            i += 1


# --------------------------------------------------------------------------- the stream
class FeedStream:
    """Validated feeds run one per onnxruntime call, in order; what a `Dataset`
    offers (``batches``, ``num_batches``, ``take``, ``split``, ``num_samples``, ``input_names``,
    ``state``, ``source``), for feeds.

    `batches` yields each feed complete, except a state input after the first feed (the
    runner carries it, `onnx_qat.runtime.stateful`); ``batch_size`` does not apply. ``num_samples``
    counts feeds (None for an iterator not yet read to its end).
    """

    __slots__ = ("_specs", "_items", "_once", "layout", "_initial", "_outputs", "input_names", "source",
                 "state", "_dtypes")

    def __init__(self, items, specs, layout: DataLayout, *, source: str, outputs=None, initial=None):
        self._specs = tuple(specs)
        self._once = items if isinstance(items, _OneShot) else None
        self._items = None if self._once is not None else tuple(items)
        self.layout = layout
        self._initial = dict(initial or {})
        self._outputs = outputs
        self.input_names = tuple(s.name for s in self._specs)
        self.source = source
        self.state = layout.state
        self._dtypes = MappingProxyType({s.name: np.dtype(s.dtype) for s in self._specs})

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_samples(self) -> Optional[int]:
        """The number of feeds (None while an iterator has not been read to its end)."""
        return len(self._items) if self._once is None else self._once.count

    def __len__(self) -> int:
        count = self.num_samples
        if count is None:
            raise TypeError("an iterator of feeds has no length before it is read")
        return count

    def __repr__(self) -> str:
        count = "?" if self.num_samples is None else self.num_samples
        return f"FeedStream({count} feeds; inputs {', '.join(self.input_names)})"

    @property
    def streamed(self) -> bool:
        """True: feeds are read as they are run."""
        return True

    @property
    def rereadable(self) -> bool:
        """Whether `batches` can be run again (a directory or list of feeds), or reads its source once (an
        iterator or ``get_next()`` reader)."""
        return self._once is None

    @property
    def unbatched(self) -> bool:
        """False: each feed is a complete input, batch axis included where the model has one."""
        return False

    @property
    def batch_axis(self):
        """``{input: axis}`` for inputs whose batch axis is not the first (the layout's)."""
        return self.layout.batch_axis

    @property
    def arrays(self):
        """Not available: a stream has feeds, not arrays of samples (DataError)."""
        raise DataError(f"{self.source} is a stream of feeds, not arrays of samples; run it with batches()")

    def batch_size_for(self, batch_size: int) -> int:
        """1: each feed is one run, whatever ``batch_size`` says."""
        return 1

    def num_batches(self, batch_size: int = 1) -> Optional[int]:
        """The number of feeds (None while unknown)."""
        return self.num_samples

    # -- reading -----------------------------------------------------------------------------
    def _raw(self):
        return iter(self._once) if self._once is not None else iter(self._items)

    def batches(self, batch_size: int = 1) -> Iterator[Dict[str, np.ndarray]]:
        """Yield the feeds in order, each validated against the model and converted to its dtypes."""
        check = _FeedCheck(self._specs, self.layout)
        for index, (label, raw) in enumerate(self._raw()):
            if index == 0 and self._initial:
                raw = {**self._initial, **_read(raw, label)}
            yield check(_read(raw, label), index, label)

    def check_headers(self) -> None:
        """Validate every feed of a file list from its headers alone (keys, dtypes, shapes)."""
        if self._items is None:
            return
        check = _FeedCheck(self._specs, self.layout, headers_only=True)
        for index, (label, raw) in enumerate(self._items):
            if index == 0 and self._initial:
                raw = {**self._initial, **_read(raw, label)}
            check(_read(raw, label, headers_only=True), index, label)

    def _with_items(self, items, source: str, initial=None) -> "FeedStream":
        return FeedStream(items, self._specs, self.layout, source=source, outputs=self._outputs,
                          initial=self._initial if initial is None else initial)

    def take(self, n: int) -> "FeedStream":
        """The first ``n`` feeds (all when there are fewer)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise DataError(f"number of feeds must be a whole number >= 1, got {n!r}")
        return self._with_items(tuple(itertools.islice(self._raw(), int(n))), self.source)

    def spread(self, n: int) -> "FeedStream":
        """The first ``n`` feeds, as `take`: a stream is read in order (a stateful model's feeds are a
        sequence), so it is not sampled across (`onnx_qat.io.data.Dataset.spread` is)."""
        return self.take(n)

    def split(self, holdout: float) -> Tuple["FeedStream", "FeedStream"]:
        """``(first, last)``: the last ``holdout`` share of the feeds (at least one) held out.

        An iterator is read into memory here. The held-out part starts from the stream's initial
        state (the first feed's state inputs) and from the scalar or fixed-shape inputs as they
        stand at its first feed.
        """
        items = tuple(self._raw())
        n = len(items)
        if n < 2:
            noun = "feed" if n == 1 else "feeds"
            raise DataError(f"{self.source}: {n} {noun} cannot be split into calibration and evaluation "
                            "data; give more feeds or eval_data (--eval-data)")
        held = max(1, int(round(n * holdout)))
        fixed = {s.name for s in self._specs if _fixed(s)}
        initial = {}
        for index, feed in enumerate(self.batches()):
            if index == 0:
                initial.update((k, v) for k, v in feed.items() if k in self.layout.state_inputs)
            initial.update((k, v) for k, v in feed.items() if k in fixed)
            if index == n - held - 1:
                break
        return (self._with_items(items[:n - held], f"{self.source} (first {n - held} feeds)"),
                self._with_items(items[n - held:], f"{self.source} (last {held} feeds, held out)", initial))

    def bind(self, specs) -> "FeedStream":
        """This stream for a model with inputs ``specs`` (itself when they are the same)."""
        if tuple(specs) == self._specs:
            return self
        stream = FeedStream(self._once if self._once is not None else self._items, specs, self.layout,
                            source=self.source, outputs=self._outputs, initial=self._initial)
        stream.check_headers()
        return stream


def _fixed(spec) -> bool:
    """A scalar or fixed-shape input: given once, used for every feed."""
    return spec.shape is not None and all(d is not None for d in spec.shape)


def _read(raw, label: str, headers_only: bool = False) -> Mapping:
    """A feed's mapping: itself, or the arrays of its ``.npz`` file (headers only: zero-strided stand-ins)."""
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, (str, os.PathLike)):
        from .npz import read_feed

        return read_feed(Path(raw), label, headers_only=headers_only)
    raise DataError(f"{label} is a {type(raw).__name__}; a feed is a dict of input name to array")


class _FeedCheck:
    """Validates the feeds of one run in order, remembering what later feeds may omit."""

    def __init__(self, specs, layout: DataLayout, headers_only: bool = False):
        self.specs, self.layout, self.headers_only = specs, layout, headers_only
        self.names = [s.name for s in specs]
        self.given: Dict[str, np.ndarray] = {}  # scalar and fixed-shape inputs, as last given
        self.batch: Dict[str, Tuple[int, int]] = {}  # stateful: (axis, size) of each batched input
        self.alias: Optional[str] = None  # a single-input model's key, as the first feed named it

    def __call__(self, raw: Mapping, index: int, label: str) -> Dict[str, np.ndarray]:
        if len(self.specs) == 1 and len(raw) == 1:  # any one key, the same in every feed
            (key, value), = raw.items()
            self.alias = key if self.alias is None else self.alias
            if key == self.alias:
                raw = {self.names[0]: value}
        extra = [k for k in raw if k not in self.names]
        if extra:
            raise DataError(f"{label}: key {extra[0]!r} is not a model input "
                            f"(inputs: {', '.join(self.names)})")
        feed: Dict[str, np.ndarray] = {}
        for spec in self.specs:
            name = spec.name
            if name in raw:
                feed[name] = value = self._value(raw[name], spec, label)
                if _fixed(spec):
                    self.given[name] = value
                self._same_batch(spec, value, index, label)
            elif name in self.layout.state_inputs:
                if index == 0:
                    shape = "" if spec.shape is None else \
                        " of shape [" + ", ".join("1" if d is None else str(d) for d in spec.shape) + "]"
                    raise DataError(f"{label}: state input {name!r} is missing: the first feed gives the "
                                    f"initial state (e.g. zeros{shape})")
            elif name in self.given:
                feed[name] = self.given[name]
            else:
                once = " (only scalar and fixed-shape inputs may be given once)" if index else ""
                raise DataError(f"{label}: model input {name!r} is missing (keys: {', '.join(raw) or 'none'})"
                                f"{once}")
        return feed

    def _value(self, value, spec, label: str) -> np.ndarray:
        value = np.asarray(value)
        check_dtype(value.dtype, spec, label)
        if spec.shape is not None:
            want = spec.shape
            if value.ndim != len(want) or any(w is not None and w != h for h, w in zip(value.shape, want)):
                dims = ",".join("N" if d is None else str(d) for d in want)
                raise DataError(f"{label}: key {spec.name!r} has shape {list(value.shape)}, the model input "
                                f"{spec.name!r} needs [{dims}]")
        if self.headers_only:  # zero-strided stand-ins of a file's arrays: no values to check
            return value
        converted = convert(value, np.dtype(spec.dtype), spec.name, label, 0)
        return np.require(converted, requirements="C")

    def _same_batch(self, spec, value: np.ndarray, index: int, label: str) -> None:
        """A stateful model's batch cannot change between feeds: its state carries it."""
        if not self.layout.state or _fixed(spec) or spec.name in self.layout.state_inputs:
            return
        axis = self.layout.axis(spec)
        if axis is None or value.ndim <= axis:
            return
        size = int(value.shape[axis])
        first = self.batch.setdefault(spec.name, (index, size))
        if first[1] != size:
            raise DataError(f"{label}: key {spec.name!r} has {size} on its batch axis {axis}, "
                            f"feed {first[0]} had {first[1]}; a stateful model's batch cannot change "
                            f"between feeds (its state carries it)")


def open_feeds(source, specs, layout: DataLayout, *, what: str = "data", outputs=None) -> FeedStream:
    """Validate a stream of feeds for a model with inputs ``specs`` (see the module docstring).

    Files are checked from their headers, in-memory feeds whole, an iterator's first feed at once
    (the rest as they are read).

    Raises:
        DataError: no feeds, a feed missing an input (or, first, the initial state), a key that is
            not an input, shapes or dtypes that do not fit, shapes that change where the model
            forbids it; one line naming the feed.
        ConfigError: a state or batch-axis name that is not the model's.
    """
    layout.check(specs, outputs)
    label, items, one_shot = _items(source, what)
    if one_shot:
        stream = FeedStream(_OneShot(items, label), specs, layout, source=label, outputs=outputs)
        first = next(iter(stream._once), None)
        if first is None:
            kind = "get_next() returned None at once" if label.endswith("(get_next)") else \
                "the iterator yielded nothing"
            raise DataError(f"{label}: {kind}; give at least one feed")
        next(stream.batches())
        return stream
    if not items:
        raise DataError(f"{label} holds no feeds; give at least one")
    stream = FeedStream(items, specs, layout, source=label, outputs=outputs)
    if all(isinstance(raw, Mapping) for _, raw in items):
        for _ in stream.batches():
            pass
    else:
        stream.check_headers()
    return stream


__all__ = ["FeedStream", "KEPT_FEEDS", "is_feed_source", "open_feeds"]
