"""What the two worker pools share: the local one (`onnx_qat.runtime.workers.WorkerPool`) and the Ray
one (`onnx_qat.runtime.ray_workers.RayPool`): the worker count check, how a worker answers a failed
unit and how the main process raises it again, and `map` with the context manager."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from ..errors import ConfigError, QatError, WorkerError, brief


def check_workers(workers, what: str = "workers") -> None:
    """Refuse a worker count that is not None or a whole number >= 1."""
    if workers is None:
        return
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"{what} must be a whole number >= 1, got {workers!r}")


def describe_error(exc: BaseException):
    """``(QatError class name or None, one line)``: what a worker answers for a failed unit."""
    if isinstance(exc, QatError):
        return type(exc).__name__, str(exc)
    return None, f"{type(exc).__name__}: {brief(exc, 300)}"


class PoolBase:
    """What `WorkerPool` and `onnx_qat.runtime.ray_workers.RayPool` share: `map` (results in the
    order of the units, read lazily) and the context manager. A pool sets ``name``, ``_closed`` and
    ``units_done``, and implements ``_run(todo, results, on_result)`` and ``close()``."""

    #: what the stopped-pool message calls the members
    members = "worker processes"

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def map(self, units: Iterable, on_result: Optional[Callable[[int, Any], None]] = None, *,
            keep: bool = True) -> list:
        """Every unit's result, in the order of ``units``. ``on_result(index, result)`` is called as
        each result arrives (in any order), e.g. to move a progress bar or to merge results at once.
        ``units`` is read lazily, one unit per free worker (a generator keeps memory bounded); with
        ``keep=False`` results are only handed to ``on_result`` and the list returned is empty."""
        if self._closed:
            raise WorkerError(f"{self.name}: the {self.members} were already stopped")
        results: list = []
        try:
            self._run(iter(enumerate(units)), results if keep else None, on_result)
        except BaseException:
            self._closed = True  # busy workers would answer late: the pool is done
            raise
        return results


def raised_error(kind: Optional[str], text: str) -> Optional[QatError]:
    """The project's own error a worker reported (``kind``: its class name, from `describe_error`)
    rebuilt with its line, or None when it was another exception."""
    if kind is None:
        return None
    from .. import errors

    cls = getattr(errors, kind, None)
    return cls(text) if isinstance(cls, type) and issubclass(cls, QatError) else None


__all__ = ["PoolBase", "check_workers", "describe_error", "raised_error"]
