"""Sender-side stage timers for the vLLM benchmark's profiled sync (``weightsync.bench.vllm_runner``).

* ``ProbeClient`` wraps an ``InferenceEngineClient`` and, while ``recording``, sums the wall time
  of the start, chunk and finish round trips (and of ``apply_update``, a whole update in one).
* ``timed_sync_fn`` / ``timed_chunks`` time a sender method (``create_request``, the broadcast
  lane's ``_send_data``) and the extractor's iterator, each bracketed by device
  synchronisations (so GPU work is counted where it is issued).

Only the one profiled sync uses them; the timed syncs run unwrapped. Runs in the bench process.
"""

from __future__ import annotations

import time
from typing import Any


class ProbeClient:
    """Forwards every call to an ``InferenceEngineClient`` and, while ``recording``, sums the
    wall time of each kind of call (start, chunk, finish)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_inflight_updates = inner.max_inflight_updates
        self.recording = False
        self.times: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _timed(self, key: str, aw: Any, t0: float | None = None) -> Any:
        """Await ``aw`` and add its wall time to ``times[key]``, from ``t0`` (when the call was
        issued, if that was before this coroutine first ran) or from now."""
        t0 = time.perf_counter() if t0 is None else t0
        try:
            return await aw
        finally:
            if self.recording:
                self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t0

    async def get_world_sizes(self) -> list[int]:
        return await self.inner.get_world_sizes()

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        await self.inner.init_weight_transfer(strategy_cfg, sync_info)

    async def start_weight_update(self, start: dict) -> None:
        await self._timed("start_rpc_s", self.inner.start_weight_update(start))

    async def update_named_weights(self, request: dict) -> None:
        await self._timed("chunk_rpc_s", self.inner.update_named_weights(request))

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        return await self._timed("finish_rpc_s", self.inner.finish_weight_update(finish))

    async def close_weight_transfer(self) -> None:
        await self.inner.close_weight_transfer()

    @property
    def supports_apply_update(self) -> bool:
        return bool(getattr(self.inner, "supports_apply_update", False))

    def apply_update(self, start: dict, requests: list[dict], finish: dict) -> Any:
        import asyncio

        # timed from here: the inner client issues the call before it returns, and the task
        # below first runs only when the caller next waits (its lane may be busy by then)
        t0 = time.perf_counter()
        return asyncio.ensure_future(
            self._timed("apply_rpc_s", self.inner.apply_update(start, requests, finish), t0))


def timed_sync_fn(fn: Any, times: dict[str, float], key: str, device: str) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        device_sync(device)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            device_sync(device)
            times[key] = times.get(key, 0.0) + time.perf_counter() - t0
    return run


async def timed_chunks(chunks: Any, times: dict[str, float], device: str) -> Any:
    it = chunks.__aiter__()
    while True:
        device_sync(device)
        t0 = time.perf_counter()
        try:
            chunk = await it.__anext__()
        except StopAsyncIteration:
            break
        finally:
            device_sync(device)
            times["extract_s"] = times.get("extract_s", 0.0) + time.perf_counter() - t0
        yield chunk


def device_sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
