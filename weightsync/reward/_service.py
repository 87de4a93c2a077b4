"""The reward server's logic, without HTTP: scoring and the weight-update lifecycle on AsyncLLM.

Callers: ``weightsync.reward._server_app`` (routes) in the server process, on its one asyncio
loop. The vLLM engine runs with ``WeightSyncWorkerExtension``; every weight/communicator call
becomes ``collective_rpc("weightsync_call", ...)`` to all workers, and the workers' state
(version, ready/updating/torn) is mirrored here after each call.

What must hold:
* every score response comes from one complete weight version, and carries it: scores hold
  the read side of ``UpdateGate``, an update holds the write side from start to finish;
* a torn engine (an update died after some chunks landed) answers 503 with the reason until a
  complete update lands; a refused update (bad names/shapes/dtypes/mode) changes nothing;
* an update abandoned by its sender (no call for ``update_timeout_s``) is aborted, so the gate
  never stays closed forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import http_status
from weightsync.reward._gate import UpdateGate
from weightsync.reward.types import RewardModelTrainingMode, ScoringRequest, ScoringResponse

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An answer with an HTTP status; ``offenders`` lists bad parameters when there are some."""

    def __init__(self, status: int, message: str, *, offenders: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.offenders = offenders or []


@dataclass
class _ActiveUpdate:
    update_id: str
    training_mode: RewardModelTrainingMode
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    chunks: int = 0


class RewardService:
    """Scores texts with an ``AsyncLLM`` pooling engine and applies weight updates to it."""

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str,
        num_labels: int,
        score_wait_timeout_s: float = 60.0,
        update_timeout_s: float = 600.0,
        head_name_patterns: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.num_labels = num_labels
        self.score_wait_timeout_s = score_wait_timeout_s
        self.update_timeout_s = update_timeout_s
        self.head_name_patterns = head_name_patterns
        self.gate = UpdateGate()
        self.version = 0
        self.worker_states: list[dict] = []
        self._active: _ActiveUpdate | None = None
        self._control = asyncio.Lock()  # one control call at a time
        self._control_in_flight = 0
        self._world_size: int | None = None
        self.communicator_id = 0  # bumped by every init_communicator; 0: none

    # -- worker calls ------------------------------------------------------------------------
    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await self.engine.collective_rpc(method, args=args)

    async def _call(self, method: str, kwargs: dict) -> list[Any]:
        """``weightsync_call`` on every worker; mirror their state; raise a ``ServiceError``."""
        answers = await self._rpc("weightsync_call", method, kwargs)
        self._mirror([a.get("state", {}) for a in answers if isinstance(a, dict)])
        for a in answers:
            if not a.get("ok"):
                kind = a.get("error_type", "")
                raise ServiceError(
                    http_status(kind),
                    a.get("error") or kind,
                    offenders=a.get("offenders") or [],
                )
        return [a.get("result") for a in answers]

    def _mirror(self, states: list[dict]) -> None:
        if states:
            self.worker_states = states
            self.version = min(int(s.get("version", 0)) for s in states)

    async def refresh_state(self) -> list[dict]:
        self._mirror(list(await self._rpc("weightsync_state")))
        return self.worker_states

    async def world_size(self) -> int:
        if self._world_size is None:
            sizes = await self._rpc("weightsync_world_size")
            self._world_size = int(sizes[0])
        return self._world_size

    @property
    def torn_reason(self) -> str | None:
        for s in self.worker_states:
            if s.get("state") == "torn":
                return s.get("last_error") or "a weight update failed part-way"
        return None

    # -- scoring -----------------------------------------------------------------------------
    async def score(self, req: ScoringRequest) -> ScoringResponse:
        if req.model is not None and req.model != self.model_name:
            raise ServiceError(404, f"model: {req.model!r} is not served here; this server "
                                    f"serves {self.model_name!r}")
        empty = [i for i, t in enumerate(req.texts) if not t]
        if empty:
            raise ServiceError(400, f"input: items {empty[:10]} are empty strings; nothing to score")
        await self._expire_stale_update()
        try:
            await self.gate.acquire_read(self.score_wait_timeout_s)
        except TimeoutError:
            active = self._active
            raise ServiceError(
                503,
                f"a weight update ({active.update_id if active else 'unknown'}) has been in "
                f"progress for {time.monotonic() - self.gate.writer_since:.0f}s; retry later",
            ) from None
        try:
            reason = self.torn_reason
            if reason is not None:
                raise ServiceError(
                    503,
                    f"weights are incomplete after a failed update ({reason}); refusing to score "
                    f"until a complete update lands (last complete version {self.version})",
                )
            version = self.version
            outputs = await asyncio.gather(
                *(self._encode(i, t, req.use_activation) for i, t in enumerate(req.texts))
            )
        finally:
            await self.gate.release_read()
        scores = [s for s, _ in outputs]
        tokens = sum(n for _, n in outputs)
        return ScoringResponse(scores, version=version, prompt_tokens=tokens, model=self.model_name)

    async def _encode(self, index: int, text: str, use_activation: bool) -> tuple[Any, int]:
        from vllm import PoolingParams

        from weightsync._runtime.vllm_compat import request_error_types

        params = PoolingParams(task="classify", use_activation=use_activation)
        final = None
        try:
            async for out in self.engine.encode(text, params, f"score-{uuid.uuid4().hex}"):
                final = out
        except request_error_types() as e:  # vLLM's input validation (e.g. too long)
            raise ServiceError(400, f"input[{index}]: {e}") from None
        if final is None:  # pragma: no cover
            raise ServiceError(500, f"input[{index}]: the engine returned no output")
        data = final.outputs.data
        values = [float(x) for x in data.reshape(-1).tolist()]
        score: Any = values[0] if self.num_labels == 1 else values
        return score, len(final.prompt_token_ids or [])

    # -- weight-update control plane -----------------------------------------------------------
    async def init_communicator(self, strategy: dict, sync_info: dict, rank_offset: int) -> int:
        """Build the workers' receivers; returns the new communicator id (older senders are
        refused from now on: their data plane is gone)."""
        if self._active is not None:  # its sender's data plane is about to be replaced
            await self._abort_active("the communicator was re-initialised by another sender")
        async with self._guard():
            self.communicator_id = 0
            await self._call(
                "init_weight_transfer",
                {"strategy_cfg": strategy, "sync_info": sync_info, "rank_offset": rank_offset},
            )
            self._next_id = getattr(self, "_next_id", 0) + 1
            self.communicator_id = self._next_id
        return self.communicator_id

    async def close_communicator(self) -> None:
        if self._active is not None:
            await self._abort_active("the communicator was closed")
        async with self._guard():
            self.communicator_id = 0
            await self._call("close_weight_transfer", {})

    async def update_param_batch(
        self,
        metadata: dict,
        training_mode: RewardModelTrainingMode,
        version: int | None,
        communicator_id: int | None = None,
    ) -> dict:
        if communicator_id is not None and communicator_id != self.communicator_id:
            raise ServiceError(
                409,
                f"communicator_id: {communicator_id}, but the communicator was replaced (current "
                f"id {self.communicator_id or 'none'}): another sender initialised it or it was "
                f"closed; call /init_communicator again",
            )
        kind = metadata.get("type")
        if kind == "start":
            return await self._start(metadata, training_mode, version)
        if kind == "finish":
            return await self._finish(metadata, version)
        return await self._chunk(metadata, training_mode)

    async def _start(
        self, metadata: dict, mode: RewardModelTrainingMode, version: int | None
    ) -> dict:
        from weightsync.types import WeightUpdateStart

        try:
            start = WeightUpdateStart.from_dict(metadata)
        except ValueError as e:
            raise ServiceError(400, f"metadata: {e}") from None
        if version is not None:
            if start.version is not None and start.version != version:
                raise ServiceError(400, f"version: {version} but metadata.version is {start.version}")
            start.version = version
        if start.training_mode is not None and start.training_mode is not mode:
            raise ServiceError(400, f"training_mode: {mode.value} but metadata.training_mode is "
                                    f"{start.training_mode.value!r}")
        start.training_mode = mode
        if start.head_name_patterns is None and self.head_name_patterns is not None:
            start.head_name_patterns = list(self.head_name_patterns)
        await self._expire_stale_update()
        if self._active is not None:
            if self._active.update_id == start.update_id:
                raise ServiceError(409, f"update {start.update_id} was already started")
            await self._abort_active(f"superseded by update {start.update_id}", keep_gate=True)
            await self.gate.transfer_write(start.update_id)
        else:
            try:
                await self.gate.acquire_write(start.update_id, self.score_wait_timeout_s)
            except TimeoutError:
                raise ServiceError(503, "scores in flight did not drain in "
                                        f"{self.score_wait_timeout_s:g}s; retry the update") from None
        try:
            async with self._guard():
                await self._call("start_weight_update", {"start": start.to_dict()})
        except BaseException:
            await self.gate.release_write(start.update_id)
            raise
        self._active = _ActiveUpdate(start.update_id, mode)
        return {"ok": True, "update_id": start.update_id, "version": self.version}

    def _require_active(self, update_id: str, what: str) -> _ActiveUpdate:
        active = self._active
        if active is None or active.update_id != update_id:
            current = f"update {active.update_id} is in progress" if active else "no update is in progress"
            raise ServiceError(409, f"{what} of update {update_id!r} without its start ({current})")
        active.last_activity = time.monotonic()
        return active

    async def _chunk(self, metadata: dict, mode: RewardModelTrainingMode) -> dict:
        update_id = str(metadata.get("update_id", ""))
        active = self._require_active(update_id, f"chunk {metadata.get('chunk_index')}")
        if mode is not active.training_mode:
            raise ServiceError(400, f"training_mode: {mode.value} but update {update_id} started "
                                    f"as {active.training_mode.value}")
        async with self._guard():
            await self._call("update_named_weights", {"request": metadata})
        active.chunks += 1
        active.last_activity = time.monotonic()
        return {"ok": True, "chunks": active.chunks}

    async def _finish(self, metadata: dict, version: int | None) -> dict:
        from weightsync.types import WeightUpdateFinish

        try:
            finish = WeightUpdateFinish.from_dict(metadata)
        except ValueError as e:
            raise ServiceError(400, f"metadata: {e}") from None
        if version is not None and finish.version is None:
            finish.version = version
        self._require_active(finish.update_id, "finish")
        try:
            async with self._guard():
                results = await self._call("finish_weight_update", {"finish": finish.to_dict()})
            if finish.ok:
                from weightsync._runtime.vllm_compat import async_reset_prefix_cache

                await async_reset_prefix_cache(self.engine)
        finally:
            self._active = None
            await self.gate.release_write(finish.update_id)
        published = int(results[0]) if results and results[0] is not None else self.version
        return {"ok": finish.ok, "version": published, "state": self.torn_reason or "ready"}

    async def _abort_active(self, why: str, *, keep_gate: bool = False) -> None:
        from weightsync.types import WeightUpdateFinish

        active = self._active
        if active is None:
            return
        log.warning("aborting weight update %s: %s", active.update_id, why)
        finish = WeightUpdateFinish(
            update_id=active.update_id, num_chunks=active.chunks, ok=False, error=why
        )
        try:
            async with self._guard():
                await self._call("finish_weight_update", {"finish": finish.to_dict()})
        except ServiceError as e:  # the workers may not know it (never started there)
            log.warning("abort of %s: %s", active.update_id, e.message)
        finally:
            self._active = None
            if not keep_gate:
                await self.gate.release_write(active.update_id)

    async def _expire_stale_update(self) -> None:
        active = self._active
        if active is not None and time.monotonic() - active.last_activity > self.update_timeout_s:
            await self._abort_active(
                f"no call for {self.update_timeout_s:g}s; the sender is gone"
            )

    async def reset_prefix_cache(self) -> bool:
        from weightsync._runtime.vllm_compat import async_reset_prefix_cache

        return await async_reset_prefix_cache(self.engine)

    def num_background_tasks(self) -> int:
        return self._control_in_flight + (1 if self._active is not None else 0)

    def runtime_version(self) -> dict:
        active = self._active
        return {
            "version": self.version,
            "state": "torn" if self.torn_reason else ("updating" if active else "ready"),
            "update_in_progress": active.update_id if active else None,
        }

    def _guard(self) -> _ControlGuard:
        return _ControlGuard(self)


class _ControlGuard:
    """Serialises control calls and counts them (``/get_num_background_tasks``)."""

    def __init__(self, service: RewardService) -> None:
        self.s = service

    async def __aenter__(self) -> None:
        self.s._control_in_flight += 1
        await self.s._control.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self.s._control.release()
        self.s._control_in_flight -= 1
