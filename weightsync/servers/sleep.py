"""Colocate mode on the reward server: vLLM's sleep mode behind the control plane.

A reward model that shares its GPU with the policy sleeps while the policy generates and wakes
to score. vLLM's sleep mode (``--enable-sleep-mode``; CUDA and ROCm only) frees the GPU memory:
level 1 moves the weights to host memory and drops the KV cache, level 2 drops both (the next
weights must then come from a push). Routes (mounted by ``weightsync.servers.reward``):

- ``POST /sleep`` ``{"level": 1 | 2}`` (or ``?level=``; token required): waits for the requests
  in flight, frees the shadows staged updates keep beside the weights (worker call
  ``weightsync_release_staging``: they are not vLLM's memory), then sleeps; -> ``{"ok",
  "level", "sleep_s"}``. Refused (409) during an update.
- ``POST /wake_up`` ``{"tags": ["weights", "kv_cache"]}`` (or ``?tags=``; default both; token
  required) -> ``{"ok", "tags", "wake_s"}``.
- ``GET /is_sleeping`` -> ``{"is_sleeping", "level", "weights_asleep", "kv_cache_asleep",
  "weights_valid", "last_sleep_s", "last_wake_s"}``.

On a server started without sleep mode each of them answers 501 naming the flag (and, on a
CPU server, that vLLM has no sleep mode there); nothing else changes.

What holds while asleep (``SleepAwareControl``, the server's ``UpdateControl`` when sleep mode
is on):

- **A request wakes the engine** (weights and KV cache) before it runs, and is then served as
  usual; requests arriving meanwhile wait for the same wake.
- **A push lands while asleep**: the update's start wakes the weights only (the KV cache stays
  freed until the next request), the update loads into them, and the start's answer says so
  (``"sleep": ...``). After a level-2 sleep the old weights are gone: only a ``full`` update is
  accepted (409 naming the level otherwise), and a request before it is refused (409) rather
  than scored with weights that are not the served version.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' ``Request`` annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from weightsync.servers._http import json_body, service_route_class, token_checker
from weightsync.servers.control import ServiceError, UpdateControl
from weightsync.types import TrainingMode

TAGS = ("weights", "kv_cache")


class SleepMode:
    """The engine's sleep state and its transitions (one event loop: the server's).

    ``enabled``: the engine was started with sleep mode. ``device``: where it runs (named in
    the 501 of a server without sleep mode)."""

    def __init__(self, engine: Any, *, enabled: bool, device: str) -> None:
        self.engine = engine
        self.enabled = enabled
        self.device = device
        self.level = 0  # 0: awake
        self.asleep: set[str] = set()  # tags currently asleep
        self.weights_valid = True  # False from a level-2 sleep until a full update lands
        self.last_sleep_s: float | None = None
        self.last_wake_s: float | None = None
        self.control: UpdateControl | None = None
        self._in_flight = 0
        self._changing = False
        self._changed = asyncio.Condition()

    def _require(self) -> None:
        if not self.enabled:
            where = (" (vLLM's sleep mode needs CUDA or ROCm; this server runs on "
                     f"{self.device})" if self.device == "cpu" else "")
            raise ServiceError(501, "sleep mode is off on this server: start it with "
                                    f"--enable-sleep-mode{where}")

    def state(self) -> dict:
        self._require()
        return {"is_sleeping": bool(self.asleep), "level": self.level,
                "weights_asleep": "weights" in self.asleep,
                "kv_cache_asleep": "kv_cache" in self.asleep,
                "weights_valid": self.weights_valid,
                "last_sleep_s": self.last_sleep_s, "last_wake_s": self.last_wake_s}

    @contextlib.asynccontextmanager
    async def _transition(self) -> AsyncIterator[None]:
        """Exclusive: no request runs and no other transition happens inside."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._changing and not self._in_flight)
            self._changing = True
        try:
            yield
        finally:
            async with self._changed:
                self._changing = False
                self._changed.notify_all()

    async def sleep(self, level: int) -> dict:
        self._require()
        if isinstance(level, bool) or level not in (1, 2):
            raise ServiceError(400, f"level: 1 (weights to host memory) or 2 (weights "
                                    f"dropped), got {level!r}")
        if self.control is not None and self.control.active_update is not None:
            raise ServiceError(409, f"a weight update ({self.control.active_update}) is in "
                                    "progress; sleep after it finished")
        async with self._transition():
            t0 = time.perf_counter()
            # the shadows staged updates keep beside the weights are not vLLM's memory: its
            # sleep would leave them on the device (made again by the next staged update)
            with contextlib.suppress(Exception):
                await self.engine.collective_rpc("weightsync_release_staging")
            await self.engine.sleep(level=level)
            self.last_sleep_s = time.perf_counter() - t0
            self.level, self.asleep = level, set(TAGS)
            if level == 2:
                self.weights_valid = False
        return {"ok": True, "level": level, "sleep_s": self.last_sleep_s}

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        self._require()
        tags = list(tags or TAGS)
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ServiceError(400, f"tags: {unknown} unknown; give some of {list(TAGS)}")
        async with self._transition():
            return await self._wake(tags)

    async def _wake(self, tags: list[str]) -> dict:
        todo = [t for t in tags if t in self.asleep]
        t0 = time.perf_counter()
        if todo:
            await self.engine.wake_up(todo if len(todo) < len(TAGS) else None)
            self.asleep -= set(todo)
        self.last_wake_s = time.perf_counter() - t0
        if not self.asleep:
            self.level = 0
        return {"ok": True, "tags": todo, "wake_s": self.last_wake_s}

    @contextlib.asynccontextmanager
    async def awake(self) -> AsyncIterator[None]:
        """Around a request that runs the model: wake everything first (once, for everyone
        waiting), refuse when a level-2 sleep left no weights, count the request in flight."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._changing)
            if not self.weights_valid:
                raise ServiceError(409, "the weights were dropped by a level-2 sleep and no "
                                        "full update has landed since: push the weights "
                                        "(training mode full) before scoring")
            mine = bool(self.asleep)  # this request wakes the engine; later ones wait for it
            if mine:
                self._changing = True
            else:
                self._in_flight += 1
        if mine:
            woke = False
            try:
                await self._wake(list(TAGS))
                woke = True
            finally:
                async with self._changed:  # counted before a sleep can slip in
                    self._changing = False
                    self._in_flight += int(woke)
                    self._changed.notify_all()
        try:
            yield
        finally:
            async with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    async def before_update(self, mode: TrainingMode | None) -> str | None:
        """Called by an update's start: wake the weights if they sleep; -> what was done."""
        if "weights" not in self.asleep and self.weights_valid:
            return None
        if not self.weights_valid and mode is not TrainingMode.FULL:
            raise ServiceError(409, f"training_mode: {mode.value if mode else 'none'}, but a "
                                    "level-2 sleep dropped the weights: only a full update can "
                                    "restore them")
        async with self._transition():
            await self._wake(["weights"])
        return ("the weights were asleep: woken for this update; the KV cache stays asleep "
                "until the next request")


