"""The disk tier's I/O threads: one queue, a few threads, a read split into parts that run side by side.

A decode step submits about a hundred expert reads a token from the thread that computes. Through a
:class:`concurrent.futures.ThreadPoolExecutor` each part of a read was a task with its own future,
joined by callbacks into one: about 40 µs of that thread's time a read, a few ms a token. Here a
read is one future and one counter, and its parts are tuples on a :class:`queue.SimpleQueue` (a few
µs a read). The threads take work in the order it was queued, so the parts of one read run side by
side and reads land in the order submitted, as before.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any


class _Parts:
    """One submitted job's future, and how many of its parts are still running."""

    __slots__ = ("error", "future", "left", "lock")

    def __init__(self, n: int) -> None:
        self.future: Future = Future()
        self.left = n
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def finished(self, exc: BaseException | None, result: Any = None) -> None:
        """A part ended; the last one resolves the job: the first failure, else the last
        part's result. A failed read resolves only then too, so no part still writes into a buffer
        its caller already holds again."""
        with self.lock:
            self.left -= 1
            if exc is not None and self.error is None:
                self.error = exc
            if self.left:
                return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(result)


class IOPool:
    """``threads`` daemon threads serving one FIFO queue of jobs (``submit``) and parted jobs
    (``submit_parts``); the ``ThreadPoolExecutor`` calls the tier makes (``submit``, ``shutdown``)."""

    def __init__(self, threads: int, name: str = "moecast-io") -> None:
        self.threads = max(1, int(threads))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(self.threads)
        ]
        for w in self._workers:
            w.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on a thread; its future holds the result or the exception."""
        return self.submit_parts(fn, [args])

    def submit_parts(self, fn: Callable[..., Any], parts: Sequence[tuple]) -> Future:
        """``fn(*part)`` for each of ``parts``, queued back to back; one future, done when every part
        is (the first failure, else the last part's result)."""
        if self._closed:
            raise RuntimeError("the I/O pool is shut down: reopen the tier to read experts")
        job = _Parts(len(parts))
        if not parts:  # nothing to run: done now (no part would ever resolve it)
            job.future.set_result(None)
        put = self._queue.put
        for args in parts:
            put((job, fn, args))
        return job.future

    def _work(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            job, fn, args = item
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the job's future, as an executor does
                job.finished(exc)
            else:
                job.finished(None, result)

    def shutdown(self, wait: bool = True) -> None:
        """No more jobs; the threads end once the queued ones ran (joined with ``wait``)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._queue.put(None)
        if wait:
            for w in self._workers:
                if w is not threading.current_thread():
                    w.join()
