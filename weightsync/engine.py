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
import contextlib
import logging
from collections.abc import AsyncIterator
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
    failed: str = ""  # why a chunk of this update failed; later chunks are refused


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
        """Receive and load one chunk; chunks must come in ``chunk_index`` order (put a
        ``ChunkTurnstile`` in front on a transport that may reorder calls). A chunk that is not
        loaded is still ``refuse``d to the receiver, so a collective strategy's peers are
        released."""
        if self.receiver is None:
            raise WeightSyncError(
                f"{self.name}: no receiver; call init_weight_transfer before updating weights"
            )
        req = self.receiver.parse_request(request)
        active = self._active
        problem = ""
        if active is None or req.update_id != active.update_id:
            problem = (
                f"chunk {req.chunk_index} of update {req.update_id!r} arrived without a "
                f"matching start_weight_update"
            )
        elif active.failed:
            problem = (
                f"chunk {req.chunk_index} refused: an earlier chunk of this update failed "
                f"({active.failed})"
            )
        elif req.chunk_index != active.chunks_done:
            problem = f"expected chunk {active.chunks_done}, got {req.chunk_index}"
        if problem:
            try:
                await self.receiver.refuse(req)
            except Exception as e:  # the data plane is gone too; the problem is the news
                log.warning("%s: refusing chunk %s failed: %s", self.name, req.chunk_index, e)
            raise WeightSyncError(f"{self.name}: {problem}")
        assert active is not None
        async with self._lock:
            try:
                # the receiver validates req against the loader before any byte moves
                await self.receiver.receive_and_load_weights(req, self.loader)
            except BaseException as e:
                active.failed = f"chunk {req.chunk_index}: {type(e).__name__}: {e}"[:500]
                if not isinstance(e, WeightMismatchError):
                    self._mark_torn(f"chunk {req.chunk_index} failed: {type(e).__name__}: {e}")
                elif active.touched:
                    self._mark_torn(f"chunk {req.chunk_index} rejected after earlier chunks loaded")
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


class ChunkTurnstile:
    """Lets ``update_named_weights`` calls through one at a time in ``chunk_index`` order.

    For transports that may run calls concurrently and out of order (a Ray async actor: Ray
    does not promise the order of an async actor's tasks) in front of a strictly ordered
    endpoint, when a sender keeps several chunks in flight. Chunk ``k`` of an update waits
    until chunk ``k - 1`` has passed through (loaded or failed); chunk 0 starts an update. A
    chunk that waits longer than ``timeout_s`` goes through anyway, and the endpoint refuses
    it with a clear message.
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._cond = asyncio.Condition()
        self._update: str | None = None
        self._next = 0

    @contextlib.asynccontextmanager
    async def turn(self, request: dict) -> AsyncIterator[None]:
        update_id, index = request.get("update_id"), int(request.get("chunk_index", 0))

        def mine() -> bool:
            if index == 0:
                return self._update != update_id or self._next == 0
            return self._update == update_id and self._next >= index

        async with self._cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cond.wait_for(mine), self.timeout_s)
        try:
            yield
        finally:
            async with self._cond:
                if index == 0:
                    self._update, self._next = update_id, 1
                elif self._update == update_id:
                    self._next = max(self._next, index + 1)
                self._cond.notify_all()
