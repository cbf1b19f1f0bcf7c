"""Calibration / evaluation data: ``.npz`` files, dicts of arrays, arrays, or lists of batches.

The ``.npz`` format: one array per graph input, keyed by the input name, whose
first axis counts samples (``x: float32[N, 3, 32, 32]`` for an input
``x: float32[batch, 3, 32, 32]``). A single-input model accepts one array under any
key. Files are read by `onnx_qat.io.npz` a batch at a time, never whole and never
unpickled: object arrays are refused from their header.

Contract:

* [`load_data`][onnx_qat.io.data.load_data] ``(source, model_or_specs, *, what="data") -> Dataset``
* `Dataset` with ``num_samples``, ``input_names``, ``batches(batch_size)``, ``take(n)``
* `generate_data` ``(model_or_specs, num_samples=8, seed=0) -> Dataset``
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError, ModelError
from .npz import MemberReader, NpzMember, read_members
from .values import announce_cast as _announce_cast, check_dtype as _check_dtype, convert as _convert, \
    to_dtype as _to_dtype

logger = logging.getLogger(__name__)

#: Largest ``.npz`` file read (bytes); larger data should be given as arrays or split.
MAX_NPZ_BYTES = 16 * 1024 ** 3


class _ArrayColumn:
    """One input's samples held in memory (already in the model's dtype)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def head(self, n: int) -> "_ArrayColumn":
        return _ArrayColumn(self.array[:n])

    def open(self) -> "_ArrayReader":
        return _ArrayReader(self.array)


class _ArrayReader(contextlib.AbstractContextManager):
    """Rows of an in-memory array in order (views, no copies)."""

    def __init__(self, array: np.ndarray):
        self.array, self.position = array, 0

    def __exit__(self, *exc_info) -> None:
        return None

    def read(self, count: int) -> np.ndarray:
        rows = self.array[self.position:self.position + count]
        self.position += rows.shape[0]
        return rows


class _FileColumn:
    """One input's samples in an ``.npz`` member, read a batch at a time; the first ``rows`` of them."""

    __slots__ = ("member", "rows")

    def __init__(self, member: NpzMember, rows: Optional[int] = None):
        self.member = member
        self.rows = (member.shape[0] if member.shape else 0) if rows is None else rows

    @property
    def shape(self) -> Tuple[int, ...]:
        if not self.member.shape:
            return ()  # a 0-d array: refused by the shape check
        return (self.rows,) + self.member.shape[1:]

    @property
    def dtype(self) -> np.dtype:
        return self.member.dtype

    def head(self, n: int) -> "_FileColumn":
        return _FileColumn(self.member, min(n, self.rows))

    def open(self) -> MemberReader:
        return self.member.open()


def _column(value) -> "_ArrayColumn | _FileColumn":
    return value if isinstance(value, (_ArrayColumn, _FileColumn)) else _ArrayColumn(np.asarray(value))


def _read_only(column):
    if isinstance(column, _FileColumn):
        return column
    view = column.array.view()
    view.flags.writeable = False
    return _ArrayColumn(view)


