"""Run a blocking call (a collective, a pipe read) in a daemon thread and await it.

Why not ``asyncio.to_thread``: a collective stuck on a dead peer keeps its thread busy until the
transport's own timeout, and the default executor's threads are joined when ``asyncio.run``
ends and at interpreter exit. Daemon threads (pooled) never hold up either; its result (or
exception) is delivered to the awaiting task if that task still waits, else dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _DaemonPool:
    """Reusable daemon threads: starting a thread per call costs ~1 ms under load (measured:
    2 of the 7 ms a chunk took); a parked worker picks a job up in microseconds. A worker stuck
    in a dead collective simply stays busy; the pool starts another for the next job."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()
        self._count = 0

    def submit(self, job: Callable[[], None], name: str) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
            else:
                self._count += 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, name=f"{name}-{self._count}", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job()
            del job  # an idle worker must not keep the job's arguments (chunk tensors) alive
            with self._lock:
                self._idle += 1


_POOL = _DaemonPool()


async def in_thread(fn: Callable[..., T], *args: Any, name: str = "weightsync-io") -> T:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def _set(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # delivered to the awaiting task
            ok, value = False, e
        else:
            ok, value = True, result
        try:
            loop.call_soon_threadsafe(_set, ok, value)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    _POOL.submit(run, name)
    return await fut


class SerialLane:
    """One daemon thread that runs jobs in the order they were submitted: what a pipelining
    sender needs for work that must happen in request order (collective votes and broadcasts,
    sends on one connection). ``submit`` never blocks and returns a ``concurrent.futures``
    future (wrap it with ``asyncio.wrap_future`` to await it). A submitted job always runs, in
    its turn: cancelling its future only drops the result (a peer may be waiting for the vote
    or message it makes). Daemon, so a job stuck on a dead
    peer never holds up interpreter exit; the thread starts on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: lane is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            del item
            wanted = fut.set_running_or_notify_cancel()  # cancelled: still run, drop the result
            try:
                result = fn(*args)
            except BaseException as e:  # delivered to whoever waits on the future
                if wanted:
                    fut.set_exception(e)
            else:
                if wanted:
                    fut.set_result(result)
            del fut, fn, args  # an idle lane must not keep a job's tensors alive

    def close(self) -> None:
        """Jobs already queued still run; the thread then exits."""
        with self._lock:
            if not self._closed and self._thread is not None:
                self._jobs.put(None)
            self._closed = True
