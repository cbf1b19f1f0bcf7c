"""Read ``.npz`` archives a few rows at a time, never unpickling.

An ``.npz`` file is a zip archive of ``.npy`` members. ``np.load(..., mmap_mode=...)``
cannot map a member, and reading one with ``np.load`` holds all of it in memory; here
each member's ``.npy`` header is parsed on its own (``numpy.lib.format``, a Python
literal, never a pickle) and its rows are then read in order, as many as asked for, so
memory stays bounded by one batch whatever the number of samples. Compressed members
(``np.savez_compressed``) are decompressed sequentially, which is just as bounded.

* `read_members` ``(path, label) -> {key: NpzMember}`` — headers only.
* `NpzMember.open` — a `MemberReader` whose `read` yields rows.
* `read_feed` ``(path, label) -> {key: array}`` — a small archive holding one feed, read whole.

Errors are [`DataError`][onnx_qat.errors.DataError] lines naming ``label`` and the key.
Object (pickled) arrays are refused from their header, before any of their bytes is read.
"""
from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
from numpy.lib import format as npy_format

from ..errors import DataError, brief

#: Reads larger than this go piece by piece, so a header claiming more than the file holds costs nothing.
_PIECE_BYTES = 64 * 1024 ** 2
#: ``.npy`` header versions whose header this reader parses (3.0 only adds UTF-8 field names).
_HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


@dataclass(frozen=True)
class NpzMember:
    """One ``.npy`` member of an ``.npz`` archive, described by its header.

    Attributes:
        path: the archive.
        member: the member's name inside the zip (``"x.npy"``).
        key: the array's key (``"x"``), as ``np.load`` names it.
        shape: the array's shape.
        dtype: the stored dtype (possibly non-native byte order).
        fortran_order: True when the array was stored column-major (its rows are then not
            contiguous: `MemberReader.read` reads the whole member once).
        label: how to call the archive in messages.
    """

    path: Path
    member: str
    key: str
    shape: Tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    label: str

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (one index of the first axis)."""
        return int(math.prod(self.shape[1:])) * self.dtype.itemsize

    def open(self) -> "MemberReader":
        """A reader positioned at row 0 (use it as a context manager)."""
        return MemberReader(self)


class MemberReader:
    """Sequential row reader of one `NpzMember` (a context manager).

    `read` returns the next ``count`` rows as a new array of the stored dtype.
    """

    def __init__(self, member: NpzMember):
        self.member = member
        self._zip: Optional[zipfile.ZipFile] = None
        self._stream = None
        self._whole: Optional[np.ndarray] = None
        self.position = 0
        try:
            self._zip = zipfile.ZipFile(member.path)
            self._stream = self._zip.open(member.member)
            header = _read_header(self._stream)
        except DataError as exc:
            self.close()
            raise DataError(f"{member.label}: key {member.key!r} {exc}") from None
        except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
            self.close()
            raise _unreadable(member.label, member.key, exc) from None
        if header != (member.shape, member.fortran_order, member.dtype):
            self.close()
            raise DataError(f"{member.label}: key {member.key!r} changed while it was being read; "
                            f"read it again")

    def __enter__(self) -> "MemberReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Release the file handles (idempotent)."""
        for handle in (self._stream, self._zip):
            if handle is not None:
                handle.close()
        self._stream = self._zip = None

    def read(self, count: int) -> np.ndarray:
        """The next ``count`` rows (fewer at the end of the array)."""
        member = self.member
        count = max(0, min(int(count), member.shape[0] - self.position))
        if member.fortran_order:
            rows = self._whole_array()[self.position:self.position + count].copy()
        else:
            rows = self._read_rows(count)
        self.position += count
        return rows

    def _read_rows(self, count: int) -> np.ndarray:
        member = self.member
        size = count * member.row_nbytes
        try:
            if size <= _PIECE_BYTES:
                buffer = bytearray(size)
                got = self._stream.readinto(buffer) if size else 0
            else:  # memory follows the bytes really there, not what a header claims
                buffer = bytearray()
                while len(buffer) < size:
                    piece = self._stream.read(min(_PIECE_BYTES, size - len(buffer)))
                    if not piece:
                        break
                    buffer += piece
                got = len(buffer)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise _unreadable(member.label, member.key, exc) from None
        if got != size:
            raise _truncated(member.label, member.key, member.shape)
        return np.frombuffer(buffer, dtype=member.dtype).reshape((count,) + member.shape[1:])

    def _whole_array(self) -> np.ndarray:
        if self._whole is None:
            member = self.member
            try:
                with self._zip.open(member.member) as stream:
                    self._whole = npy_format.read_array(stream, allow_pickle=False)
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
                raise _unreadable(member.label, member.key, exc) from None
        return self._whole


