"""Calibration / evaluation data: ``.npz`` files, dicts of arrays, arrays, or lists of batches.

The ``.npz`` format: one array per graph input, keyed by the input name, whose
first axis counts samples (``x: float32[N, 3, 32, 32]`` for an input
``x: float32[batch, 3, 32, 32]``). A single-input model accepts one array under any
key. Files are read by :mod:`onnx_qat.io.npz` a batch at a time, never whole and never
unpickled: object arrays are refused from their header.

Contract:

* :func:`load_data` ``(source, model_or_specs, *, what="data") -> Dataset``
* :class:`Dataset` with ``num_samples``, ``input_names``, ``batches(batch_size)``, ``take(n)``
* :func:`generate_data` ``(model_or_specs, num_samples=8, seed=0) -> Dataset``
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError, ModelError, brief
from .npz import MemberReader, NpzMember, read_members

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

    Build it with :func:`load_data` or :func:`generate_data`. Data from an ``.npz`` file
    stays in the file: :meth:`batches` reads one batch at a time, so memory does not grow
    with the number of samples. In-memory arrays are read-only.

    Attributes:
        num_samples: the number of samples (the first axis of every array).
        input_names: the graph input names, in graph order.
        source: where the data came from (for messages).
    """

    __slots__ = ("_columns", "_dtypes", "input_names", "num_samples", "source", "_unbatched", "_fixed_batch")

    def __init__(self, arrays: Mapping[str, np.ndarray], *, source: str = "data",
                 unbatched: Sequence[str] = (), fixed_batch: Optional[int] = None,
                 dtypes: Optional[Mapping[str, np.dtype]] = None):
        names = tuple(arrays)
        if not names:
            raise DataError(f"{source} holds no arrays")
        columns = {name: _read_only(_column(value)) for name, value in arrays.items()}
        counts = {int(c.shape[0]) if len(c.shape) else 0 for c in columns.values()}
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

    @property
    def arrays(self) -> Mapping[str, np.ndarray]:
        """Input name -> read-only array (first axis = samples).

        Data streamed from an ``.npz`` file is read into memory whole here; :meth:`batches`
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
        if self._unbatched:
            return 1
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
                    feed[name] = np.require(chunk[0] if name in self._unbatched else chunk, requirements="C")
                yield feed

    def num_batches(self, batch_size: int) -> int:
        """How many feeds :meth:`batches` yields."""
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
                       unbatched=tuple(self._unbatched), fixed_batch=self._fixed_batch, dtypes=self._dtypes)

    def _raw_columns(self) -> Dict[str, "_ArrayColumn | _FileColumn"]:
        """The columns as stored (files in their own dtype), for validating against other inputs."""
        return dict(self._columns)


def _to_dtype(values: np.ndarray, want: np.dtype) -> np.ndarray:
    """``values`` in dtype ``want`` (already checked to convert safely)."""
    if values.dtype == want:
        return values
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(want)


# --------------------------------------------------------------------------- loading
def load_data(source, model_or_specs, *, what: str = "data") -> Dataset:
    """Load and validate model inputs.

    An ``.npz`` file is not read into memory: its headers are checked, its values are
    checked in one pass of a few megabytes at a time, and the returned dataset reads it
    again batch by batch (:meth:`Dataset.batches`), so memory does not grow with the
    number of samples. Arrays stored column-major (Fortran order) are read whole.

    Args:
        source: a path to an ``.npz`` file (keys = graph input names, first axis =
            samples; a single-input model accepts one array under any key), a mapping
            of input name to array, one array (single-input models), a list of such
            mappings (batches, concatenated), or a :class:`Dataset`.
        model_or_specs: the model (``ModelProto`` or path) or its
            :func:`~onnx_qat.io.models.model_input_specs`.
        what: how to call the data in messages (e.g. ``"calibration data"``).

    Raises:
        DataError: one line naming the file and key: missing or extra keys, sample
            counts that differ, shapes or dtypes that do not fit the model, NaN/Inf
            (with the first sample holding one), zero samples, object arrays,
            unreadable files.
    """
    specs = _specs(model_or_specs)
    if isinstance(source, Dataset):
        columns, label = source._raw_columns(), source.source
    elif isinstance(source, (str, os.PathLike)):
        label = f"{what} {source}"
        columns = _read_npz(Path(source), label)
    elif isinstance(source, np.ndarray):
        label, columns = what, {"<array>": source}
    elif isinstance(source, Mapping):
        label, columns = what, dict(source)
    elif isinstance(source, (list, tuple)) and source and all(isinstance(b, Mapping) for b in source):
        label, columns = what, _concat_batches(source, what)
    else:
        raise DataError(f"{what} must be an .npz path, a dict of arrays, an array or a Dataset; "
                        f"got {type(source).__name__}")
    return _validate(columns, specs, label)


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


def _concat_batches(batches, what: str) -> Dict[str, np.ndarray]:
    keys = tuple(batches[0])
    for i, batch in enumerate(batches):
        if tuple(batch) != keys:
            raise DataError(f"{what}: batch {i} has keys {sorted(batch)}, batch 0 has {sorted(keys)}")
    try:
        return {k: np.concatenate([np.asarray(b[k]) for b in batches], axis=0) for k in keys}
    except ValueError as exc:
        raise DataError(f"{what}: batches cannot be joined ({brief(exc, first_line=True)})") from None


# --------------------------------------------------------------------------- validation
#: Bytes of stored values checked at a time when an ``.npz`` file is validated.
CHECK_CHUNK_BYTES = 4 * 1024 ** 2


def _match_keys(columns: Dict[str, object], specs, label: str) -> Dict[str, object]:
    names = [s.name for s in specs]
    if not columns:
        raise DataError(f"{label} holds no arrays; expected {', '.join(repr(n) for n in names)}")
    if len(specs) == 1 and len(columns) == 1:
        return {names[0]: next(iter(columns.values()))}
    extra = [k for k in columns if k not in names]
    if extra:
        raise DataError(f"{label}: key {extra[0]!r} is not a model input (inputs: {', '.join(names)})")
    missing = [n for n in names if n not in columns]
    if missing:
        keys = ", ".join(columns) or "none"
        raise DataError(f"{label}: model input {missing[0]!r} is missing (keys: {keys})")
    return {n: columns[n] for n in names}


def _validate(columns: Dict[str, object], specs, label: str) -> Dataset:
    """Headers first (keys, dtypes, shapes, counts), then the values of every input."""
    matched = {k: _column(v) for k, v in _match_keys(columns, specs, label).items()}
    unbatched, fixed = [], set()
    for spec in specs:
        column = matched[spec.name]
        _check_dtype(column.dtype, spec, label)
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
    return Dataset(checked, source=label, unbatched=unbatched, fixed_batch=fixed_batch, dtypes=dtypes)


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


def _check_dtype(have: np.dtype, spec, label: str) -> None:
    key, want = spec.name, np.dtype(spec.dtype)
    if have == want:
        return
    if have.kind in "OUSVMm" or have.hasobject:
        raise DataError(f"{label}: key {key!r} has dtype {have}, the model input needs {want}")
    ok = np.can_cast(have, want, "same_kind") or (have.kind in "biu" and want.kind in "fc")
    if want.kind == "b" and have.kind != "b":
        ok = False
    if not ok:
        raise DataError(f"{label}: key {key!r} has dtype {have}, which does not convert safely to the "
                        f"model's {want}; save it as {want}")


def _convert(values: np.ndarray, want: np.dtype, key: str, label: str, first: int) -> np.ndarray:
    """``values`` (samples ``first``...) in the model's dtype, after the range and finiteness checks."""
    if values.dtype.kind in "iu" and want.kind in "iu" and values.size and values.dtype != want:
        info = np.iinfo(want)
        if values.min() < info.min or values.max() > info.max:
            raise DataError(f"{label}: key {key!r} has values outside the range of the model's {want}")
    converted = _to_dtype(values, want)
    _check_finite(converted, key, label, first)
    return converted


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
    expected = ",".join("N" if d is None else str(d) for d in want[1:])
    expected = f"[N{',' if expected else ''}{expected}]" if want else "[N]"
    raise DataError(f"{label}: key {spec.name!r} has shape {list(shape)}, the model input "
                    f"{spec.name!r} needs {expected} (first axis = samples)")


def _dims_fit(have: Tuple[int, ...], want: Tuple[Optional[int], ...]) -> bool:
    return len(have) == len(want) and all(w is None or h == w for h, w in zip(have, want))


def _check_finite(arr: np.ndarray, key: str, label: str, first: int = 0) -> None:
    """One line naming the key and the first sample (counted from ``first``) holding NaN or Inf."""
    if arr.dtype.kind not in "fc" or arr.size == 0:
        return
    finite = np.isfinite(arr)
    if finite.all():
        return
    per_sample = finite.reshape(finite.shape[0], -1) if finite.ndim else finite.reshape(1, -1)
    index = int(np.argmin(per_sample.all(axis=1)))
    sample = np.asarray(arr[index] if arr.ndim else arr)
    bad = int(sample.size - np.count_nonzero(per_sample[index]))
    nan = int(np.count_nonzero(np.isnan(sample)))
    kinds = "NaN" if nan == bad else ("Inf" if nan == 0 else "NaN/Inf")
    raise DataError(f"{label}: key {key!r} has {bad} {kinds} value(s) in sample {first + index}; "
                    f"give finite numbers")


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