class Dataset:
    """Validated model inputs: one array per graph input, first axis = samples.

    Build it with [`load_data`][onnx_qat.io.data.load_data] or `generate_data`. Data from an ``.npz`` file
    stays in the file: `batches` reads one batch at a time, so memory does not grow
    with the number of samples. In-memory arrays are read-only.

    Attributes:
        num_samples: the number of samples (the first axis of every array).
        input_names: the graph input names, in graph order.
        source: where the data came from (for messages).
    """

    __slots__ = ("_columns", "_dtypes", "input_names", "num_samples", "source", "_unbatched", "_fixed_batch",
                 "state", "_constants", "_initial", "_axes")

    def __init__(self, arrays: Mapping[str, np.ndarray], *, source: str = "data",
                 unbatched: Sequence[str] = (), fixed_batch: Optional[int] = None,
                 dtypes: Optional[Mapping[str, np.dtype]] = None, constants: Optional[Mapping] = None,
                 initial: Optional[Mapping] = None, axes: Optional[Mapping[str, int]] = None,
                 state: Optional[Mapping[str, str]] = None):
        constants, initial = dict(constants or {}), dict(initial or {})
        names = tuple(arrays) + tuple(constants) + tuple(initial)
        if not names:
            raise DataError(f"{source} holds no arrays")
        columns = {name: _read_only(_column(value)) for name, value in arrays.items()}
        counts = {int(c.shape[0]) if len(c.shape) else 0 for c in columns.values()} or {1}
        if len(counts) != 1:
            raise DataError(f"{source}: arrays have different sample counts {sorted(counts)}")
        dtypes = dtypes or {}
        self._columns = MappingProxyType(columns)
        self._dtypes = MappingProxyType({n: np.dtype(dtypes.get(n, c.dtype)) for n, c in columns.items()})
        self.input_names = names
        self.num_samples = counts.pop()
        self.source = source
        self._unbatched = frozenset(unbatched)
        self._fixed_batch = fixed_batch
        self._constants = MappingProxyType({k: _frozen(v) for k, v in constants.items()})
        self._initial = MappingProxyType({k: _frozen(v) for k, v in initial.items()})
        self._axes = MappingProxyType(dict(axes or {}))
        self.state = MappingProxyType(dict(state or {}))

    @property
    def constants(self) -> Mapping[str, np.ndarray]:
        """Inputs given once and fed in every run (a 0-d scalar such as a sample rate)."""
        return self._constants

    @property
    def batch_axis(self) -> Mapping[str, int]:
        """``{input: axis}`` for inputs whose batch axis is not the first (where `batches` puts it;
        ``load_data``'s ``batch_axis``)."""
        return self._axes

    @property
    def arrays(self) -> Mapping[str, np.ndarray]:
        """Input name -> read-only array (first axis = samples; an input with a declared batch axis
        has it moved first here). Constants and an initial state are not included.

        Data streamed from an ``.npz`` file is read into memory whole here; `batches`
        is the bounded way to go through it.
        """
        arrays = {}
        for name, column in self._columns.items():
            with column.open() as reader:
                array = _to_dtype(reader.read(column.shape[0]), self._dtypes[name])
            if isinstance(column, _FileColumn):
                array.flags.writeable = False
            arrays[name] = array
        return MappingProxyType(arrays)

    @property
    def streamed(self) -> bool:
        """True when at least one input is read from a file batch by batch."""
        return any(isinstance(c, _FileColumn) for c in self._columns.values())

    @property
    def rereadable(self) -> bool:
        """True: `batches` can be run again (as a directory or list of feeds can, unlike an iterator)."""
        return True

    @property
    def unbatched(self) -> bool:
        """True when the model has no sample axis: each feed holds one sample without it."""
        return bool(self._unbatched)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {self._dtypes[k]}{list(c.shape)}" for k, c in self._columns.items())
        return f"Dataset({self.num_samples} samples; {shapes})"

    def batch_size_for(self, batch_size: int) -> int:
        """The batch size actually fed: 1 for models without a sample axis, the model's fixed batch if any."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise DataError(f"batch size must be a whole number >= 1, got {batch_size!r}")
        if self._unbatched or (self.state and not self._fixed_batch):
            return 1  # a stateful model runs its samples one step at a time
        if self._fixed_batch:
            return self._fixed_batch
        return int(batch_size)

    def batches(self, batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
        """Yield feeds ready for onnxruntime, ``batch_size`` samples each (the last may be smaller).

        Data from an ``.npz`` file is read here, one batch at a time.
        """
        size = self.batch_size_for(batch_size)
        with contextlib.ExitStack() as stack:
            readers = {name: stack.enter_context(c.open()) for name, c in self._columns.items()}
            for start in range(0, self.num_samples, size):
                count = min(size, self.num_samples - start)
                feed = {}
                for name, reader in readers.items():
                    chunk = _to_dtype(reader.read(count), self._dtypes[name])
                    if name in self._axes:
                        chunk = np.moveaxis(chunk, 0, self._axes[name])
                    feed[name] = np.require(chunk[0] if name in self._unbatched else chunk, requirements="C")
                feed.update(self._constants)
                if start == 0:
                    feed.update(self._initial)
                yield feed

    def num_batches(self, batch_size: int) -> int:
        """How many feeds `batches` yields."""
        size = self.batch_size_for(batch_size)
        return -(-self.num_samples // size)

    def take(self, n: int) -> "Dataset":
        """The first ``n`` samples (all when ``n`` is larger)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise DataError(f"number of samples must be a whole number >= 1, got {n!r}")
        n = min(int(n), self.num_samples)
        if self._fixed_batch and n % self._fixed_batch:
            n = max(self._fixed_batch, n - n % self._fixed_batch)
        return Dataset({k: c.head(n) for k, c in self._columns.items()}, source=self.source,
                       **self._same())

    def spread(self, n: int, window: int = 16) -> "Dataset":
        """``n`` samples evenly spread over the first ``window`` x ``n`` (data often comes grouped by
        kind: photos, then pages), read into memory; the first ``n`` for a stateful model, whose
        samples are a sequence, or a model with a fixed batch size."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise DataError(f"number of samples must be a whole number >= 1, got {n!r}")
        if self.state or self._fixed_batch or n >= self.num_samples:
            return self.take(n)
        part = self.take(min(self.num_samples, int(window) * int(n)))
        picked = np.unique(np.linspace(0, part.num_samples - 1, int(n)).round().astype(np.int64))
        arrays = {k: np.ascontiguousarray(v[picked]) for k, v in part.arrays.items()}
        return Dataset(arrays, source=f"{self.source} ({len(picked)} samples spread over {part.num_samples})",
                       **self._same())

    def _same(self) -> dict:
        """The keywords that make a part of this dataset like it."""
        return {"unbatched": tuple(self._unbatched), "fixed_batch": self._fixed_batch, "dtypes": self._dtypes,
                "constants": self._constants, "initial": self._initial, "axes": self._axes,
                "state": self.state}

    def split(self, holdout: float) -> Tuple["Dataset", "Dataset"]:
        """``(first, last)``: the last ``holdout`` share of the samples (at least one; whole fixed
        batches) held out. Both parts keep the constants; a stateful model's held-out part starts
        from the same initial state. The samples are read into memory here.

        Raises:
            DataError: too few samples to split, or a model without a sample axis.
        """
        n = self.num_samples
        fixed = self._fixed_batch or 1  # a model with a fixed batch size takes whole batches of it
        if n < 2 * fixed or self.unbatched:
            noun = "sample" if n == 1 else "samples"
            raise DataError(f"{self.source}: {n} {noun} cannot be split into calibration and evaluation "
                            "data; give more samples or eval_data (--eval-data)")
        held = max(fixed, int(round(n * holdout / fixed)) * fixed)
        arrays = self.arrays
        first = {k: np.ascontiguousarray(v[:n - held]) for k, v in arrays.items()}
        last = {k: np.ascontiguousarray(v[n - held:]) for k, v in arrays.items()}
        return (Dataset(first, source=f"{self.source} (first {n - held} samples)", **self._same()),
                Dataset(last, source=f"{self.source} (last {held} samples, held out)", **self._same()))

    def _raw_columns(self) -> Dict[str, "_ArrayColumn | _FileColumn"]:
        """The columns as stored (files in their own dtype), for validating against other inputs."""
        return dict(self._columns)


def _frozen(value) -> np.ndarray:
    array = np.array(value)  # our own copy, read-only
    array.flags.writeable = False
    return array


# --------------------------------------------------------------------------- loading
def load_data(source, model_or_specs, *, what: str = "data", state: Optional[Mapping[str, str]] = None,
              batch_axis: Optional[Mapping[str, int]] = None) -> Dataset:
    """Load and validate model inputs: samples (an ``.npz`` file, arrays) or a stream of feeds.

    An ``.npz`` file is not read into memory: its headers are checked, its values are
    checked in one pass of a few megabytes at a time, and the returned dataset reads it
    again batch by batch (`Dataset.batches`), so memory does not grow with the
    number of samples. Arrays stored column-major (Fortran order) are read whole.

    An input the model declares 0-d (a sample rate) may be given once as a 0-d array and is fed in
    every run. A stream of feeds (`onnx_qat.io.feeds`: a directory or list of ``.npz`` files, a
    list or iterator of feed dicts, an object with ``get_next()``) gives a
    `FeedStream`, one run per feed.

    Args:
        source: a path to an ``.npz`` file (keys = graph input names, first axis =
            samples; a single-input model accepts one array under any key), a mapping
            of input name to array, one array (single-input models), a stream of feeds
            (see above), a `Dataset`, or any of these with a layout attached by
            `onnx_qat.io.feeds.with_layout`.
        model_or_specs: the model (``ModelProto`` or path) or its
            `model_input_specs`.
        what: how to call the data in messages (e.g. ``"calibration data"``).
        state: ``{output: input}``: a stateful model; each run's output becomes the next run's
            input. The data gives the initial state once (an ``.npz`` key, the first feed), and
            samples then run one per step, in order.
        batch_axis: ``{input: axis}`` for inputs whose batch (sample) axis is not the first.

    Raises:
        DataError: one line naming the file and key: missing or extra keys, sample
            counts that differ, shapes or dtypes that do not fit the model, NaN/Inf
            (with the first sample holding one), zero samples, object arrays,
            unreadable files; for feeds, the feed: no feeds at all, a feed missing an input.
        ConfigError: a state or batch-axis name that is not the model's output or input.
    """
    from .feeds import FeedStream, is_feed_source, open_feeds
    from .layout import make_layout, split_layout

    source, layout = split_layout(source)
    if state is not None or batch_axis is not None:
        layout = make_layout(state if state is not None else layout.state,
                             batch_axis if batch_axis is not None else layout.batch_axis)
    specs = _specs(model_or_specs)
    outputs = _output_names(model_or_specs)
    if isinstance(source, FeedStream):
        if layout.state or layout.batch_axis:
            source = FeedStream(source._once if source._once is not None else source._items, source._specs,
                                layout, source=source.source)
        source.layout.check(specs, outputs)
        return source.bind(specs)
    if is_feed_source(source):
        return open_feeds(source, specs, layout, what=what, outputs=outputs)
    layout.check(specs, outputs)
    if isinstance(source, Dataset):
        columns, label = source._raw_columns(), source.source
        for name, axis in source._axes.items():  # held with the batch axis first: as given again
            columns[name] = np.moveaxis(_whole(columns[name]), 0, axis)
        columns.update(source._constants)
        columns.update(source._initial)
    elif isinstance(source, (str, os.PathLike)):
        label = f"{what} {source}"
        columns = _read_npz(Path(source), label)
    elif isinstance(source, np.ndarray):
        label, columns = what, {"<array>": source}
    elif isinstance(source, Mapping):
        label, columns = what, dict(source)
    else:
        raise DataError(f"{what} must be an .npz path, a dict of arrays, an array or a Dataset; "
                        f"got {type(source).__name__}")
    if isinstance(source, Dataset) and not (layout.state or layout.batch_axis):
        layout = _layout_of(source)
    return _validate(columns, specs, label, layout, announce=not isinstance(source, Dataset))


def _layout_of(dataset: Dataset):
    from .layout import make_layout

    return make_layout(dataset.state, dataset._axes)


def _output_names(model_or_specs) -> Optional[Tuple[str, ...]]:
    """The model's output names; None when only input specs were given."""
    import onnx

    from .models import InputSpec

    if isinstance(model_or_specs, (list, tuple)) and all(isinstance(s, InputSpec) for s in model_or_specs):
        return None
    if isinstance(model_or_specs, onnx.ModelProto):
        return tuple(o.name for o in model_or_specs.graph.output)
    return None


