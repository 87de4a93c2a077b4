"""``VLLMChannel``: the channel to an in-process vLLM ``LLM`` or ``AsyncLLM`` built with the
weightsync worker extension (``weightsync.loaders.vllm_worker.WORKER_EXTENSION``).

Lives in the process that owns the engine (colocated RL, tests, benchmarks). Every call is one
``collective_rpc("weightsync_call", method, kwargs)`` to all of the engine's workers; their
answers are turned back into one result or the most telling error
(``vllm_worker.raise_for_results``). After a finished update (``finish_weight_update``, or
``apply_update``: a whole update in one call) the channel resets the engine's prefix cache (a
scheduler-level cache the workers cannot reach). The blocking ``LLM``'s calls
run in a thread, so the sender's data plane proceeds at the same time.

Not ordered: an ``AsyncLLM`` engine core runs utility calls in order, so two chunks in flight
should be safe there, but no test drives that yet; the blocking ``LLM`` is not meant for
concurrent calls at all. So a sender keeps one chunk in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from weightsync.errors import WeightSyncTimeout


class VLLMChannel:
    ordered = False
    one_call = True  # apply_update reaches the workers' endpoints like every other method

    def __init__(self, llm: Any, *, name: str = "vLLM engine") -> None:
        self.llm = llm
        self.name = name

    async def world_size(self) -> int:
        sizes = await self._rpc("weightsync_world_size", (), 600.0)
        return int(sizes[0])

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        if method == "status":
            return self._status(timeout_s)
        return self._call(method, kwargs, timeout_s)

    async def _call(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
        from weightsync._runtime import vllm_compat as compat
        from weightsync.loaders.vllm_worker import raise_for_results

        answers = await self._rpc("weightsync_call", (method, kwargs), timeout_s)
        results = raise_for_results(answers, engine=self.name)
        if method in ("finish_weight_update", "apply_update") and kwargs.get(
                "finish", {}).get("ok", True):
            if asyncio.iscoroutinefunction(self.llm.reset_prefix_cache):
                await compat.async_reset_prefix_cache(self.llm)
            else:
                await asyncio.to_thread(compat.reset_prefix_cache, self.llm)
        return results[0] if results else None

    async def _status(self, timeout_s: float) -> dict[str, Any]:
        states = list(await self._rpc("weightsync_state", (), timeout_s))
        worst = next((s for s in states if s.get("state") == "torn"), states[0])
        return {**worst, "name": self.name, "workers": states}

    async def _rpc(self, method: str, args: tuple, timeout_s: float) -> list[Any]:
        fn = self.llm.collective_rpc
        try:
            if asyncio.iscoroutinefunction(fn):
                return list(await fn(method, timeout=timeout_s, args=args))
            return list(await asyncio.to_thread(fn, method, timeout_s, args))
        except TimeoutError as e:
            if isinstance(e, WeightSyncTimeout):
                raise
            raise WeightSyncTimeout(
                f"{self.name}: {method} got no answer from the workers within {timeout_s:g}s"
            ) from None

    async def aclose(self) -> None:
        return None  # the engine belongs to whoever built it

    def __repr__(self) -> str:
        return f"VLLMChannel({self.name!r})"
