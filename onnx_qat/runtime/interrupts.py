"""Long onnxruntime calls that Ctrl-C and SIGTERM still stop within a moment.

Python runs a signal handler only between bytecodes of the main thread: while the main thread sits
in one onnxruntime call (building the session of a 50,000-node model, running a large batch) a
signal waits for minutes. `call_interruptibly` runs such a call on a daemon thread while the
main thread waits in short slices, so the handler (KeyboardInterrupt, or the CLI's
`Terminated`) runs at once; a run is then told to stop
(``onnxruntime.RunOptions.terminate``) and the exception unwinds the main thread as usual, through
every ``finally`` and `atomic_output`'s clean-up. A session build cannot be
stopped: its thread is left to finish in the background, where nothing reads its result.
`InterruptibleSession` wraps a session so that each ``run`` (and ``run_with_iobinding``) goes this way;
`onnx_qat.runtime.sessions.make_session` returns one.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

#: Seconds the main thread waits on a call between chances to handle a signal.
SLICE = 0.05
#: Seconds an interrupted run is given to stop after ``terminate`` was set.
STOP_WAIT = 1.0

_interrupted: list = []  # a call interrupted in this process (its thread, done or not)


def call_interruptibly(fn: Callable, *args, run_options=None, **kwargs) -> Any:
    """``fn(*args, **kwargs)``; on the main thread run on the daemon worker thread, so a signal handler
    raising in the main thread (KeyboardInterrupt, Terminated) interrupts the wait at once.
    ``run_options`` (an ``onnxruntime.RunOptions`` the call uses) is then told to terminate.
    Elsewhere a plain call."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    job = _Job(fn, args, kwargs)
    _worker().put(job)
    try:
        while not job.done.wait(SLICE):
            pass
    except BaseException:
        _interrupted.append(job)
        if run_options is not None:
            run_options.terminate = True
            job.done.wait(STOP_WAIT)  # onnxruntime checks the flag between nodes
        raise
    if job.error is not None:
        raise job.error
    return job.value


class _Job:
    __slots__ = ("fn", "args", "kwargs", "done", "value", "error")

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.value = self.error = None

    def __call__(self):
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # handed to the waiting thread
            self.error = exc
        finally:
            self.fn = self.args = self.kwargs = None
            self.done.set()


_queue = None
_lock = threading.Lock()


def _worker():
    """The queue of the one daemon thread that runs the calls (started on first use: a thread per
    call would cost more than a short run)."""
    global _queue
    with _lock:
        if _queue is None:
            import queue

            _queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_queue,), name="onnx-qat-calls", daemon=True).start()
    return _queue


def _serve(jobs) -> None:
    while True:
        jobs.get()()


def interrupted() -> bool:
    """True once a call was interrupted in this process. The process should then end with
    ``os._exit`` after its clean-up: onnxruntime aborts the process ("terminate called without an
    active exception") when the interpreter is torn down after a terminated run or under a session
    build still running on its thread (measured with onnxruntime 1.31)."""
    return bool(_interrupted)


class InterruptibleSession:
    """An onnxruntime ``InferenceSession`` whose ``run`` and ``run_with_iobinding`` go through
    `call_interruptibly` (every other attribute is the session's)."""

    __slots__ = ("_session", "_onnx_qat_weights")

    def __init__(self, session, weights=()):
        self._session = session
        self._onnx_qat_weights = weights  # the arrays onnxruntime reads the weights from

    def run(self, output_names, input_feed, run_options=None):
        options = _own_options(run_options)
        return call_interruptibly(self._session.run, output_names, input_feed, options, run_options=options)

    def run_with_iobinding(self, iobinding, run_options=None):
        """The session's ``run_with_iobinding`` (inputs and outputs bound to ``iobinding``, made by
        this session's ``io_binding()``), interruptible as `run` is."""
        options = _own_options(run_options)
        return call_interruptibly(self._session.run_with_iobinding, iobinding, options, run_options=options)

    def __getattr__(self, name):
        return getattr(self._session, name)


def _own_options(run_options):
    """The ``RunOptions`` a run uses: new ones, or on the main thread a copy of the caller's
    (``terminate`` must not stick to them)."""
    import onnxruntime as ort

    if run_options is None:
        return ort.RunOptions()
    if threading.current_thread() is threading.main_thread():
        return _copy(ort, run_options)
    return run_options


def _copy(ort, options):
    copy = ort.RunOptions()
    copy.log_severity_level = options.log_severity_level
    copy.log_verbosity_level = options.log_verbosity_level
    copy.logid = options.logid
    return copy


__all__ = ["interrupted", "call_interruptibly", "InterruptibleSession", "SLICE", "STOP_WAIT"]