def _specs(model_or_specs):
    from .models import InputSpec, model_input_specs

    if isinstance(model_or_specs, (list, tuple)) and all(isinstance(s, InputSpec) for s in model_or_specs):
        specs = tuple(model_or_specs)
    else:
        specs = model_input_specs(model_or_specs)
    if not specs:
        raise ModelError("the model has no graph inputs to feed")
    return specs


def _read_npz(path: Path, label: str) -> Dict[str, _FileColumn]:
    """The archive's members as streamed columns (headers checked, no values read yet)."""
    if not path.exists():
        raise DataError(f"{label} does not exist")
    if path.is_dir():
        raise DataError(f"{label} is a directory; give an .npz file")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{label} is empty (0 bytes); give an .npz file of arrays")
    if size > MAX_NPZ_BYTES:
        raise DataError(f"{label} is {size} bytes, over the {MAX_NPZ_BYTES}-byte limit")
    with open(path, "rb") as handle:
        magic = handle.read(6)
    if magic.startswith(b"\x93NUMPY"):
        raise DataError(f"{label} is a single .npy array, not an .npz archive; save it with np.savez")
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        if magic[:1] == b"\x80":
            raise DataError(f"{label} holds pickled data, which is never loaded; save plain numeric arrays "
                            f"with np.savez")
        raise DataError(f"{label} is not an .npz archive; save the arrays with np.savez")
    return {key: _FileColumn(member) for key, member in read_members(path, label).items()}


