"""Every helper thread weightsync starts: one pool of daemon threads, the ordered lane, and a
private event loop for blocking twins of async APIs.

- ``in_thread(fn, *args)``: await a blocking call (a collective, a pipe read) run on the pool.
- ``spawn(fn, *args)``: run ``fn`` on the pool, get a ``concurrent.futures.Future`` (cancelling
  it before a thread picked the job up means the job never runs); the copy helpers use it.
- ``SerialLane``: one daemon thread running jobs in submission order.
- ``LoopThread``: a private asyncio loop on a daemon thread; ``run(coro)`` blocks until done.

Why daemon threads and not ``asyncio.to_thread`` / a ``ThreadPoolExecutor``: a collective stuck
on a dead peer keeps its thread busy until the transport's own timeout, and an executor's threads
are joined when ``asyncio.run`` ends and at interpreter exit. Daemon threads never hold up
either; a result that nobody waits for any more is dropped.

Fork safety: threads do not survive ``fork``. A forked child starts with an empty pool (reset by
``os.register_at_fork``), so it never queues work for a thread that exists only in its parent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonPool:
    """Reusable daemon threads: starting a thread per call costs ~1 ms under load (measured:
    2 of the 7 ms a chunk took); a parked worker picks a job up in microseconds. A worker stuck
    in a dead collective simply stays busy; the pool starts another for the next job."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every thread (after ``fork``: the child has none of its parent's threads)."""
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()
        self._count = 0

    def submit(self, job: Callable[[], None], name: str) -> None:
        """Run ``job()`` on an idle worker, or on a new one named ``name-N``; ``job`` must not
        raise (wrap it: ``in_thread`` and ``spawn`` deliver results and exceptions)."""
        with self._lock:
            spawn_one = self._idle == 0
            if spawn_one:
                self._count += 1
            else:
                self._idle -= 1
            count = self._count
        self._jobs.put(job)
        if spawn_one:
            threading.Thread(target=self._work, name=f"{name}-{count}", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job()
            del job  # an idle worker must not keep the job's arguments (chunk tensors) alive
            with self._lock:
                self._idle += 1


_POOL = DaemonPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.reset)


async def in_thread(fn: Callable[..., T], *args: Any, name: str = "weightsync-io") -> T:
    """Await ``fn(*args)`` run on a pooled daemon thread. The call always runs, even if the
    awaiting task is cancelled meanwhile (a peer may be waiting for its part of a collective)."""
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


def spawn(fn: Callable[..., T], *args: Any, name: str = "weightsync-io") -> concurrent.futures.Future[T]:
    """Run ``fn(*args)`` on a pooled daemon thread. The future's ``cancel()`` succeeds while no
    thread has picked the job up, and then the job never runs."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:  # delivered to whoever waits on the future
            fut.set_exception(e)
        else:
            fut.set_result(result)

    _POOL.submit(run, name)
    return fut


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


class LoopThread:
    """A private asyncio event loop on a daemon thread, started on first use: the blocking twin
    of an async API (``client.score_batch_sync``, ``publisher.publish``) runs its coroutine here
    with ``run(coro)``, which works from plain code and from inside another running loop. Keeps
    the loop between calls, so objects bound to it (HTTP connections, a sender) stay usable.
    ``close()`` stops the loop; a later ``run`` starts a new one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._loop is not None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._thread is not None and threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self.name}: a blocking call from the loop's own thread would "
                               f"wait for itself; await the coroutine form instead")
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting (``run`` waits)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name=self.name, daemon=True
                )
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on this loop from another running loop (or on it, directly)."""
        if self._loop is not None and asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=timeout_s)
            if not thread.is_alive():
                loop.close()
