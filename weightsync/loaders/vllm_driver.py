"""``VLLMWorkers``: the one piece of code that drives the weight-sync extension in the workers of
a vLLM engine, from the process that owns the engine.

Who uses it: ``weightsync.clients.VLLMChannel`` (an in-process ``LLM`` / ``AsyncLLM``), the Ray
engine actors (``weightsync.ray.vllm``) and the servers' control plane
(``weightsync.servers.control``). Each worker hosts a ``WeightUpdateEndpoint``
(``weightsync.loaders.vllm_worker``); a call goes to all of them with one
``collective_rpc("weightsync_call", method, kwargs)``:

* ``rpc(method, *args, timeout_s=)``: any extension method on every worker, awaited whether the
  engine's ``collective_rpc`` is blocking (run in a thread, one call at a time: the blocking
  ``LLM``'s engine-core client is one zmq socket, not thread-safe) or a coroutine; no answer
  within ``timeout_s`` is a ``WeightSyncTimeout`` naming the engine and the method;
* ``answers(method, kwargs)``: the workers' raw ``{"ok", ...}`` answers to one endpoint call
  (a caller that maps failures itself, the server, reads them);
* ``call(method, kwargs)``: the same, turned into one result or the most telling error
  (``vllm_worker.raise_for_results``), and, when the call completed an update (a finish or an
  ``apply_update`` that was not an abort), the engine's prefix cache reset: cached KV blocks
  were computed with the old weights;
* ``world_size()`` (cached), ``states()``, ``reset_prefix_cache()``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from weightsync._runtime import trace
from weightsync.errors import WeightSyncTimeout

#: endpoint calls after which the engine serves new weights (unless they aborted the update)
UPDATE_ENDS = ("finish_weight_update", "apply_update")


class VLLMWorkers:
    """The workers of one vLLM engine (``engine``: an ``LLM``, an ``AsyncLLM`` or an engine
    client with ``collective_rpc``), named ``name`` in errors."""

    def __init__(self, engine: Any, *, name: str = "vLLM engine") -> None:
        self.engine = engine
        self.name = name
        self._world_size: int | None = None
        # the blocking LLM's engine-core client is not thread-safe (one zmq socket): its calls
        # run one at a time, each in a thread (a second caller waits its turn off the loop)
        self._blocking = threading.Lock()

    async def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        fn = self.engine.collective_rpc
        try:
            if asyncio.iscoroutinefunction(fn):
                return list(await fn(method, timeout=timeout_s, args=args))

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

    async def call(self, method: str, kwargs: dict[str, Any],
                   timeout_s: float | None = None) -> Any:
        from weightsync.loaders.vllm_worker import raise_for_results

        results = raise_for_results(await self.answers(method, kwargs, timeout_s), engine=self.name)
        if ends_update(method, kwargs):
            trace.mark("rpc.reset.begin")
            await self.reset_prefix_cache()
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
        return bool(await asyncio.to_thread(compat.reset_prefix_cache, engine))


def ends_update(method: str, kwargs: dict[str, Any]) -> bool:
    """The endpoint call completes an update (a finish, or a whole update in one call), unless
    the sender aborted it (``ok: false``)."""
    return method in UPDATE_ENDS and bool((kwargs.get("finish") or {}).get("ok", True))