# --------------------------------------------------------------------------- validation
#: Bytes of stored values checked at a time when an ``.npz`` file is validated.
CHECK_CHUNK_BYTES = 4 * 1024 ** 2


def _match_keys(columns: Dict[str, object], specs, label: str, announce: bool = False) -> Dict[str, object]:
    names = [s.name for s in specs]
    if not columns:
        raise DataError(f"{label} holds no arrays; expected {', '.join(repr(n) for n in names)}")
    if len(specs) == 1 and len(columns) == 1:
        key = next(iter(columns))
        if announce and key != names[0] and key != "<array>":
            logger.warning("%s: key %r is read as the model's only input %r", label, key, names[0])
        return {names[0]: columns[key]}
    extra = [k for k in columns if k not in names]
    if extra:
        raise DataError(f"{label}: key {extra[0]!r} is not a model input (inputs: {', '.join(names)})")
    missing = [n for n in names if n not in columns]
    if missing:
        keys = ", ".join(columns) or "none"
        raise DataError(f"{label}: model input {missing[0]!r} is missing (keys: {keys})")
    return {n: columns[n] for n in names}


def _validate(columns: Dict[str, object], specs, label: str, layout=None, announce: bool = False) -> Dataset:
    """Headers first (keys, dtypes, shapes, counts), then the values of every input. ``announce``:
    say (one warning line each) when a key is renamed or a dtype converted."""
    from .layout import DataLayout

    layout = layout or DataLayout()
    matched = {k: _column(v) for k, v in _match_keys(columns, specs, label, announce).items()}
    once, axes = {"constants": {}, "initial": {}}, {}
    for spec in list(specs):
        column = matched[spec.name]
        state = spec.name in layout.state_inputs
        if state or (spec.shape == () and column.shape == ()):
            once["initial" if state else "constants"][spec.name] = _given_once(column, spec, label)
            del matched[spec.name]
            continue
        axis = layout.axis(spec)
        if axis:
            matched[spec.name] = _ArrayColumn(np.moveaxis(_whole(column), axis, 0))
            axes[spec.name] = axis
    specs = [_moved(s, axes[s.name]) if s.name in axes else s for s in specs if s.name in matched]
    if not specs:  # every input given once: one run
        dtypes = {k: np.dtype(v.dtype) for d in once.values() for k, v in d.items()}
        return Dataset({}, source=label, dtypes=dtypes, state=layout.state, **once)
    unbatched, fixed = [], set()
    for spec in specs:
        column = matched[spec.name]
        _check_dtype(column.dtype, spec, label)
        if announce and column.dtype != np.dtype(spec.dtype):
            _announce_cast(column.dtype, np.dtype(spec.dtype), spec.name, label)
        mode = _fit_shape(column.shape, spec, label)
        if mode == "unbatched":
            unbatched.append(spec.name)
        elif spec.shape and spec.shape[0] is not None:
            fixed.add(spec.shape[0])
    counts = {k: c.shape[0] for k, c in matched.items()}
    if len(set(counts.values())) != 1:
        detail = ", ".join(f"{k}: {n}" for k, n in counts.items())
        raise DataError(f"{label}: inputs have different sample counts ({detail})")
    count = next(iter(counts.values()))
    if count == 0:
        raise DataError(f"{label} has zero samples; give at least one")
    fixed_batch = _fixed_batch(fixed, unbatched, count, label)
    checked = {spec.name: _check_values(matched[spec.name], spec, label) for spec in specs}
    dtypes = {spec.name: np.dtype(spec.dtype) for spec in specs}
    return Dataset(checked, source=label, unbatched=unbatched, fixed_batch=fixed_batch, dtypes=dtypes,
                   axes=axes, state=layout.state, **once)


