"""``LocalEngineProcess``: an engine (a torch module behind a ``WeightUpdateEndpoint``) in its own
process on this machine, without Ray.

The parent (training side, tests, benchmarks) spawns the child with ``spawn()`` and talks to it
with ``await call(method, **kwargs)`` over a ``multiprocessing`` connection that carries JSON
bytes only. Calls to a worker are sent in the order they are made and may overlap (the child
answers them one at a time, in order); a reply for an abandoned call (timed out or cancelled) is
recognised by its id and dropped. A dead child is seen at once (EOF) and reported
as ``WeightSyncError`` naming the engine; a silent one as ``WeightSyncTimeout`` after the
call's timeout.

``world_size > 1`` starts that many worker processes, each with its own copy of the module (the
shape of a tensor-parallel engine, unsharded): calls fan out to every worker, worker ``i`` joins
data planes at ``rank_offset + i``, and the first worker's answer is returned (``worker=k`` asks
one worker only).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

from weightsync._runtime.threads import SerialLane, in_thread
from weightsync.errors import (
    EngineDiedError,
    WeightSyncError,
    WeightSyncTimeout,
)
from weightsync.local import _wire


class _Worker:
    """One child process and its connection (parent side).

    Several calls may be outstanding (a pipelining sender): ``submit`` queues a message on a
    one-thread send lane, so messages leave in call order; the child answers them one at a time,
    in order. Whichever waiter holds the read turn reads the next reply and hands it to its
    owner; a reply nobody waits for (a call that timed out or was abandoned) is dropped.
    """

    def __init__(self, engine: str, index: int, proc: Any, conn: Any) -> None:
        self.engine = engine
        self.index = index
        self.proc = proc
        self.conn = conn
        self.ids = itertools.count(1)
        self.dead: str | None = None
        self._lane = SerialLane(f"ws-send-{self.label}")
        self._cond = threading.Condition()
        self._reading = False
        self._waiting: set[int] = set()
        self._replies: dict[int, dict[str, Any]] = {}

    @property
    def label(self) -> str:
        return self.engine if self.index == 0 else f"{self.engine}/worker{self.index}"

    def submit(self, method: str, kwargs: dict[str, Any]) -> tuple[int, concurrent.futures.Future]:
        """Queue one call now (non-blocking); returns its id and the send's future."""
        self._check_alive(method)
        mid = next(self.ids)
        with self._cond:
            self._waiting.add(mid)
        payload = _wire.dumps({"id": mid, "method": method, "kwargs": kwargs})
        return mid, self._lane.submit(self._send, payload, method)

    def _send(self, payload: bytes, method: str) -> None:
        try:
            self.conn.send_bytes(payload)
        except (OSError, EOFError, ValueError) as e:
            raise self._died(method, e) from None

    def forget(self, mid: int) -> None:
        with self._cond:
            self._waiting.discard(mid)
            self._replies.pop(mid, None)

    def wait_reply(self, mid: int, method: str, timeout_s: float) -> Any:
        """Blocking: the answer to call ``mid`` (run in a thread by ``LocalEngineProcess.call``)."""
        deadline = time.monotonic() + timeout_s
        try:
            msg = self._next_reply(mid, method, deadline, timeout_s)
        finally:
            self.forget(mid)
        if "error_type" in msg:
            raise _wire.rebuild_error(msg, self.label)
        return msg.get("result")

    def _next_reply(self, mid: int, method: str, deadline: float, timeout_s: float) -> dict:
        with self._cond:
            while True:
                if mid in self._replies:
                    return self._replies.pop(mid)
                if self.dead:
                    raise EngineDiedError(
                        f"engine {self.label!r} (pid {self.proc.pid}) died during {method} "
                        f"({self.dead})"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncTimeout(
                        f"engine {self.label!r} (pid {self.proc.pid}) did not answer {method} "
                        f"within {timeout_s:g}s"
                    )
                if self._reading:  # another waiter reads; it hands us our reply
                    self._cond.wait(left)
                    continue
                self._reading = True
                self._cond.release()
                msg: dict | None = None
                err: BaseException | None = None
                try:
                    if self.conn.poll(left):
                        msg = _wire.loads(self.conn.recv_bytes())
                except (OSError, EOFError, ValueError) as e:
                    err = self._died(method, e)
                finally:
                    self._cond.acquire()
                    self._reading = False
                    self._cond.notify_all()
                if err is not None:
                    raise err
                if msg is not None and msg.get("id") in self._waiting:
                    self._replies[msg["id"]] = msg

    def request(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """Blocking round trip."""
        mid, sent = self.submit(method, kwargs)
        try:
            sent.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.forget(mid)
            raise WeightSyncTimeout(
                f"engine {self.label!r}: could not send {method} within {timeout_s:g}s"
            ) from None
        except BaseException:
            self.forget(mid)
            raise
        return self.wait_reply(mid, method, timeout_s)

    def _check_alive(self, method: str) -> None:
        if self.dead:
            raise EngineDiedError(f"engine {self.label!r} is gone ({self.dead}); cannot {method}")

    def _died(self, method: str, e: BaseException) -> WeightSyncError:
        code = _join(self.proc, 0.5)
        how = f"exit code {code}" if code is not None else f"{type(e).__name__}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-code).name}"
        self.dead = how
        return EngineDiedError(
            f"engine {self.label!r} (pid {self.proc.pid}) died during {method} ({how})"
        )


class LocalEngineProcess:
    """Handle to an engine running in child process(es) of this one."""

    def __init__(self, name: str, workers: list[_Worker], *, timeout_s: float = 600.0) -> None:
        self.name = name
        self.workers = workers
        self.timeout_s = timeout_s

    # -- lifecycle -------------------------------------------------------------------------------
    @classmethod
    def spawn(
        cls,
        module_factory: str,
        factory_kwargs: dict | None = None,
        *,
        name: str = "engine0",
        world_size: int = 1,
        start_timeout_s: float = 120.0,
        timeout_s: float = 600.0,
        num_threads: int | None = None,
        env: dict[str, str] | None = None,
    ) -> LocalEngineProcess:
        """Start the engine and wait until its module is built (``start_timeout_s``).

        ``module_factory``: ``"pkg.mod:fn"`` importable in the child; ``factory_kwargs`` must be
        JSON-safe. ``env``: extra environment variables for the child(ren), e.g.
        ``CUDA_VISIBLE_DEVICES``.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        mod, sep, attr = module_factory.partition(":")
        if not (mod and sep and attr):
            raise ValueError(f"module_factory must look like 'pkg.mod:fn', got {module_factory!r}")
        _wire.dumps(factory_kwargs or {})  # must be JSON-safe: raises TypeError now
        workers: list[_Worker] = []
        try:
            for i in range(world_size):
                spec = {
                    "name": name if world_size == 1 else f"{name}/worker{i}",
                    "module_factory": module_factory, "factory_kwargs": factory_kwargs or {},
                    "world_size": world_size, "num_threads": num_threads,
                }
                workers.append(_start_worker(name, i, spec, env))
            for w in workers:
                _wait_ready(w, start_timeout_s)
        except BaseException:
            for w in workers:
                _hard_kill(w)
            raise
        _LIVE.update(workers)
        return cls(name, workers, timeout_s=timeout_s)

    async def call(
        self, method: str, *, worker: int | None = None, timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call ``method`` on the engine (every worker, or ``worker``); returns worker 0's (or
        that worker's) result. Errors are re-raised as weightsync errors naming the engine."""
        return await self.issue(method, worker=worker, timeout_s=timeout_s, **kwargs)

    def issue(
        self, method: str, *, worker: int | None = None, timeout_s: float | None = None,
        **kwargs: Any,
    ) -> asyncio.Future:
        """``call`` whose messages are queued before this returns (call it from the event
        loop): calls issued one after another reach every worker in that order, whenever their
        answers are awaited. Returns a future of worker 0's (or ``worker``'s) result."""
        timeout = float(timeout_s if timeout_s is not None else self.timeout_s)
        targets = self.workers if worker is None else [self.workers[worker]]

        def kw_for(w: _Worker) -> dict[str, Any]:
            if method == "init_weight_transfer" and "rank_offset" in kwargs:
                return {**kwargs, "rank_offset": int(kwargs["rank_offset"]) + w.index}
            return kwargs

        # every message is queued here, before the first await: calls reach each worker in
        # the order they were made, which lets a sender keep several chunks in flight
        issued: list[tuple[_Worker, int, concurrent.futures.Future]] = []
        try:
            for w in targets:
                issued.append((w, *w.submit(method, kw_for(w))))
        except BaseException:
            for w, mid, _ in issued:
                w.forget(mid)
            raise

        async def answer(w: _Worker, mid: int, sent: concurrent.futures.Future) -> Any:
            try:
                await asyncio.wait_for(asyncio.wrap_future(sent), timeout)
            except BaseException as e:
                w.forget(mid)
                if isinstance(e, asyncio.TimeoutError):
                    raise WeightSyncTimeout(
                        f"engine {w.label!r}: could not send {method} within {timeout:g}s"
                    ) from None
                raise
            return await in_thread(w.wait_reply, mid, method, timeout, name=f"ws-{w.label}")

        if len(issued) == 1:
            return asyncio.ensure_future(answer(*issued[0]))

        async def first(aws: list[Any]) -> Any:
            from weightsync.clients.policy import gather

            names = [w.label for w, _, _ in issued]
            return (await gather(aws, names=names, method=method, timeout_s=timeout))[0]

        return asyncio.ensure_future(first([answer(*i) for i in issued]))

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def is_alive(self) -> bool:
        return all(w.proc.poll() is None for w in self.workers)

    def kill(self) -> None:
        """SIGKILL every worker now (for fault tests); no clean-up runs in the child."""
        for w in self.workers:
            _hard_kill(w)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to close its receiver and exit; kill what does not exit in time."""
        for w in self.workers:
            if w.proc.poll() is None and not w.dead:
                with contextlib.suppress(Exception):
                    w.request("stop", {}, timeout_s)
        for w in self.workers:
            _join(w.proc, timeout_s)
            if w.proc.poll() is None:
                _hard_kill(w)
            w.dead = w.dead or "stopped"
            w._lane.close()
            _LIVE.discard(w)
            with contextlib.suppress(Exception):
                w.conn.close()

    def __enter__(self) -> LocalEngineProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEngineProcess({self.name!r}, pids={self.pids})"


def _start_worker(engine: str, index: int, spec: dict[str, Any], env: dict[str, str] | None) -> _Worker:
    """Start ``python -m weightsync.local.worker`` with one end of a socket pair.

    A fresh interpreter (not ``multiprocessing`` spawn) so the caller's ``__main__`` is never
    re-imported in the child and nothing but JSON crosses: the spec goes in argv, messages over
    the socket with ``Connection``'s length-prefixed framing.
    """
    parent_sock, child_sock = socket.socketpair()
    child_env = dict(os.environ)
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.local.worker", str(child_sock.fileno()),
             _wire.dumps(spec).decode()],
            pass_fds=(child_sock.fileno(),), env=child_env, close_fds=True,
        )
    finally:
        child_sock.close()
    conn = Connection(parent_sock.detach())
    return _Worker(engine, index, proc, conn)


def _wait_ready(w: _Worker, timeout_s: float) -> None:
    if not w.conn.poll(timeout_s):
        raise WeightSyncTimeout(
            f"engine {w.label!r} did not start within {timeout_s:g}s (building its module?)"
        )
    try:
        msg = _wire.loads(w.conn.recv_bytes())
    except (EOFError, OSError):
        code = _join(w.proc, 5)
        raise WeightSyncError(
            f"engine {w.label!r} died while starting (exit code {code}; see its stderr)"
        ) from None
    if not msg.get("ready"):
        err = _wire.rebuild_error(msg, w.label)
        raise WeightSyncError(f"engine {w.label!r} failed to start: {err}") from err


def _hard_kill(w: _Worker) -> None:
    w._lane.close()
    if w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            w.proc.kill()
        _join(w.proc, 5)
    w.dead = w.dead or "killed"
    _LIVE.discard(w)


def _join(proc: subprocess.Popen, timeout_s: float) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    return proc.returncode


_LIVE: weakref.WeakSet[_Worker] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    """Children still running when this interpreter exits are killed, never orphaned."""
    for w in list(_LIVE):
        with contextlib.suppress(Exception):
            _hard_kill(w)


