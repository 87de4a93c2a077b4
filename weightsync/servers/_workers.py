"""Calls into the engine's vLLM workers that never hold the engine: the driver side of
``weightsync_call`` / ``weightsync_poll`` / ``weightsync_cancel``
(``weightsync.loaders.vllm_worker``).

Callers: ``weightsync.servers.control.UpdateControl`` only, on the server's one asyncio loop.

Why: vLLM's engine core runs one ``collective_rpc`` at a time and schedules no model step until
every worker answered it. A worker call that blocks (a rendezvous waiting for a trainer that
never joins or was killed mid-join, a collective waiting for a dead peer) would hold every
model request and every other control call behind it until its own timeout (measured before
this existed: a ``/score`` waited 11 s behind a 10 s rendezvous; a ``/reset_prefix_cache`` 51 s
behind a 30 s one). So each call carries an id and a slice: a worker answers after at most
``slice_s`` seconds, "pending" if the call is not done, and the call goes on in the worker.

* ``background=True`` (calls made while model requests are served: joining a communicator,
  closing it): slice 0, and the driver polls every 10 to 100 ms; the engine core is held for
  the RPC's own round trip only.
* ``background=False`` (calls made while an update holds the gate, so no model request runs:
  start, chunks, finish): slice ``RPC_SLICE_S``, so a fast call answers in one round trip and a
  slow one still leaves the engine core free every second (other control calls, health).

``abandon(why)`` cancels every call in progress in the workers (a new ``/init_communicator`` or
``/close_communicator`` supersedes a join nobody completes, or a chunk whose sender is gone): the
workers answer them as refused ("abandoned: ..."), and their callers get that answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: the longest one worker RPC holds vLLM's engine core while an update holds the gate
RPC_SLICE_S = 1.0
#: background calls: the first poll comes this soon, then the gap doubles up to POLL_MAX_S
POLL_FIRST_S = 0.01
POLL_MAX_S = 0.1
#: the most a call that only asks the engine something (cancel, state) may take
ENGINE_CALL_TIMEOUT_S = 5.0


@dataclass
class WorkerCall:
    """One call in progress in the workers: its id, endpoint method and what it does (for
    error texts, e.g. "joining the sender's group at 10.0.0.1:29500")."""

    id: str
    method: str
    what: str
    started: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        return f"{self.what} for {time.monotonic() - self.started:.0f}s"


class WorkerCalls:
    """The calls of one server into its engine's workers (their RPCs go through the one driver
    of vLLM workers, ``weightsync.loaders.vllm_driver.VLLMWorkers``)."""

    def __init__(self, engine: Any) -> None:
        from weightsync.loaders.vllm_driver import VLLMWorkers

        self.driver = VLLMWorkers(engine)
        self._ids = itertools.count(1)
        self.in_progress: dict[str, WorkerCall] = {}

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        return await self.driver.rpc(method, *args)

    async def call(self, method: str, kwargs: dict, *, what: str = "",
                   background: bool = False) -> list[dict]:
        """``method`` of every worker's endpoint; -> each worker's final answer (``{"ok", ...,
        "state"}``, see ``weightsync.loaders.vllm_worker``)."""
        call = WorkerCall(f"{method}-{next(self._ids)}", method, what or method)
        slice_s = 0.0 if background else RPC_SLICE_S
        self.in_progress[call.id] = call
        try:
            answers = await self.rpc("weightsync_call", method, kwargs, call.id, slice_s)
            pause = POLL_FIRST_S
            while any(_pending(a) for a in answers):
                if background:
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, POLL_MAX_S)
                answers = await self.rpc("weightsync_poll", call.id, slice_s)
            return list(answers)
        finally:
            self.in_progress.pop(call.id, None)

    def describe(self) -> str:
        """The calls in progress, e.g. ``"init_weight_transfer (joining ...) for 12s"``."""
        return ", ".join(c.describe() for c in self.in_progress.values()) or "none"

    def joining(self) -> WorkerCall | None:
        """The communicator join in progress, if any."""
        return next((c for c in self.in_progress.values()
                     if c.method == "init_weight_transfer"), None)

    async def abandon(self, why: str) -> None:
        """Cancel every call in progress in the workers; their callers get "abandoned: why"."""
        for call in list(self.in_progress.values()):
            try:
                await asyncio.wait_for(self.rpc("weightsync_cancel", call.id, why),
                                       ENGINE_CALL_TIMEOUT_S + RPC_SLICE_S)
            except Exception as e:  # noqa: BLE001 - the engine is gone or stuck; health says so
                log.warning("abandoning %s: %s: %s", call.describe(), type(e).__name__, e)


def _pending(answer: Any) -> bool:
    return isinstance(answer, dict) and bool(answer.get("pending"))