def read_members(path: Path, label: str) -> Dict[str, NpzMember]:
    """Every member of the archive at ``path``, described by its header (no data is read).

    Raises:
        DataError: not a zip archive, a member that is not an ``.npy`` array, an object
            (pickled) array, a header that cannot be parsed.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [info.filename for info in archive.infolist() if not info.is_dir()]
            return {_key(name): _describe(archive, path, name, label) for name in names}
    except DataError:
        raise
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise DataError(f"{label} is not a readable .npz archive ({brief(exc, first_line=True)})") from None


def _key(member: str) -> str:
    return member[:-4] if member.endswith(".npy") else member


def _describe(archive: zipfile.ZipFile, path: Path, name: str, label: str) -> NpzMember:
    key = _key(name)
    if not name.endswith(".npy"):
        raise DataError(f"{label}: key {key!r} is not an .npy array; save the arrays with np.savez")
    info = archive.getinfo(name)
    try:
        with archive.open(info) as stream:
            shape, fortran_order, dtype = _read_header(stream)
            data_bytes = info.file_size - stream.tell()
    except DataError as exc:
        raise DataError(f"{label}: key {key!r} {exc}") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _unreadable(label, key, exc) from None
    if dtype.hasobject:
        raise DataError(f"{label}: key {key!r} is an object (pickled) array, which is never loaded; "
                        f"save plain numeric arrays")
    if math.prod(shape) * dtype.itemsize > data_bytes:
        raise _truncated(label, key, shape)
    return NpzMember(Path(path), name, key, shape, dtype, fortran_order, label)


def _read_header(stream) -> Tuple[Tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the ``.npy`` stream, left positioned at its data."""
    version = npy_format.read_magic(stream)
    reader = _HEADER_READERS.get(version)
    if reader is None:
        raise DataError(f"uses .npy format version {version[0]}.{version[1]}, which is not read; "
                        f"save plain numeric arrays with np.savez")
    shape, fortran_order, dtype = reader(stream)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return tuple(int(d) for d in shape), bool(fortran_order), np.dtype(dtype)


def _truncated(label: str, key: str, shape: Tuple[int, ...]) -> DataError:
    return DataError(f"{label}: key {key!r} is truncated: its header promises {shape[0] if shape else 1} "
                     f"samples of shape {list(shape[1:])}")


def _unreadable(label: str, key: str, exc: BaseException) -> DataError:
    return DataError(f"{label}: key {key!r} cannot be read ({brief(exc, first_line=True)})")


def read_feed(path: Path, label: str, *, headers_only: bool = False) -> Dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file holding one feed (0-d arrays included), read whole.

    With ``headers_only`` no value is read: each array is a zero-strided stand-in of its shape and
    dtype (for checking a list of files before any is run).

    Raises:
        DataError: as `read_members`; a file that is not an ``.npz`` archive or holds none.
    """
    if not path.is_file():
        raise DataError(f"{label} does not exist")
    with open(path, "rb") as handle:
        magic = handle.read(6)
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        raise DataError(f"{label} is not an .npz archive; save each feed with np.savez")
    members = read_members(path, label)
    if not members:
        raise DataError(f"{label} holds no arrays")
    if headers_only:
        return {key: np.broadcast_to(np.zeros((), m.dtype.newbyteorder("=")), m.shape)
                for key, m in members.items()}
    arrays = {}
    for key, member in members.items():
        try:
            with zipfile.ZipFile(path) as archive, archive.open(member.member) as stream:
                array = npy_format.read_array(stream, allow_pickle=False)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise _unreadable(label, key, exc) from None
        if array.shape != member.shape or array.dtype != member.dtype:
            raise DataError(f"{label}: key {key!r} changed while it was being read; read it again")
        arrays[key] = array
    return arrays


__all__ = ["NpzMember", "MemberReader", "read_members", "read_feed"]