def _whole(column) -> np.ndarray:
    """All of a column's values in memory (a file member read whole, 0-d included)."""
    if isinstance(column, _ArrayColumn):
        return column.array
    member = column.member
    if not member.shape:
        import zipfile

        from numpy.lib import format as npy_format

        with zipfile.ZipFile(member.path) as archive, archive.open(member.member) as stream:
            return npy_format.read_array(stream, allow_pickle=False)
    with column.open() as reader:
        return reader.read(column.shape[0])


def _moved(spec, axis: int):
    """``spec`` with its batch axis ``axis`` moved first (as the data is held)."""
    from .models import InputSpec

    shape = list(spec.shape)
    shape.insert(0, shape.pop(axis))
    return InputSpec(spec.name, spec.dtype, tuple(shape))


def _given_once(column, spec, label: str) -> np.ndarray:
    """An input given once (a 0-d constant, a stateful model's initial state): its shape is the
    model input's own, fed as it is."""
    value = _whole(column)
    _check_dtype(value.dtype, spec, label)
    if spec.shape is not None and (value.ndim != len(spec.shape) or any(
            w is not None and w != h for h, w in zip(value.shape, spec.shape))):
        dims = ",".join("N" if d is None else str(d) for d in spec.shape)
        raise DataError(f"{label}: key {spec.name!r} has shape {list(value.shape)}; it is given once (a "
                        f"scalar or the initial state) and needs the model input's shape [{dims}]")
    converted = _convert(np.asarray(value), np.dtype(spec.dtype), spec.name, label, 0)
    return np.require(converted, requirements="C")


