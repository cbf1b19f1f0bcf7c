"""Safe file handling shared by every writer and reader in the project.

* Outputs are written to a temporary file in the target directory and renamed
  into place only when complete (``os.replace`` is atomic on one file system),
  so an interrupted run never leaves a half-written file where a good one was
  expected.
* Output paths are checked before any work: not a directory, parent exists and
  is writable, not the same file as an input.
* JSON inputs are read with a size bound.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import tempfile
import threading
from pathlib import Path, PurePath
from typing import Iterator, Union

from ..errors import OutputError, QatError

PathLike = Union[str, os.PathLike]

#: Largest JSON document (ScaleTable, report) we agree to parse.
MAX_JSON_BYTES = 64 * 1024 * 1024


def check_output_path(path: PathLike, *, inputs: tuple = (), what: str = "output") -> Path:
    """Validate an output path before any work is done and return it as a ``Path``.

    Raises [`OutputError`][onnx_qat.errors.OutputError] when the path is a directory, its directory is
    missing or not writable, or it names the same file as one of ``inputs``.
    """
    out = Path(path)
    if str(path) == "":
        raise OutputError(f"{what} path is empty")
    if out.is_dir():
        raise OutputError(f"{what} path {out} is a directory; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{what} directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} directory {parent} is not writable")
    for inp in inputs:
        if inp is None or not isinstance(inp, (str, os.PathLike)):
            continue
        try:
            same = Path(inp).exists() and out.exists() and os.path.samefile(inp, out)
        except OSError:
            same = False
        if same or Path(inp).resolve() == out.resolve():
            raise OutputError(
                f"{what} path {out} is the input file; choose another name so the input is kept")
    return out


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM until the block ends (main thread only; elsewhere a no-op).

    Used where a file is created or renamed and its clean-up must be registered in
    the same step, so an interrupt cannot land in between. The signals are recorded
    by a temporary handler (masking would not do: another thread of the process may
    take the signal) and the first one is delivered to the previous handler on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda num, frame: pending.append(num))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            _deliver(pending[0], previous[pending[0]])


def check_output_and_report(output, report, *, inputs: tuple = ()):
    """``(output path or None, report path or None)``, both checked by `check_output_path` before any
    work (``inputs``: the paths among the caller's inputs); a ConfigError when they name one file."""
    import os

    from ..errors import ConfigError

    paths = tuple(p for p in inputs if isinstance(p, (str, os.PathLike)))
    out_path = None if output is None else check_output_path(output, inputs=paths, what="output")
    report_path = None if report is None else check_output_path(report, inputs=paths, what="report")
    if out_path is not None and report_path is not None and report_path.resolve() == out_path.resolve():
        raise ConfigError("report and output name the same file")
    return out_path, report_path


def _deliver(signum: int, handler) -> None:
    """Hand a deferred signal to the handler that was in place when it arrived."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


def make_temp_beside(target: Path) -> tuple:
    """Create ``.<name>.*.partial`` beside ``target``; return ``(fd, path)``.

    Call inside `signals_held` together with registering the path for clean-up.
    """
    try:
        return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=str(target.parent or "."))
    except OSError as exc:
        raise OutputError(f"{target} cannot be written: {exc.strerror or exc}") from None


@contextlib.contextmanager
def atomic_output(path: PathLike, mode: str = "wb") -> Iterator:
    """Open a temporary file beside ``path``; rename it onto ``path`` only on success.

    On any exception (including KeyboardInterrupt) the temporary file is removed
    and ``path`` is left as it was.
    """
    out = Path(path)
    tmp = None
    try:
        with signals_held():  # no interrupt between creating the file and owning its clean-up
            fd, tmp = make_temp_beside(out)
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, QatError):
            raise OutputError(f"{out} cannot be written: {exc.strerror or exc}") from None
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and return the path."""
    with atomic_output(path, "wb") as handle:
        handle.write(data)
    return Path(path)


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and return the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_safe(obj):
    """A JSON-ready copy of ``obj``: the one sanitiser every report and ``--json`` output goes through.

    Non-finite floats become the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (JSON has no such
    numbers); NumPy scalars become Python numbers; tuples, lists and sets become lists (sets sorted);
    dictionary keys become strings; paths become strings; an object with ``to_dict()`` is replaced by
    its dictionary. Anything else is returned as it is (``json`` then refuses what it cannot write).
    """
    if hasattr(obj, "to_dict") and not isinstance(obj, type):
        obj = obj.to_dict()
    if type(obj).__module__ == "numpy" and getattr(obj, "shape", None) == ():
        obj = obj.item()  # a NumPy scalar
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if obj != obj else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [json_safe(v) for v in sorted(obj)]
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


def dumps_json(obj) -> str:
    """``obj`` as stable, indented JSON (sorted keys), sanitised by `json_safe`."""
    return json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False)


def write_json(path: PathLike, obj) -> Path:
    """Write ``obj`` as stable, indented JSON (sorted keys, `json_safe`) atomically."""
    return atomic_write_text(path, dumps_json(obj) + "\n")


def read_json(path: PathLike, *, what: str = "JSON file", error: type = QatError,
              max_bytes: int = MAX_JSON_BYTES):
    """Read a JSON document with a size bound; every failure is ``error`` with one line."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} does not exist" if not p.exists() else f"{what} {p} is not a file")
    size = p.stat().st_size
    if size > max_bytes:
        raise error(f"{what} {p} is {size} bytes, over the {max_bytes}-byte limit")
    try:
        text = p.read_bytes().decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{what} {p} is not valid JSON: {exc}") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")
