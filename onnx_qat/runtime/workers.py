"""Independent work units on worker processes, results in submission order.

A *job* is a picklable object with ``start(threads) -> callable``: each worker process receives the
job once (pickled once, the same bytes sent to every worker), calls ``start`` with its share of the
cores as onnxruntime intra-op threads (``cores // workers``, at least 1) and keeps what it returns
(typically a function closing over the model and the sessions it built) for every unit it is then
given. `WorkerPool.map` sends units one at a time to whichever worker is free and returns the results
in the order of the units, so the answer never depends on how many workers there were or which one
ran what.

Each worker is a fresh interpreter (``python -c``, talking over a socket pair; no inherited
onnxruntime threads or locks, and the caller's ``__main__`` is never imported again, so scripts need no
``if __name__ == "__main__"`` guard), in a session of its own: a terminal's Ctrl-C reaches only the
main process, which decides (the worker also ignores SIGINT). When the main process unwinds
(KeyboardInterrupt, the CLI's SIGTERM, an error), `WorkerPool.close` terminates every worker
(SIGTERM, then SIGKILL after `STOP_WAIT` s) and reaps it. On Linux a worker also dies with its parent
(``PR_SET_PDEATHSIG``), so a parent killed outright leaves no orphan (Linux and macOS: the socket is
handed to the worker as an inherited file descriptor). A unit that raises in a worker surfaces in the
main process as one line: a `QatError` as the same error class and message, anything else as
[`WorkerError`][onnx_qat.errors.WorkerError] naming the worker and the unit; a worker that dies
(out of memory, a crash) is a `WorkerError` with its exit code.

`ModelPayload` carries a model to workers: the graph without weights as bytes and each weight as its
own serialized tensor (no 2 GiB protobuf limit on the whole), or just a path each worker loads.
`default_workers` is the rule for how many workers fit the machine (see docs/performance.md).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from ..errors import ConfigError, QatError, WorkerError, brief
from .pool_base import PoolBase, check_workers, describe_error, raised_error

logger = logging.getLogger(__name__)

#: Seconds the main process waits on its workers between chances to handle a signal.
SLICE = 0.05
#: Seconds a worker is given to end after SIGTERM before it is killed.
STOP_WAIT = 1.0
#: Memory a worker takes before its job: the interpreter, NumPy, onnx and onnxruntime (measured about
#: 150 MB resident with onnxruntime 1.31; rounded up).
WORKER_BASE_BYTES = 256 << 20
#: Share of the available memory all workers together may be estimated to take.
MEMORY_SHARE = 0.5
#: Seconds to start one worker and load its imports (measured about 1 s on a loaded 2-core machine),
#: part of a worker's overhead in `pays_off`.
WORKER_START_SECONDS = 1.0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system says; else the count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_memory() -> Optional[int]:
    """Bytes of memory available to new processes (Linux ``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def default_workers(per_worker_bytes: int, units: Optional[int] = None, *, cores: Optional[int] = None,
                    memory: Optional[int] = None) -> int:
    """How many workers the machine allows: one per usable core, no more than `MEMORY_SHARE` of the
    available memory holds at ``per_worker_bytes`` each (plus `WORKER_BASE_BYTES`), no more than
    ``units``, at least one. ``cores`` and ``memory`` default to this machine's."""
    cores = usable_cores() if cores is None else cores
    memory = available_memory() if memory is None else memory
    count = max(1, int(cores))
    if memory is not None:
        count = min(count, max(1, int(memory * MEMORY_SHARE) // max(1, per_worker_bytes + WORKER_BASE_BYTES)))
    if units is not None:
        count = min(count, max(1, units))
    return count


#: Workers are started by default only when they are estimated to take at most this share of the
#: time of one process.
PAYOFF_SHARE = 0.8


def pays_off(serial_seconds: float, overhead_seconds: float, count: int) -> bool:
    """True when ``count`` workers are estimated to finish the work sooner than one process: the work's
    time in one process (``serial_seconds``) shared out, plus what each worker pays before its first
    unit (``overhead_seconds``: starting, loading the model, building its session, running any
    references), is at most `PAYOFF_SHARE` of ``serial_seconds``."""
    return count > 1 and serial_seconds / count + overhead_seconds <= PAYOFF_SHARE * serial_seconds


def threads_per_worker(workers: int, cores: Optional[int] = None) -> int:
    """onnxruntime intra-op threads of each of ``workers`` workers: the usable cores shared out."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, workers))


class ModelPayload:
    """A model as workers receive it: a path each worker loads, or the model's bytes in pieces.

    From a ``ModelProto`` the graph goes without its initializers as one serialized message and each
    initializer as its own, so no single message reaches protobuf's 2 GiB limit; `model` puts them
    back together in the worker.
    """

    def __init__(self, model):
        import onnx

        if isinstance(model, onnx.ModelProto):
            from ..io.models import copy_except_initializers

            self.path = None
            self.graph = copy_except_initializers(model).SerializeToString()
            self.tensors = [t.SerializeToString() for t in model.graph.initializer]
        else:
            self.path, self.graph, self.tensors = os.fspath(model), b"", []

    @property
    def nbytes(self) -> int:
        """Bytes of the model (the file's size for a path)."""
        if self.path is not None:
            try:
                return os.path.getsize(self.path)
            except OSError:
                return 0
        return len(self.graph) + sum(len(t) for t in self.tensors)

    def model(self):
        """The ``ModelProto``."""
        import onnx

        if self.path is not None:
            from ..io.models import load_model

            return load_model(self.path)
        model = onnx.ModelProto()
        model.ParseFromString(self.graph)
        for data in self.tensors:
            model.graph.initializer.add().ParseFromString(data)
        return model


class WorkerPool(PoolBase):
    """``workers`` worker processes running one job's units (see the module docstring).

    Use it as a context manager (the workers are terminated on the way out, whatever happens)::

        with WorkerPool(job, workers=2) as pool:
            results = pool.map(units)

    Args:
        job: a picklable object whose ``start(threads)`` returns the function each unit is given to.
        workers: worker processes (>= 1; each is a process even for 1).
        threads: onnxruntime intra-op threads per worker (default `threads_per_worker`).
        name: what messages call the work (``"sensitivity"``).
    """

    def __init__(self, job, workers: int, *, threads: Optional[int] = None, name: str = "work"):
        check_workers(workers)
        self.name = name
        self.threads = threads_per_worker(workers) if threads is None else threads
        self.units_done = 0
        self._closed = False
        try:
            blob = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a job that cannot travel is a bug of its maker
            raise WorkerError(f"{name}: the job cannot be sent to worker processes: {brief(exc)}") from None
        self._procs: List[Any] = []
        self._conns: List[Any] = []
        try:
            for k in range(workers):
                proc, conn = _spawn(self.threads)
                self._procs.append(proc)
                self._conns.append(conn)
            for conn in self._conns:
                conn.send_bytes(blob)
        except BaseException:
            self.close()
            raise
        self._ready = [False] * workers

    @property
    def workers(self) -> int:
        """The number of worker processes."""
        return len(self._procs)

    def _run(self, todo, results: Optional[list], on_result) -> None:
        from multiprocessing.connection import wait

        busy = {}  # worker -> unit index

        def feed(worker: int) -> None:
            if self._ready[worker] and worker not in busy:
                item = next(todo, None)
                if item is None:
                    return
                index, unit = item
                busy[worker] = index
                if results is not None:
                    results.append(None)
                self._conns[worker].send((index, unit))

        for worker in range(self.workers):
            feed(worker)
        while busy or not all(self._ready):
            ready = wait(self._conns, SLICE)  # a worker that ends closes its socket: readable too
            for worker, conn in enumerate(self._conns):
                if conn not in ready:
                    continue
                message = self._receive(worker)
                if message[0] == "ready":
                    self._ready[worker] = True
                elif message[0] == "ok":
                    _, index, value = message
                    del busy[worker]
                    if results is not None:
                        results[index] = value
                    self.units_done += 1
                    if on_result is not None:
                        on_result(index, value)
                else:
                    raise self._error(worker, message)
                feed(worker)

    def _receive(self, worker: int):
        try:
            return self._conns[worker].recv()
        except (EOFError, OSError):
            raise self._ended(worker) from None

    def _ended(self, worker: int) -> WorkerError:
        proc = self._procs[worker]
        try:
            code = proc.wait(STOP_WAIT)  # reaped, so its exit code is known
        except subprocess.TimeoutExpired:
            code = None
        return WorkerError(f"{self.name}: worker {worker + 1} of {self.workers} ended unexpectedly "
                           f"(exit code {code}{_why(code)})")

    def _error(self, worker: int, message) -> QatError:
        _, index, kind, text = message
        own = raised_error(kind, text)
        if own is not None:
            return own
        where = "starting" if index is None else f"unit {index + 1}"
        return WorkerError(f"{self.name}: worker {worker + 1} of {self.workers} failed ({where}): {text}")

    def close(self) -> None:
        """Stop every worker (a finished one ends at once; a busy one is terminated) and reap it.
        Safe to call more than once."""
        for conn in self._conns:
            try:
                conn.send(None)  # an idle worker ends on its own
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._closed = [], [], True


def _why(code) -> str:
    if code == -signal.SIGKILL:
        return ": killed, perhaps out of memory; try fewer workers"
    if code is not None and code < 0:
        return f": signal {-code}"
    return ""


def _spawn(threads: int):
    """One worker: a new interpreter running `_worker_main`, in a session of its own (a terminal's
    Ctrl-C reaches only the main process), talking over a socket pair. Nothing of the caller's
    ``__main__`` is imported again (unlike ``multiprocessing``'s spawn), so a script calling the API
    needs no ``if __name__ == "__main__"`` guard."""
    import json
    import socket
    from multiprocessing.connection import Connection

    mine, theirs = socket.socketpair()
    try:
        bootstrap = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
                     "from onnx_qat.runtime.workers import _worker_main; "
                     "_worker_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))")
        args = [sys.executable, "-c", bootstrap, json.dumps([p for p in sys.path if p]), str(theirs.fileno()),
                str(os.getpid()), str(threads)]
        proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return proc, Connection(mine.detach())


# ------------------------------------------------------------------------------ in the worker process
def _worker_main(fd: int, parent: int, threads: int) -> None:
    """A worker's life: load the job, then run units until told to stop or the parent goes away."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _die_with_parent()
    if os.getppid() != parent:  # the parent ended before the line above took effect
        return
    conn = Connection(fd)
    try:
        job = pickle.loads(conn.recv_bytes())
        run = job.start(threads)
    except (EOFError, OSError):
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the main process, which raises it
        _send(conn, ("error", None, *describe_error(exc)))
        return
    _send(conn, ("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, unit = message
        try:
            reply = ("ok", index, run(unit))
        except BaseException as exc:  # noqa: BLE001
            reply = ("error", index, *describe_error(exc))
        if not _send(conn, reply):
            return


def _send(conn, message) -> bool:
    try:
        conn.send(message)
        return True
    except (OSError, ValueError):
        return False


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent ends (``prctl(PR_SET_PDEATHSIG)``)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class WorkerSpec:
    """Where work units run: ``count`` workers (None: the caller's default rule), as local processes
    (`WorkerPool`) or, with ``ray`` (True: the cluster ``ray.init()`` finds or starts; a string: that
    cluster's address), as Ray actors (`onnx_qat.runtime.ray_workers.RayPool`)."""

    count: Optional[int] = None
    ray: Any = None

    @property
    def local(self) -> bool:
        """True when everything runs in this process (one worker, no Ray)."""
        return self.count == 1 and self.ray is None


def worker_spec(workers=None, ray=None) -> WorkerSpec:
    """The `WorkerSpec` of the API's ``workers`` and ``ray`` keywords (a `WorkerSpec` is kept as
    it is). Refuses a bad count or ``ray`` value (`ConfigError`) and, when ``ray`` is asked for and
    Ray is not installed, says so in one line (`WorkerError`) before any work."""
    if isinstance(workers, WorkerSpec):
        return workers
    check_workers(workers)
    if ray is False:
        ray = None
    if ray is not None:
        if not (ray is True or isinstance(ray, str)):
            raise ConfigError(f"ray must be True or a Ray cluster address (a string), got {ray!r}")
        from .ray_workers import ray_module

        ray_module()
    return WorkerSpec(workers, ray)


def start_pool(job, spec: WorkerSpec, count: Optional[int], *, name: str = "work",
               units: Optional[int] = None):
    """A `WorkerPool` of ``count`` processes, or with ``spec.ray`` a
    `RayPool` of ``count`` actors (None: as many as the cluster's CPUs, at most ``units``)."""
    if spec.ray is not None:
        from .ray_workers import RayPool

        return RayPool(job, count, address=spec.ray, name=name, units=units)
    return WorkerPool(job, count, name=name)


def map_units(job, units: Sequence, workers: int, *, name: str = "work", on_result=None) -> list:
    """``job``'s results for ``units``: in this process when ``workers`` is 1 (``job.start(None)``:
    onnxruntime's default threads), else on a `WorkerPool` of ``workers`` processes."""
    if workers == 1:
        run = job.start(None)
        out = []
        for index, unit in enumerate(units):
            out.append(run(unit))
            if on_result is not None:
                on_result(index, out[-1])
        return out
    with WorkerPool(job, workers, name=name) as pool:
        return pool.map(units, on_result)


__all__ = ["WorkerPool", "WorkerSpec", "worker_spec", "start_pool", "ModelPayload", "map_units",
           "default_workers", "threads_per_worker", "usable_cores", "available_memory", "check_workers",
           "pays_off", "SLICE", "STOP_WAIT", "WORKER_BASE_BYTES", "MEMORY_SHARE", "WORKER_START_SECONDS",
           "PAYOFF_SHARE"]
