"""``VLLMWorkers``: the one piece of code that drives the weight-sync extension in the workers of
a vLLM engine, from the process that owns the engine.

Who uses it: ``weightsync.clients.VLLMChannel`` (an in-process ``LLM`` / ``AsyncLLM``), the Ray
engine actors (``weightsync.ray.vllm``) and the servers' control plane
(``weightsync.servers.control``). Each worker hosts a ``WeightUpdateEndpoint``
(``weightsync.loaders.vllm_worker``); a call goes to all of them with one
``collective_rpc("weightsync_call", method, kwargs)``:

* ``rpc(method, *args, timeout_s=)``: any extension method on every worker, awaited whether the
  engine's ``collective_rpc`` is a coroutine or blocking. Into a blocking ``LLM`` whose engine
  core is its own process the call is sent from the caller's thread and its answer awaited on
  the loop (``vllm_compat.utility_sender``: no thread hop, ~1.5 ms per call on an H100 host);
  the engine's core found dead ends the wait within a second (``EngineDiedError``), where a blocked
  thread would wait forever. Other blocking engines run each call whole in a thread. Either
  way calls are sent one at a time (the engine-core client is one zmq socket, not
  thread-safe). No answer within ``timeout_s`` is a ``WeightSyncTimeout`` naming the engine
  and the method;
* ``answers(method, kwargs)``: the workers' raw ``{"ok", ...}`` answers to one endpoint call
  (a caller that maps failures itself, the server, reads them);
* ``call(method, kwargs)``: the same, turned into one result or the most telling error
  (``vllm_worker.raise_for_results``), and, when the call completed an update (a finish or an
  ``apply_update`` that was not an abort), the engine's prefix cache reset: cached KV blocks
  were computed with the old weights. Into a blocking ``LLM`` the reset is sent right behind
  the call, so the engine core runs it as the call returns (one round trip, not two);
* ``world_size()`` (cached), ``states()``, ``reset_prefix_cache()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import Any

from weightsync._runtime import trace
from weightsync.errors import EngineDiedError, WeightSyncTimeout

#: endpoint calls after which the engine serves new weights (unless they aborted the update)
UPDATE_ENDS = ("finish_weight_update", "apply_update")


class VLLMWorkers:
    """The workers of one vLLM engine (``engine``: an ``LLM``, an ``AsyncLLM`` or an engine
    client with ``collective_rpc``), named ``name`` in errors."""

    #: how often a call into a blocking engine checks that its engine core is alive
    ALIVE_CHECK_S = 1.0

    def __init__(self, engine: Any, *, name: str = "vLLM engine") -> None:
        self.engine = engine
        self.name = name
        self._world_size: int | None = None
        # the blocking LLM's engine-core client is not thread-safe (one zmq socket): its calls
        # are sent one at a time (sent from the caller's thread where the client allows it,
        # else each call runs whole in a thread and a second caller waits its turn off the loop)
        self._blocking = threading.Lock()
        self._sender: Any = None  # vllm_compat.utility_sender(engine), False: none; lazily

    def _send(self) -> Any:
        """``vllm_compat.utility_sender`` for this engine (None: calls block in a thread)."""
        if self._sender is None:
            from weightsync._runtime import vllm_compat as compat

            fn = self.engine.collective_rpc
            self._sender = (not asyncio.iscoroutinefunction(fn)
                            and compat.utility_sender(self.engine)) or False
        return self._sender or None

    def _post(self, method: str, *args: Any) -> Any:
        """Send one engine-core utility call now (no thread): its future."""
        with self._blocking:
            return self._sent(method, *args)

    def _sent(self, method: str, *args: Any) -> Any:
        """``_post`` with the lock held; a send refused because the engine core is dead is
        ``EngineDiedError`` naming the engine (vLLM's client raises its own error)."""
        try:
            return self._send()(method, *args)
        except Exception as e:
            from weightsync._runtime import vllm_compat as compat

            if compat.engine_core_dead(self.engine):
                raise EngineDiedError(
                    f"{self.name}: the engine core is dead ({type(e).__name__}: {e})") from e
            raise

    async def _answer(self, future: Any, what: str, timeout_s: float | None) -> Any:
        """The answer to a call ``_post`` sent, or ``WeightSyncTimeout`` after ``timeout_s``, or
        ``EngineDiedError`` as soon as the engine core is known dead (its answer never comes)."""
        from weightsync._runtime import vllm_compat as compat

        waiter = asyncio.wrap_future(future)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = self.ALIVE_CHECK_S if deadline is None else min(
                self.ALIVE_CHECK_S, max(deadline - loop.time(), 0.0))
            done, _ = await asyncio.wait({waiter}, timeout=left)
            if done:
                try:
                    return waiter.result()
                except TimeoutError as e:  # the engine core's own limit
                    if isinstance(e, WeightSyncTimeout):
                        raise
                    raise WeightSyncTimeout(f"{self.name}: {what} got no answer from the "
                                            f"workers within {timeout_s:g}s") from None
            if compat.engine_core_dead(self.engine):
                raise EngineDiedError(f"{self.name}: the engine core died during {what}")
            if deadline is not None and loop.time() >= deadline:
                raise WeightSyncTimeout(
                    f"{self.name}: {what} got no answer from the workers within {timeout_s:g}s")

    async def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        fn = self.engine.collective_rpc
        try:
            if asyncio.iscoroutinefunction(fn):
                return list(await fn(method, timeout=timeout_s, args=args))
            if self._send() is not None:
                future = self._post("collective_rpc", method, timeout_s, args, None)
                return list(await self._answer(future, method, timeout_s))

            def one_at_a_time() -> Any:
                with self._blocking:
                    trace.mark("rpc.thread.begin", method=method)
                    try:
                        return fn(method, timeout_s, args)
                    finally:
                        trace.mark("rpc.thread.end")

            return list(await asyncio.to_thread(one_at_a_time))
        except TimeoutError as e:
            if isinstance(e, WeightSyncTimeout):
                raise
            raise WeightSyncTimeout(
                f"{self.name}: {method} got no answer from the workers within {timeout_s:g}s"
            ) from None

    async def answers(self, method: str, kwargs: dict[str, Any],
                      timeout_s: float | None = None) -> list[dict[str, Any]]:
        return await self.rpc("weightsync_call", method, kwargs, timeout_s=timeout_s)

    def call(self, method: str, kwargs: dict[str, Any],
             timeout_s: float | None = None) -> Awaitable[Any]:
        """See the module docstring. Into a blocking ``LLM`` a call that ends an update is sent
        before this returns (a sender that issues it to several engines, or goes on to start
        its data lane, does not wait for the loop to run it); await the result."""
        if ends_update(method, kwargs) and self._send() is not None:
            trace.mark("rpc.post", method=method)
            with self._blocking:
                answer = self._sent("collective_rpc", "weightsync_call", timeout_s,
                                    (method, kwargs), None)
                # the reset right behind the call: the engine core serves its queue in order
                # and drains it before its next step, so the reset runs as the call returns (no
                # step in between, no second round trip). Sent whatever the call's outcome (a
                # reset is always safe); awaited only when the call succeeded
                reset = self._sent("reset_prefix_cache")
            return self._answered_then_reset(answer, reset, timeout_s)
        return self._call(method, kwargs, timeout_s)

    async def _call(self, method: str, kwargs: dict[str, Any], timeout_s: float | None) -> Any:
        from weightsync.loaders.vllm_worker import raise_for_results

        results = raise_for_results(await self.answers(method, kwargs, timeout_s), engine=self.name)
        if ends_update(method, kwargs):
            trace.mark("rpc.reset.begin")
            await self.reset_prefix_cache()
            trace.mark("rpc.reset.end")
        return results[0] if results else None

    async def _answered_then_reset(self, answer: Any, reset: Any,
                                   timeout_s: float | None) -> Any:
        from weightsync.loaders.vllm_worker import raise_for_results

        answers = list(await self._answer(answer, "weightsync_call", timeout_s))
        trace.mark("rpc.answered")
        results = raise_for_results(answers, engine=self.name)
        await self._answer(reset, "reset_prefix_cache", timeout_s)
        trace.mark("rpc.reset.end")
        return results[0] if results else None

    async def world_size(self) -> int:
        if self._world_size is None:
            self._world_size = int((await self.rpc("weightsync_world_size", timeout_s=600.0))[0])
        return self._world_size

    async def states(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return list(await self.rpc("weightsync_state", timeout_s=timeout_s))

    async def reset_prefix_cache(self) -> bool:
        from weightsync._runtime import vllm_compat as compat

        engine = self.engine
        if asyncio.iscoroutinefunction(getattr(engine, "reset_prefix_cache", None)):
            return bool(await compat.async_reset_prefix_cache(engine))
        if self._send() is not None:
            result = await self._answer(self._post("reset_prefix_cache"), "reset_prefix_cache",
                                        None)
            return True if result is None else bool(result)
        return bool(await asyncio.to_thread(compat.reset_prefix_cache, engine))


def ends_update(method: str, kwargs: dict[str, Any]) -> bool:
    """The endpoint call completes an update (a finish, or a whole update in one call), unless
    the sender aborted it (``ok: false``)."""
    return method in UPDATE_ENDS and bool((kwargs.get("finish") or {}).get("ok", True))