class SleepAwareControl(UpdateControl):
    """``UpdateControl`` whose requests wake a sleeping engine and whose updates land in a
    sleeping one (see the module docstring)."""

    def __init__(self, engine: Any, sleep_mode: SleepMode, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.sleep_mode = sleep_mode
        sleep_mode.control = self
        self._update_mode: TrainingMode | None = None

    @contextlib.asynccontextmanager
    async def serving(self, what: str = "request", label: str = "",
                      model: str | None = None) -> AsyncIterator[int]:
        async with self.sleep_mode.awake(), super().serving(what, label, model) as version:
            yield version

    async def start(self, metadata: dict, mode: TrainingMode | None, version: int | None) -> dict:
        named = metadata.get("training_mode")
        try:
            given = TrainingMode(named) if named else None
        except ValueError:
            given = None  # the start itself refuses it, naming the field
        effective = mode or given or self.default_training_mode
        note = await self.sleep_mode.before_update(effective)
        answer = await super().start(metadata, mode, version)
        self._update_mode = effective
        return {**answer, "sleep": note} if note else answer

    async def finish(self, metadata: dict, version: int | None) -> dict:
        answer = await super().finish(metadata, version)
        if answer.get("ok") and self._update_mode is TrainingMode.FULL:
            self.sleep_mode.weights_valid = True
        return answer


def sleep_router(sleep_mode: SleepMode, *, api_key: str | None = None) -> Any:
    """``/sleep``, ``/wake_up`` (token required), ``/is_sleeping`` (open)."""
    from fastapi import APIRouter, Request

    router = APIRouter(route_class=service_route_class())
    check_key = token_checker(api_key)

    @router.post("/sleep")
    async def sleep(request: Request) -> dict:
        check_key(request)
        body = await json_body(request)
        level: Any = body.get("level", request.query_params.get("level", 1))
        if isinstance(level, str) and level.isdigit():
            level = int(level)
        return await sleep_mode.sleep(level)

    @router.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        check_key(request)
        body = await json_body(request)
        tags = body.get("tags") or request.query_params.getlist("tags") or None
        if tags is not None and (not isinstance(tags, list)
                                 or not all(isinstance(t, str) for t in tags)):
            raise ServiceError(400, f"tags: a list of strings, got {tags!r}")
        return await sleep_mode.wake_up(tags)

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return sleep_mode.state()

    return router
