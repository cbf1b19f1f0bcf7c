"""The same work units on a Ray cluster: one Ray actor per worker, the job sent once through Ray's
object store.

`RayPool` has `WorkerPool`'s interface (``map``, ``close``, a context manager) and
its guarantees: units go one at a time to whichever actor is free, results come back in the order of
the units, a unit failing with one of the project's errors surfaces as that error and anything else
as a one-line `WorkerError`. Each actor is started with ``num_cpus=threads`` (one by default); it
unpickles the job and calls its ``start(threads)`` once, then answers units.

`connect` joins a cluster: ``ray=True`` (``--ray`` without an address) is ``ray.init()``: the
cluster ``RAY_ADDRESS`` names, else a new local one (which the pool shuts down when it closes, or,
inside `shared_cluster`, the outermost scope when it ends: one call's pools share one cluster); an
address (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``) is ``ray.init(address=...)``. Either way
the job's runtime environment uploads the ``onnx_qat`` package (``py_modules``), so the cluster's
nodes need NumPy, onnx and onnxruntime but not onnx_qat. When Ray is already initialized in this
process (``ray.init(...)`` called by the user) that cluster is used as it is and left running: its
workers must then import onnx_qat themselves (installed there, or the user's own runtime
environment). Ray is an optional dependency (``pip install onnx-qat[ray]``), imported only here.

The main process waits on ``ray.wait`` in short slices, so SIGINT/SIGTERM unwind it at once; the
actors are killed on the way out (`RayPool.close`). `connect` runs ``ray.init`` on a thread of its
own (`_Starter`) while the caller's thread waits in slices with its SIGINT and SIGTERM handlers in
place, and keeps Ray's own handlers out; a handler's exception comes out of Ray's calls as itself
(`_unwinding`). A local cluster an interrupted run started is killed: every process below the
ones ``ray.init`` started, read from ``/proc`` (`_ClusterProcesses`; the raylet's agents,
``DashboardAgent`` and ``RuntimeEnvAgent``, outlive a killed raylet by seconds on a loaded machine),
then ``ray.shutdown`` gets `INTERRUPTED_SHUTDOWN` seconds on a daemon thread. A normal end shuts the
cluster down with ``ray.shutdown`` first and kills what of it is left.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from ..errors import QatError, WorkerError, brief
from .pool_base import PoolBase, check_workers, describe_error, raised_error

logger = logging.getLogger(__name__)

#: Seconds the main process waits on the actors between chances to handle a signal.
SLICE = 0.05


def ray_module():
    """``ray``, or a one-line `WorkerError` when it is not installed."""
    try:
        import ray
    except ImportError:
        raise WorkerError("--ray needs Ray, which is not installed: pip install 'onnx-qat[ray]' "
                          "(pinned in constraints.txt)") from None
    return ray


def connect(address) -> Optional["_ClusterProcesses"]:
    """Join (or start) the Ray cluster ``address`` names (see the module docstring). When this call
    started Ray in this process, the record of the processes it started (`_ClusterProcesses`: the caller
    shuts the cluster down with `_stop_started`); None when Ray was initialized already. ``ray.init``
    runs on a thread of its own (`_Starter`) while this one waits with the caller's SIGINT and SIGTERM
    handlers in place, so a signal during the start unwinds the caller at once."""
    ray = ray_module()
    local = address in (True, "", None)
    if not local:
        _check_reachable(address)
    if ray.is_initialized():
        return None
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # onnx_qat, for the actors
    handlers = _signal_handlers()
    started = _ClusterProcesses(_ClusterProcesses.children())
    starter = _Starter(ray, dict(**({} if local else {"address": address}), include_dashboard=False,
                                 log_to_driver=False, logging_level=logging.ERROR,
                                 runtime_env={"py_modules": [package]}))
    started.starter = starter
    try:
        starter.wait()
        started.record()
        error = starter.error
    except BaseException:
        started.record()
        if _interrupted():  # a signal during the start: stop what it started so far (its agents too)
            _stop_started(ray, started, interrupted=True)
        else:
            starter.release.set()
        raise
    finally:
        _restore_signal_handlers(handlers)
    if error is not None:
        starter.release.set()
        where = "start a local Ray cluster" if local else f"connect to the Ray cluster at {address}"
        raise WorkerError(f"cannot {where}: {brief(error, 200)}") from None
    return started


class _Starter:
    """``ray.init(**options)`` on a thread of its own, which then stays until `release` is set (by
    `_stop_started`). Ray starts the local cluster's processes tied to the thread that started them
    (``PR_SET_PDEATHSIG`` on Linux fires when that thread ends), so the thread outlives the work; and
    ``ray.init`` on the caller's thread blocked the caller's signal handlers for the 2-3 s of the start.
    While it runs, Ray's ``set_sigterm_handler`` does nothing (off the main thread ``signal.signal``
    would fail, and Ray's handlers are the ones `connect` keeps out) and Ray's native failure signal
    handler, which printed a stack dump on SIGTERM, is not installed in this process
    (``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, for that call)."""

    def __init__(self, ray, options: dict):
        self.error: Optional[BaseException] = None
        self.ready, self.release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ray, options), name="ray-start", daemon=True)
        self._thread.start()

    def _run(self, ray, options: dict) -> None:
        private = getattr(ray, "_private", None)
        utils, constants = getattr(private, "utils", None), getattr(private, "ray_constants", None)
        ray_setter = getattr(utils, "set_sigterm_handler", None)
        dump = getattr(constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
        try:
            if ray_setter is not None:
                utils.set_sigterm_handler = lambda handler: None
            if dump is not None:
                constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
            ray.init(**options)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc
        finally:
            if ray_setter is not None:
                utils.set_sigterm_handler = ray_setter
            if dump is not None:
                constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = dump
            self.ready.set()
        self.release.wait()

    def wait(self) -> None:
        """Until ``ray.init`` has returned, in slices of `SLICE` seconds (a signal unwinds the caller)."""
        while not self.ready.wait(SLICE):
            pass


#: The signals whose handlers `connect` keeps as the caller set them.
_SIGNALS = ("SIGINT", "SIGTERM")


def _signal_handlers() -> dict:
    """``{signal number: Python handler}`` of `_SIGNALS` (empty off the main thread: none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    found = {}
    for name in _SIGNALS:
        number = getattr(signal, name, None)
        handler = None if number is None else signal.getsignal(number)
        if handler is not None:
            found[number] = handler
    return found


def _restore_signal_handlers(handlers: dict) -> None:
    """Set the handlers `_signal_handlers` read before ``ray.init`` (or ``ray.shutdown``) again. On the
    main thread ``ray.init`` replaced the Python SIGTERM handler with ``sys.exit``, and Ray's core worker
    installs a native handler that aborts the process on SIGTERM (exit by SIGABRT, no clean-up, measured
    with Ray 2.60); `_Starter` keeps both out where its Ray has the hooks it uses, and this covers a Ray
    without them and ``ray.shutdown``, which sets SIGTERM's native handler back to the default. Setting
    the Python handlers again puts back the native handler that runs them, so a signal unwinds the
    caller as before (the CLI: exit 130 or 143, nothing written, the pool closed on the way out)."""
    for number, handler in handlers.items():
        try:
            signal.signal(number, handler)
        except (OSError, ValueError, TypeError):  # not settable here: leave Ray's
            pass


#: Seconds to wait for a cluster address to accept a connection before giving up.
CONNECT_TIMEOUT = 5.0


def _check_reachable(address: str) -> None:
    """Fail at once, in one line, when ``HOST:PORT`` (or ``ray://HOST:PORT``) accepts no connection
    (``ray.init`` itself retries for minutes). Other forms (``auto``) are left to Ray."""
    import socket

    where = address[len("ray://"):] if address.startswith("ray://") else address
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise WorkerError(f"cannot connect to the Ray cluster at {address}: "
                          f"{exc.strerror or type(exc).__name__}") from None


def cluster_cpus() -> int:
    """The CPUs of the cluster Ray is connected to (at least 1)."""
    ray = ray_module()
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


class _Actor:
    """One worker on the cluster: the job's ``start(threads)`` once, then units."""

    def __init__(self, blob: bytes, threads: int):
        self.run = pickle.loads(blob).start(threads)

    def unit(self, unit):
        try:
            return "ok", self.run(unit)
        except Exception as exc:  # noqa: BLE001 - answered as one line
            return ("error", *describe_error(exc))


class RayPool(PoolBase):
    """``workers`` Ray actors running one job's units (see the module docstring).

    Args:
        job: a picklable object whose ``start(threads)`` returns the function each unit is given to.
        workers: actors to start (None: the cluster's CPUs divided by ``threads``, at most ``units``).
        address: what `connect` joins.
        threads: onnxruntime intra-op threads of each actor (and its ``num_cpus``; default 1).
        name: what messages call the work.
        units: how many units will come, when known (bounds the default count).
    """

    members = "Ray actors"

    def __init__(self, job, workers: Optional[int], *, address=True, threads: Optional[int] = None,
                 name: str = "work", units: Optional[int] = None):
        check_workers(workers)
        self.name = name
        self.threads = threads or 1
        self.units_done = 0
        self._closed = False
        self._started = _SCOPE.keep(connect(address))
        try:
            ray = ray_module()
            count = workers or max(1, cluster_cpus() // self.threads)
            if units is not None:
                count = max(1, min(count, units))
            blob = ray.put(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
            actor = ray.remote(_Actor).options(num_cpus=self.threads)
            self._actors: List[Any] = [actor.remote(blob, self.threads) for _ in range(count)]
        except BaseException:
            self.close()
            raise
        logger.info("%s: %d Ray actors", name, count)

    @property
    def workers(self) -> int:
        """The number of actors."""
        return len(self._actors)

    def _run(self, todo, results, on_result) -> None:
        ray = ray_module()
        pending = {}  # object ref -> (actor, unit index)

        def feed(actor: int) -> None:
            item = next(todo, None)
            if item is None:
                return
            index, unit = item
            if results is not None:
                results.append(None)
            pending[self._actors[actor].unit.remote(unit)] = (actor, index)

        for actor in range(self.workers):
            feed(actor)
        while pending:
            done, _ = _unwinding(ray.wait, list(pending), num_returns=1, timeout=SLICE)
            for ref in done:
                actor, index = pending.pop(ref)
                try:
                    answer = _unwinding(ray.get, ref)
                except Exception as exc:  # noqa: BLE001 - the actor died or could not start
                    raise WorkerError(f"{self.name}: Ray actor {actor + 1} of {self.workers} failed: "
                                      f"{brief(exc, 300, first_line=True)}") from None
                if answer[0] != "ok":
                    raise _error(self.name, actor, self.workers, index, answer)
                if results is not None:
                    results[index] = answer[1]
                self.units_done += 1
                if on_result is not None:
                    on_result(index, answer[1])
                feed(actor)

    def close(self) -> None:
        """Kill the actors; shut Ray down when this pool started it. Safe to call more than once."""
        try:
            import ray
        except ImportError:
            return
        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors, self._closed = [], True
        if self._started is not None and ray.is_initialized():
            _stop_started(ray, self._started, interrupted=_interrupted())
            self._started = None


class _Scope:
    """The open `shared_cluster` scopes of this process: how deep they nest, and the local cluster
    the first pool inside them started (`_ClusterProcesses`), which the outermost one shuts down."""

    def __init__(self):
        self.depth = 0
        self.started: Optional[_ClusterProcesses] = None

    def keep(self, started: Optional["_ClusterProcesses"]) -> Optional["_ClusterProcesses"]:
        """What a pool that `connect` answered ``started`` shuts down itself: nothing inside a scope
        (the scope keeps the cluster for the pools after it), else ``started``."""
        if self.depth and started is not None:
            self.started = started
            return None
        return started

    def leave(self, *, interrupted: bool) -> None:
        self.depth -= 1
        if self.depth or self.started is None:
            return
        started, self.started = self.started, None
        ray = sys.modules.get("ray")
        if ray is not None:  # (Ray shut down meanwhile: its processes and its starting thread still end)
            _stop_started(ray, started, interrupted=interrupted)


_SCOPE = _Scope()


@contextlib.contextmanager
def shared_cluster():
    """Within this scope the Ray pools of this process share one cluster: a local cluster the first
    of them starts (`connect`) is kept when that pool closes, used by the pools after it, and shut
    down when the outermost scope ends (within `INTERRUPTED_SHUTDOWN` seconds when a signal unwinds
    it). Without it each pool starts and shuts down its own. One call that runs several pools (the
    calibration, then the settings of `sensitivity`) thus starts Ray once, and a signal never finds
    the process between two clusters, where ``ray.shutdown`` and ``ray.init`` replace the caller's
    handlers for a while. Does not import Ray; a scope in which no pool started a cluster does
    nothing."""
    _SCOPE.depth += 1
    try:
        yield
    except BaseException:
        _SCOPE.leave(interrupted=_interrupted())
        raise
    _SCOPE.leave(interrupted=False)


#: Seconds an interrupted run waits for ``ray.shutdown`` of the local cluster it started, once it has
#: killed the cluster's processes (`_stop_started`).
INTERRUPTED_SHUTDOWN = 0.2


def _interrupted() -> bool:
    """True while a signal's exception unwinds (``KeyboardInterrupt``, or another exception that is
    not an ``Exception``, as the CLI's ``Terminated``)."""
    exc = sys.exc_info()[1]
    return isinstance(exc, BaseException) and not isinstance(exc, Exception)


def _stop_started(ray, started: Optional["_ClusterProcesses"], *, interrupted: bool) -> None:
    """Shut down the cluster `connect` started, whose processes ``started`` records: ``ray.shutdown``,
    then kill what of it still runs; when ``interrupted``, kill its processes first, then give
    ``ray.shutdown`` `INTERRUPTED_SHUTDOWN` seconds (waiting for it to stop them one by one took 1 s
    and more of a signal's 2 s). Then the thread that started it may end (`_Starter`)."""
    tree = started.tree() if started is not None else {}
    try:
        if interrupted:
            _ClusterProcesses.kill(tree)
            _shutdown_within(ray, INTERRUPTED_SHUTDOWN)
            return
        try:
            _shutdown_keeping_handlers(ray)
        finally:
            _ClusterProcesses.kill(tree)
    finally:
        if started is not None and started.starter is not None:
            started.starter.release.set()


class _ClusterProcesses:
    """The processes ``ray.init`` started in this process (the children it did not have before: the
    GCS server, the raylet, the log monitor...), and everything below them. Read from ``/proc``; on a
    system without it nothing is found and nothing killed (Ray's own shutdown stands alone)."""

    def __init__(self, before: Dict[int, str]):
        self.before = before
        self.roots: Dict[int, str] = {}
        self.starter: Optional[_Starter] = None
        self.record()

    def record(self) -> None:
        """Note the children this process did not have before (again: the start goes on meanwhile)."""
        self.roots = {pid: start for pid, start in self.children().items() if self.before.get(pid) != start}

    @staticmethod
    def _table() -> Dict[int, Tuple[int, str]]:
        """``{pid: (parent pid, start time)}`` of every live process."""
        table: Dict[int, Tuple[int, str]] = {}
        try:
            entries = os.listdir("/proc")
        except OSError:
            return table
        for entry in filter(str.isdigit, entries):
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    state, parent, *rest = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, ValueError):
                continue
            if state != b"Z" and len(rest) > 17:
                table[int(entry)] = (int(parent), rest[17].decode())  # field 22: the start time
        return table

    @classmethod
    def children(cls) -> Dict[int, str]:
        """``{pid: start time}`` of this process's children."""
        me = os.getpid()
        return {pid: start for pid, (parent, start) in cls._table().items() if parent == me}

    def tree(self) -> Dict[int, str]:
        """``{pid: start time}`` of the started processes still alive and every process below them."""
        table = self._table()
        below: Dict[int, List[int]] = {}
        for pid, (parent, _) in table.items():
            below.setdefault(parent, []).append(pid)
        found: Dict[int, str] = {}
        todo = [pid for pid, start in self.roots.items() if table.get(pid, (0, None))[1] == start]
        while todo:
            pid = todo.pop()
            found[pid] = table[pid][1]
            todo.extend(below.get(pid, ()))
        return found

    @classmethod
    def kill(cls, tree: Dict[int, str]) -> None:
        """SIGKILL each process of ``tree`` still alive as the same process (the same start time)."""
        if not tree:
            return
        table = cls._table()
        for pid, start in tree.items():
            if table.get(pid, (0, None))[1] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # gone meanwhile
                    pass


def _shutdown_keeping_handlers(ray) -> None:
    """``ray.shutdown()``, with the caller's SIGINT and SIGTERM handlers kept working throughout.
    Part-way through, ``ray.shutdown`` sets SIGTERM's native handler back to the default (measured,
    Ray 2.60), which would kill the process outright on a SIGTERM in the second or so it still runs,
    or before the next pool starts. So it runs on a thread while this one sets the handlers again
    every `HANDLER_SLICE` seconds until it is done (a signal meanwhile unwinds this thread once the
    shutdown is done, or after `INTERRUPTED_SHUTDOWN` seconds, as for an interrupted run)."""
    handlers = _signal_handlers()
    if not handlers:  # not the main thread: nothing to keep
        ray.shutdown()
        return
    thread = _start_shutdown(ray)
    try:
        while thread.is_alive():
            thread.join(HANDLER_SLICE)
            _restore_signal_handlers(handlers)
    except BaseException:  # a signal meanwhile: the shutdown gets an interrupted run's bound to finish
        thread.join(INTERRUPTED_SHUTDOWN)
        raise


#: Seconds between the settings of the caller's handlers while ``ray.shutdown`` runs.
HANDLER_SLICE = 0.02


def _shutdown_within(ray, seconds: float) -> None:
    """``ray.shutdown()`` on a daemon thread, waited for at most ``seconds``. Shutting a local cluster
    down stops its processes one at a time, waiting up to a second for each (1.1-1.5 s on a loaded
    2-core machine, Ray 2.60), more than an interrupt may take. What is not done by then goes on while
    the caller unwinds; if the process ends first, the cluster's processes end with it (Ray starts
    them tied to the process that started them: on Linux they get SIGKILL when it exits; what is below
    them, the raylet's agents, `_stop_started` kills)."""
    _start_shutdown(ray).join(seconds)


def _start_shutdown(ray) -> threading.Thread:
    """``ray.shutdown()`` started on a daemon thread (an unfinished shutdown never holds the process)."""
    thread = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    thread.start()
    return thread


def _unwinding(call, *args, **kwargs):
    """``call(*args, **kwargs)`` (a Ray call), letting a signal handler's exception through as itself.

    A Python signal handler runs inside Ray's compiled ``wait``/``get`` when the signal arrives there;
    an exception it raises that is not an ``Exception`` (the CLI's ``Terminated`` on SIGTERM) comes out
    of Ray as ``SystemError: ... returned a result with an exception set``, with the handler's
    exception as its cause (measured with Ray 2.60). That cause is raised instead, so SIGTERM unwinds
    as SIGINT's ``KeyboardInterrupt`` does (exit 143, the actors killed on the way out)."""
    try:
        return call(*args, **kwargs)
    except SystemError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, BaseException) and not isinstance(cause, Exception):
            raise cause from None
        raise


def _error(name: str, actor: int, workers: int, index: int, answer) -> QatError:
    _, kind, text = answer
    own = raised_error(kind, text)
    if own is not None:
        return own
    return WorkerError(f"{name}: Ray actor {actor + 1} of {workers} failed (unit {index + 1}): {text}")


__all__ = ["RayPool", "connect", "shared_cluster", "ray_module", "cluster_cpus", "SLICE"]
