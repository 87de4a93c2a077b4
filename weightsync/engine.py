"""Engine-side endpoint: the state machine that every receiving engine runs.

``WeightUpdateEndpoint`` lives in the engine process (or a vLLM worker). Whatever carries the
control plane (a Ray actor, a local serving loop, the reward server's HTTP routes, a vLLM worker
extension) forwards the client's plain-dict calls to it:

    init_weight_transfer(strategy_cfg, sync_info, rank_offset)
    start_weight_update(start)    -> validates the whole manifest before any byte moves
    update_named_weights(request) -> receives one chunk and loads it
    finish_weight_update(finish)  -> publishes the new version if every chunk landed

Versions are monotonic. While an update is half-applied the endpoint is ``torn`` and
``check_serving()`` raises ``UpdateIncompleteError``: the engine never serves a silent mix of
old and new weights; it serves again once a complete update lands.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from weightsync.errors import UpdateIncompleteError, WeightMismatchError, WeightSyncError
from weightsync.interfaces import WeightLoader, WeightTransferReceiver
from weightsync.types import WeightUpdateFinish, WeightUpdateStart

log = logging.getLogger(__name__)


@dataclass
class _Active:
    update_id: str
    version: int | None
    chunks_done: int = 0
    touched: bool = False  # a chunk was (possibly partly) loaded


class WeightUpdateEndpoint:
    """Receiver + loader + version bookkeeping for one engine (worker)."""

    def __init__(self, loader: WeightLoader, *, version: int = 0, name: str = "engine") -> None:
        self.loader = loader
        self.receiver: WeightTransferReceiver | None = None
        self.strategy: Any = None
        self.version = version
        self.name = name
        self.state = "ready"  # ready | updating | torn
        self.last_error = ""
        self._active: _Active | None = None
        self._lock = asyncio.Lock()

    # -- set-up -----------------------------------------------------------------------------
    async def init_weight_transfer(
        self, strategy_cfg: dict, sync_info: dict, rank_offset: int
    ) -> None:
        from weightsync.config import build_strategy
        from weightsync.types import WeightSyncInfo

        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        self.strategy = build_strategy(strategy_cfg)
        info = WeightSyncInfo.from_dict(sync_info)
        self.receiver = await self.strategy.create_receiver(None, info, rank_offset)

    async def close_weight_transfer(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    # -- one update ---------------------------------------------------------------------------
    async def start_weight_update(self, start: dict) -> None:
        msg = WeightUpdateStart.from_dict(start)
        if self._active is not None and self._active.touched:
            self._mark_torn(
                f"update {self._active.update_id} was abandoned after "
                f"{self._active.chunks_done} chunk(s) loaded"
            )
        if msg.manifest is not None:
            self.loader.validate(msg.manifest)  # raises before anything changes
        if msg.version is not None and msg.version <= self.version:
            raise WeightSyncError(
                f"{self.name}: update version {msg.version} is not newer than the served "
                f"version {self.version}; versions must increase"
            )
        self._active = _Active(msg.update_id, msg.version)
        if self.state != "torn":
            self.state = "updating"
        await self.loader.start_update(msg)

    async def update_named_weights(self, request: dict) -> None:
        if self.receiver is None:
            raise WeightSyncError(
                f"{self.name}: no receiver; call init_weight_transfer before updating weights"
            )
        req = self.receiver.parse_request(request)
        active = self._active
        if active is None or req.update_id != active.update_id:
            raise WeightSyncError(
                f"{self.name}: chunk {req.chunk_index} of update {req.update_id!r} arrived "
                f"without a matching start_weight_update"
            )
        if req.chunk_index != active.chunks_done:
            raise WeightSyncError(
                f"{self.name}: expected chunk {active.chunks_done}, got {req.chunk_index}"
            )
        async with self._lock:
            try:
                # the receiver validates req against the loader before any byte moves
                await self.receiver.receive_and_load_weights(req, self.loader)
            except WeightMismatchError:
                if active.touched:
                    self._mark_torn(f"chunk {req.chunk_index} rejected after earlier chunks loaded")
                raise
            except BaseException as e:
                self._mark_torn(f"chunk {req.chunk_index} failed: {type(e).__name__}: {e}")
                raise
            active.touched = True
        active.chunks_done += 1

    async def finish_weight_update(self, finish: dict) -> int:
        msg = WeightUpdateFinish.from_dict(finish)
        active = self._active
        if active is None or active.update_id != msg.update_id:
            raise WeightSyncError(f"{self.name}: finish for unknown update {msg.update_id!r}")
        self._active = None
        if not msg.ok or active.chunks_done != msg.num_chunks:
            reason = msg.error or (
                f"{active.chunks_done} of {msg.num_chunks} chunks landed"
            )
            if active.touched:
                self._mark_torn(f"update {msg.update_id} aborted: {reason}")
            else:
                self.state = "ready" if self.state != "torn" else "torn"
            if msg.ok:
                raise WeightSyncError(f"{self.name}: incomplete update: {reason}")
            return self.version
        await self.loader.finish_update(msg)
        self.version = msg.version if msg.version is not None else self.version + 1
        self.state = "ready"
        self.last_error = ""
        return self.version

    # -- serving side ----------------------------------------------------------------------------
    def check_serving(self) -> None:
        """Raise if the weights are a partial update (callers: the engine's request path)."""
        if self.state == "torn":
            raise UpdateIncompleteError(
                f"{self.name}: weights are incomplete after a failed update ({self.last_error}); "
                f"refusing to serve until a complete update lands (last complete version "
                f"{self.version})"
            )

    def _mark_torn(self, why: str) -> None:
        self.state = "torn"
        self.last_error = why
        log.error("%s: %s", self.name, why)

    # -- dispatch for transports that carry (method, kwargs) ---------------------------------
    async def call(self, method: str, kwargs: dict) -> Any:
        if method not in _METHODS:
            raise WeightSyncError(f"unknown endpoint method {method!r}; known: {sorted(_METHODS)}")
        return await getattr(self, method)(**kwargs)


_METHODS = {
    "init_weight_transfer",
    "close_weight_transfer",
    "start_weight_update",
    "update_named_weights",
    "finish_weight_update",
}
