"""``VLLMChannel``: the channel to an in-process vLLM ``LLM`` or ``AsyncLLM`` built with the
weightsync worker extension (``weightsync.loaders.vllm_worker.WORKER_EXTENSION``).

Lives in the process that owns the engine (colocated RL, tests, benchmarks). Every call goes to
all of the engine's workers through ``weightsync.loaders.vllm_driver.VLLMWorkers`` (the one
driver of vLLM workers: one ``collective_rpc``, the answers turned into one result or the most
telling error, the prefix cache reset after a finished update; the blocking ``LLM``'s calls run
in a thread, so the sender's data plane proceeds at the same time).

Not ordered: an ``AsyncLLM`` engine core runs utility calls in order, so two chunks in flight
should be safe there, but no test drives that yet; the blocking ``LLM`` is not meant for
concurrent calls at all. So a sender keeps one chunk in flight.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any


class VLLMChannel:
    ordered = False
    one_call = True  # apply_update reaches the workers' endpoints like every other method

    def __init__(self, llm: Any, *, name: str = "vLLM engine") -> None:
        from weightsync.loaders.vllm_driver import VLLMWorkers

        self.llm = llm
        self.name = name
        self.workers = VLLMWorkers(llm, name=name)

    async def world_size(self) -> int:
        return await self.workers.world_size()

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        if method == "status":
            return self._status(timeout_s)
        return self.workers.call(method, kwargs, timeout_s)

    async def _status(self, timeout_s: float) -> dict[str, Any]:
        states = await self.workers.states(timeout_s)
        worst = next((s for s in states if s.get("state") == "torn"), states[0])
        return {**worst, "name": self.name, "workers": states}

    async def aclose(self) -> None:
        return None  # the engine belongs to whoever built it

    def __repr__(self) -> str:
        return f"VLLMChannel({self.name!r})"
