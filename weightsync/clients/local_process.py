"""``LocalChannel``: the channel to a ``weightsync.local.LocalEngineProcess``.

Lives in the sending process. The engine's child processes answer one JSON message at a time, in
the order they were sent; ``LocalEngineProcess.issue`` queues the message before it returns, so
the channel is ordered (a sender may keep two chunks in flight). Errors come back rebuilt by the
codec and name the engine; a dead child is an ``EngineDiedError`` at once (EOF), a silent one a
``WeightSyncTimeout``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.local.process import LocalEngineProcess


class LocalChannel:
    ordered = True
    one_call = True  # the child hands every endpoint method to WeightUpdateEndpoint.call

    def __init__(self, engine: LocalEngineProcess, *, name: str | None = None) -> None:
        self.engine = engine
        self.name = name or engine.name

    async def world_size(self) -> int:
        return self.engine.world_size

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        return self.engine.issue(method, timeout_s=timeout_s, **kwargs)

    async def aclose(self) -> None:
        return None  # the engine process belongs to whoever spawned it

    def __repr__(self) -> str:
        return f"LocalChannel({self.name!r})"
