"""The engine's model thread: the one thread on which the model is built and every step runs.

Keeping all heavy torch work on one thread is a matter of speed on the CPU. torch's CPU
kernels parallelize with OpenMP (libgomp), which keeps a pool of worker threads for each
thread that starts parallel work. Loading the model on the event loop's thread and
stepping it on another made two pools on two cores; libgomp then stops spinning between
parallel regions, and every small op of a decode step paid a wake-up: an RMSNorm of 64
rows took ~600 µs instead of ~80 µs (measured on this project's 2-core machine).

It is a daemon thread, unlike ThreadPoolExecutor's, so that Ctrl-C during a long load
ends the process instead of waiting for the load to finish, and a process whose model
step hangs can still exit. Should the thread end without `shutdown` (`is_lost`), the jobs
it had taken or still holds fail with ModelThreadLost, so that nobody waits for them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class ModelThreadLost(RuntimeError):
    """The model thread ended without being shut down: no job will run on it again."""


class ModelThread(Executor):
    """A single-worker executor whose worker is a daemon thread."""

    def __init__(self, name: str = "aioserve-model") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.busy_since: float | None = None
        """When the job now running began (time.monotonic); None while the thread waits."""
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("the model thread has been shut down")
        if self.is_lost:
            raise ModelThreadLost(f"the thread {self._thread.name!r} ended unexpectedly")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    @property
    def is_lost(self) -> bool:
        """True once the thread has ended although nobody shut it down."""
        return not self._closed and not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s for the thread to end (after `shutdown`); True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        future: Future | None = None
        try:
            while (job := self._jobs.get()) is not None:
                future, fn, args, kwargs = job
                if not future.set_running_or_notify_cancel():
                    continue
                self.busy_since = time.monotonic()
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:
                    future.set_exception(error)
                else:
                    future.set_result(result)
                finally:
                    self.busy_since = None
        finally:
            if not self._closed:
                self._fail_pending(future)

    def _fail_pending(self, taken: Future | None) -> None:
        lost = ModelThreadLost(f"the thread {self._thread.name!r} ended unexpectedly")
        pending = [taken]
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, tuple):
                pending.append(job[0])
        for future in pending:
            if future is None or future.done():
                continue
            if future.running() or future.set_running_or_notify_cancel():
                future.set_exception(lost)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking jobs; the queued ones still run unless `cancel_futures`."""
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
