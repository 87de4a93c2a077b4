"""``LocalEngineClient``: the ``InferenceEngineClient`` over ``LocalEngineProcess`` engines.

Lives in the sending (training) process. Every call fans out to all engines at once; the first
failure is raised right away (an engine that died is seen at once through EOF), naming the
engine. Engine ``i`` joins data planes at ``rank_offset = 1 + sum(world sizes before it)``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from weightsync.interfaces import InferenceEngineClient
from weightsync.local.process import LocalEngineProcess, first_error_gather


class LocalEngineClient(InferenceEngineClient):
    def __init__(self, engines: list[LocalEngineProcess], timeout_s: float = 600.0) -> None:
        if not engines:
            raise ValueError("LocalEngineClient needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.engines = list(engines)
        self.timeout_s = float(timeout_s)

    #: engines run calls one at a time in the order they were issued (see ``issue``)
    max_inflight_updates = 2

    def _all(self, method: str, **kwargs: Any) -> asyncio.Future:
        """Issue ``method`` to every engine now (in call order); a future of all results."""
        answers = [e.issue(method, timeout_s=self.timeout_s, **kwargs) for e in self.engines]
        return asyncio.ensure_future(first_error_gather(answers))

    async def get_world_sizes(self) -> list[int]:
        return [e.world_size for e in self.engines]

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        offsets = self.rank_offsets(await self.get_world_sizes())
        await first_error_gather([
            e.call("init_weight_transfer", timeout_s=self.timeout_s, strategy_cfg=strategy_cfg,
                   sync_info=sync_info, rank_offset=off)
            for e, off in zip(self.engines, offsets, strict=True)
        ])

    async def start_weight_update(self, start: dict) -> None:
        await self._all("start_weight_update", start=start)

    def update_named_weights(self, request: dict) -> asyncio.Future:  # type: ignore[override]
        """Not ``async``: the request is queued to every engine before this returns, so a
        sender that calls it chunk after chunk keeps them in order while several are in
        flight. Await the returned future for the engines' answers."""
        return self._all("update_named_weights", request=request)

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        return await self._all("finish_weight_update", finish=finish)

    async def close_weight_transfer(self) -> None:
        await self._all("close_weight_transfer")

    async def get_versions(self) -> list[int]:
        return await self._all("get_version")

    async def state_digests(self) -> list[dict[str, dict[str, Any]]]:
        return await self._all("state_digest")