def _fixed_batch(fixed: set, unbatched: list, count: int, label: str) -> Optional[int]:
    if unbatched or not fixed:
        return None
    if len(fixed) > 1:
        raise DataError(f"{label}: the model's inputs have different fixed batch sizes {sorted(fixed)}")
    size = fixed.pop()
    if count % size:
        raise DataError(f"{label}: {count} samples do not split into the model's fixed batch size {size}")
    return size


def _check_values(column, spec, label: str):
    """An in-memory column converted to the model's dtype; a file column checked in chunks, left in place."""
    want = np.dtype(spec.dtype)
    if isinstance(column, _ArrayColumn):
        return _convert(column.array, want, spec.name, label, 0)
    rows = max(1, CHECK_CHUNK_BYTES // max(1, column.member.row_nbytes))
    with column.open() as reader:
        for start in range(0, column.shape[0], rows):
            _convert(reader.read(rows), want, spec.name, label, start)
    return column


def _fit_shape(shape: Tuple[int, ...], spec, label: str) -> str:
    """'batched' (first axis = the model's batch axis) or 'unbatched' (model has no sample axis)."""
    shape = tuple(shape)
    if spec.shape is None:
        if len(shape) < 1:
            raise DataError(f"{label}: key {spec.name!r} needs a first axis of samples")
        return "batched"
    want = spec.shape
    if want and len(shape) == len(want) and _dims_fit(shape[1:], want[1:]):
        return "batched"
    if len(shape) == len(want) + 1 and _dims_fit(shape[1:], want):
        return "unbatched"
    expected = ",".join(spec.dim_label(axis) for axis in range(1, len(want)))
    expected = f"[N{',' if expected else ''}{expected}]" if want else "[N]"
    raise DataError(f"{label}: key {spec.name!r} has shape {list(shape)}, the model input "
                    f"{spec.name!r} needs {expected} (first axis = samples)")


def _dims_fit(have: Tuple[int, ...], want: Tuple[Optional[int], ...]) -> bool:
    return len(have) == len(want) and all(w is None or h == w for h, w in zip(have, want))


# --------------------------------------------------------------------------- generation
def generate_data(model_or_specs, num_samples: int = 8, seed: int = 0) -> Dataset:
    """Random inputs for a model: normal floats, small integers, random booleans.

    Symbolic dimensions become 1; the first axis counts ``num_samples`` samples
    (rounded up to a multiple of a fixed batch size). Deterministic for a given seed.
    """
    specs = _specs(model_or_specs)
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise DataError(f"number of samples must be a whole number >= 1, got {num_samples!r}")
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in specs:
        if spec.shape is None:
            raise DataError(f"model input {spec.name!r} has an unknown rank; give data for it")
        arrays[spec.name] = _random_array(rng, spec, int(num_samples))
    return _validate(arrays, specs, "generated data")


def _random_array(rng: np.random.Generator, spec, num_samples: int) -> np.ndarray:
    shape = spec.shape
    if not shape:
        dims = (num_samples,)
    else:
        batch = shape[0]
        count = num_samples if batch is None or batch == 1 else -(-num_samples // batch) * batch
        dims = (count,) + tuple(1 if d is None else d for d in shape[1:])
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "b":
        return rng.random(dims) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0, 8, size=dims).astype(dtype)
    if dtype.kind in "fc":
        return rng.standard_normal(dims).astype(dtype)
    raise DataError(f"model input {spec.name!r} has dtype {dtype}; give data for it")


__all__ = ["Dataset", "load_data", "generate_data", "MAX_NPZ_BYTES"]
