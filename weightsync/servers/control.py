"""The server side of the weight-update control plane, shared by the reward and the policy server.

``UpdateControl`` lives in a server process, on its one asyncio loop, next to vLLM's
``AsyncLLM`` (built with ``WeightSyncWorkerExtension`` in every worker). Callers: the control
routes (``weightsync.servers.control_routes``), the request paths that run the model (``/score``
on the reward server, the OpenAI routes on the policy server, through ``serving()``) and the
Ludic dialect (``weightsync.servers.ludic``). Every weight/communicator call becomes
``collective_rpc("weightsync_call", ...)`` to all workers, where ``WeightUpdateEndpoint`` runs the
update state machine; the workers' state (version, ready/updating/torn) is mirrored here after
each call.

What must hold:
* every response that ran the model comes from one complete weight version, and carries it:
  requests hold the read side of ``UpdateGate`` (``serving()``), an update holds the write side
  from start to finish, so in-flight requests drain before the first byte lands and new ones
  wait until the update is done; a LoRA adapter-only update (``scoped_by_model``: the policy
  server with ``--enable-lora``) does that only with the requests that name its adapter (or no
  model the middleware could read): the base model's requests, and other adapters', neither
  wait for it nor hold it back, since it changes nothing they read;
* a torn engine (an update died after some chunks landed) answers 503 with the reason until a
  complete update lands; a refused update (bad names/shapes/dtypes/mode) changes nothing;
* the version changes only when an update completed; the prefix cache is reset after every
  completed update (cached KV blocks were computed by the old weights);
* an update abandoned by its sender (no call for its idle limit: the start's
  ``idle_timeout_s``, at most the server's ``update_timeout_s``) is aborted by a watchdog, and an
  update whose chunk failed is aborted at once (the engine refuses its later chunks anyway), so
  the gate never stays closed for a sender that died: requests are served again (the old
  version if nothing had landed or the update was staged, else 503 "incomplete") and the next
  sender can start;
* with ``pause_generation`` (the policy server) the engine's scheduler is paused from start to
  finish as well, so nothing the gate does not see (a route we do not know) decodes across the
  change either (not for an adapter-only update: vLLM's pause would wait for every request);
* no worker call holds the engine: calls go through ``weightsync.servers._workers.WorkerCalls``
  (a worker answers "pending" after a slice and the call goes on in the worker), so a join that
  nobody completes does not hold model requests; a new ``init_communicator`` or
  ``close_communicator`` abandons whatever call is still in progress (a join, a chunk whose
  sender is gone) instead of waiting for it, and an update refuses to start while a join is
  under way (409);
* every control call waits a bounded time: for the control call in progress at most
  ``wait_timeout_s`` (503 naming that call), for an engine-level call (prefix-cache reset,
  state) at most ``ENGINE_CALL_TIMEOUT_S`` (504 naming it); a broadcast ``sync_info`` whose
  rendezvous address accepts no connection is refused (400) before any worker waits for it.

``serve_during_updates`` (the reference server's behaviour, made safe): requests are not held
while an update is received. Every update is staged (``WeightUpdateStart.staged``: the engine
keeps the incoming tensors aside and its weights stay the last complete version), the gate's
write side is taken only at the finish, where in-flight requests drain, the staged tensors are
loaded, the prefix cache is reset and the version flips; requests are then served by the new
version. Every answer still carries the version that produced it. Costs one more copy of the
update's bytes on the engine; a worker call of the update holds vLLM's engine core (which
then runs no model step) for at most one slice at a time (``_workers.RPC_SLICE_S``, 1 s), so
answers slow down while bytes arrive but are not refused. ``policy``
(``weightsync.servers._update_policy``): whether an update's version must be newer (409
otherwise) or is taken as given, and whether its training mode is its name policy or information.

``in_flight="continue"`` (PipelineRL-style; implies ``serve_during_updates``): the finish does
not drain. At a step boundary the engine is paused keeping its requests, their KV is dropped,
the count of tokens each has produced is taken (all by the old weights), the staged tensors are
loaded, and generation resumes: requests in flight continue on the new weights (their KV
recomputed by them), new ones never wait for old ones. Each such flip is kept (``flips``) and
``spans_for`` gives a request the token index where its version changed, which the policy
server adds to its answer (``weight_version_spans``). The stall is the flip alone (pause, load,
resume: ``Flip.paused_s``), not the longest request in flight. ``in_flight_kv="keep"``
(PipelineRL's choice): the requests' KV is not dropped at the flip, so they go on from the KV
the old weights computed, with no recompute after the resume; the prefix cache is then not
reset either (blocks in use cannot be), and instead every request that may run the model is
salted with the version it started on (``cache_salt_for``, which the policy server's middleware
adds to the request as vLLM's ``cache_salt``): a request never reuses KV computed under another
version than its own, except what a request in flight at the flip computed for itself. With the
KV kept, nothing needs the scheduler paused: where the engine core has weightsync's utility
(``weightsync._runtime.vllm_flip``, registered by weightsync's vLLM plugin), the flip is that
utility, run by the engine core between two steps (count the tokens, the workers' finish), and
no step is scheduled while it runs (the step in flight runs on); without it the flip pauses as
above.

Logs (logger ``weightsync.servers.control``, prefixed with the server's name): every update's
start (version, tensors, bytes, the drain), refusal (why), landing (version, chunks, bytes,
seconds) and abort (why), in our words; see ``docs/reliability.md``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import http_status
from weightsync.servers._adapter_slots import SEATED
from weightsync.servers._gate import UpdateGate
from weightsync.servers._update_policy import UpdatePolicy
from weightsync.servers._workers import ENGINE_CALL_TIMEOUT_S, WorkerCalls
from weightsync.types import TrainingMode, request_nbytes

log = logging.getLogger(__name__)

#: what happens to requests in flight when an update lands: "finish" (they drain first, on the
#: old weights) or "continue" (they go on with the new ones; see the module docstring)
IN_FLIGHT_MODES = ("finish", "continue")
#: with ``in_flight="continue"``: what happens to the requests' KV at the flip
IN_FLIGHT_KV = ("recompute", "keep")
#: flips kept for the answers of requests still in flight (a request older than this many
#: flips reports only the ones kept)
_KEPT_FLIPS = 256


class ServiceError(Exception):
    """An answer with an HTTP status; ``offenders`` lists bad parameters when there are some;
    ``error_type`` names the engine's exception class when the error came from the workers (the
    body carries it, so ``weightsync.errors.error_from_http`` rebuilds that exact class)."""

    def __init__(self, status: int, message: str, *, offenders: list[str] | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.offenders = offenders or []
        self.error_type = error_type


@dataclass
class Flip:
    """One update that landed under requests in flight (``in_flight="continue"``): the version
    before and after, and for each request the engine held then, how many of its output tokens
    the old weights produced (vLLM's request id -> count); ``paused_s``: how long generation
    stood still for it (a flip between two steps: how long it held vLLM's engine core);
    ``split_ms``: where the flip's time went (``freeze``: pausing the scheduler at a step
    boundary and counting tokens, ``load``: the workers' finish, which loads the staged
    tensors, ``prefix_reset``, ``resume``; a flip between two steps: ``call``, the engine-core
    utility's round trip, then ``prefix_reset`` and ``resume``, both nothing there)."""

    seq: int
    old_version: int
    new_version: int
    counts: dict[str, int]
    paused_s: float
    split_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class _ActiveUpdate:
    update_id: str
    training_mode: TrainingMode | None
    idle_timeout_s: float = 600.0  # no call for this long: the sender is gone
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    chunks: int = 0
    nbytes: int = 0  # what the chunks that landed carried
    paused: bool = False  # the engine's scheduler is paused for this update
    holds_gate: bool = True  # False: staged while requests are served (serve_during_updates)
    watchdog: asyncio.Task | None = None
    adapter: str | None = None  # a LoRA adapter-only update: the adapter's name
    slot: int = 0  # ... the version slot it is installed in (``adapter_slots``)
    scope: str | None = None  # the gate's scope it writes (``_gate``): None, the weights
    split_ms: dict[str, float] = field(default_factory=dict)  # the finish's phases (continue)


class UpdateControl:
    """Weight updates into one ``AsyncLLM`` engine, and the gate that keeps requests on one
    version.

    ``default_training_mode``: the mode of an update whose caller names none, neither in the
    body nor in the start (the reward server: FULL, as the reward spec says; the policy server:
    None, no name policy).
    ``wait_timeout_s``: how long a request waits for a running update, and an update for the
    in-flight requests to drain. ``update_timeout_s``: an update with no call for this long is
    aborted. ``pause_generation``: pause the engine's scheduler during updates (generation).
    ``serve_during_updates``, ``policy``: see the module docstring (None: ``UpdatePolicy()``,
    the reward spec's rules).
    """

    def __init__(
        self,
        engine: Any,
        *,
        name: str = "server",
        wait_timeout_s: float = 60.0,
        update_timeout_s: float = 600.0,
        head_name_patterns: list[str] | None = None,
        default_training_mode: TrainingMode | None = TrainingMode.FULL,
        pause_generation: bool = False,
        serve_during_updates: bool = False,
        policy: UpdatePolicy | None = None,
        in_flight: str = "finish",
        in_flight_kv: str = "recompute",
        adapter_slots: int = 1,
    ) -> None:
        if not isinstance(adapter_slots, int) or adapter_slots < 1:
            raise ValueError(f"adapter_slots must be an int >= 1, got {adapter_slots!r}")
        if adapter_slots > 1 and in_flight == "continue":
            raise ValueError("adapter_slots > 1 keeps each request on the adapter version it "
                             "started with; in_flight='continue' moves it to the new one")
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {list(IN_FLIGHT_MODES)}, got "
                             f"{in_flight!r}")
        if in_flight_kv not in IN_FLIGHT_KV or (in_flight_kv == "keep"
                                                and in_flight != "continue"):
            raise ValueError(f"in_flight_kv must be one of {list(IN_FLIGHT_KV)} ('keep' with "
                             f"in_flight='continue' only), got {in_flight_kv!r}")
        self.engine = engine
        self.name = name
        self.wait_timeout_s = wait_timeout_s
        self.update_timeout_s = update_timeout_s
        self.head_name_patterns = head_name_patterns
        self.default_training_mode = default_training_mode
        self.pause_generation = pause_generation
        self.in_flight = in_flight
        #: requests say which model they ask for (the policy server with LoRA adapters sets it):
        #: an adapter-only update then waits only for requests of that adapter (``_gate``),
        #: and requests are salted by version (an adapter-only update resets no prefix cache)
        self.scoped_by_model = False
        #: a request that asks for prompt logprobs runs alone (``serving(alone=True)``; the
        #: policy server sets it: ``policy.prompt_logprobs_alone``)
        self.prompt_logprobs_alone = False
        #: version slots per LoRA adapter (``weightsync.servers._adapter_slots``): with 2 or
        #: more an adapter-only update goes into another slot than the one serving and waits
        #: only for requests on the slot it reuses; 1: the slot is rewritten
        self.adapter_slots = adapter_slots
        self._adapter_slot: dict[str, int] = {}  # each adapter's published slot
        #: keep the KV of requests in flight at a flip (``in_flight_kv="keep"``): no recompute,
        #: no prefix-cache reset; requests are salted by version instead (``cache_salt_for``)
        self.keep_kv = in_flight_kv == "keep"
        # continuing requests across an update needs it staged beside the served weights
        self.serve_during_updates = serve_during_updates or in_flight == "continue"
        self.flips: collections.deque[Flip] = collections.deque(maxlen=_KEPT_FLIPS)
        self.flip_seq = 0  # how many flips happened; a request notes it when it starts
        #: whether the engine core flips between two steps (``_runtime.vllm_flip``); asked at
        #: the first kept-KV flip
        self._flips_between_steps: bool | None = None
        self.policy = policy or UpdatePolicy()
        self.gate = UpdateGate()
        self.workers = WorkerCalls(engine)
        self.version = 0
        self.worker_states: list[dict] = []
        self.communicator_id = 0  # bumped by every init_communicator; 0: none
        self._next_id = 0
        self._active: _ActiveUpdate | None = None
        self._control = asyncio.Lock()  # one control call at a time
        self._control_in_flight = 0
        self._world_size: int | None = None
        # bumped by every drop_communicator: a join that was superseded before it reached the
        # workers (it waited for the control call in progress) must not start there
        self._communicator_epoch = 0
        self._dropped_why = ""
        self._background: set[asyncio.Task] = set()
        #: called with ``(adapter, slot)`` once a LoRA adapter-only update of it landed in that
        #: slot (the policy server lets requests name it from then on)
        self.adapter_published: Callable[[str, int], None] | None = None

    # -- worker calls ------------------------------------------------------------------------
    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        """An engine-level worker RPC that answers at once (state, world size): bounded."""
        try:
            return await asyncio.wait_for(self.workers.rpc(method, *args), ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            raise ServiceError(504, f"the engine did not answer {method} within "
                                    f"{ENGINE_CALL_TIMEOUT_S:g}s (worker calls in progress: "
                                    f"{self.workers.describe()})") from None

    async def call_workers(self, method: str, kwargs: dict, *, what: str = "",
                           background: bool = False) -> list[Any]:
        """``method`` on every worker's endpoint (``WorkerCalls.call``); mirror their state;
        raise a ``ServiceError``."""
        return self._results(await self.workers.call(method, kwargs, what=what,
                                                      background=background))

    def _results(self, answers: list[Any]) -> list[Any]:
        """The workers' final answers: mirror their state; their results, or a ``ServiceError``
        for the first that failed."""
        self._mirror([a.get("state", {}) for a in answers if isinstance(a, dict)])
        for a in answers:
            if not a.get("ok"):
                kind = a.get("error_type", "")
                raise ServiceError(
                    http_status(kind),
                    a.get("error") or kind,
                    offenders=a.get("offenders") or [],
                    error_type=kind or None,
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
        """Workers of this engine (TP x PP): the receivers of a broadcast."""
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

    # -- the read side: requests that run the model ------------------------------------------
    @contextlib.asynccontextmanager
    async def serving(self, what: str = "request", label: str = "",
                      model: str | None = None, *, alone: bool = False) -> AsyncIterator[int]:
        """Hold the read side while a request runs the model; yields the version that serves
        it. Raises ``ServiceError(503)`` when an update runs longer than ``wait_timeout_s`` or
        the weights are torn. ``label`` (e.g. ``"POST /v1/completions"``) names the request in
        the error an update gets when it cannot drain. ``model``: the model the request asked
        for, when known: a LoRA adapter-only update of another adapter neither waits for it nor
        holds it back (``_gate``). ``alone``: the request runs with no other in flight (it
        waits for them; new ones wait for it; ``wait_timeout_s`` bounds its wait too)."""
        await self.expire_stale_update()
        try:
            token, slot = await self._seat(label or what, model, alone)
        except TimeoutError:
            active = self._active
            if self.gate.writer is None and (alone or self.gate.alone_busy):
                # no update held it: a request that runs alone waited, or was waited for
                why = "this request runs alone (it asks for prompt logprobs): " if alone else ""
                raise ServiceError(
                    503, f"{why}the requests in flight ({self.gate.in_flight()}) did not finish "
                         f"within {self.wait_timeout_s:g}s; retry later") from None
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
                    f"weights are incomplete after a failed update ({reason}); refusing to "
                    f"{what} until a complete update lands (last complete version {self.version})",
                )
            seated = SEATED.set({model: slot}) if slot is not None and model else None
            try:
                yield self.version
            finally:
                if seated is not None:
                    with contextlib.suppress(ValueError):  # closed from another context
                        SEATED.reset(seated)
        finally:
            self.gate.release_read(token)

    async def _seat(self, label: str, model: str | None,
                    alone: bool = False) -> tuple[int, int | None]:
        """A seat at the gate for a request of ``model`` (``alone``: see ``serving``): -> (its
        token, the adapter slot it keeps; None without slots): the slot published for ``model``
        when the seat is taken, 0 for a name nothing was published for yet (its first version
        goes there). A base-model
        request's slot names no adapter and keeps nothing. (Updates run one at a time and an
        adapter update cannot land while a request waits, which only an update of the weights
        makes it do; the loop keeps the seat and the slot one even so.)"""
        while True:
            slot = self._published_slot(model)
            scope = model if slot is None else _slot_scope(model, slot)
            token = await self.gate.acquire_read(self.wait_timeout_s, label, scope, alone=alone)
            if slot == self._published_slot(model):
                return token, slot
            self.gate.release_read(token)

    def _published_slot(self, model: str | None) -> int | None:
        if not model or self.adapter_slots == 1:
            return None
        return self._adapter_slot.get(model, 0)

    # -- communicator ------------------------------------------------------------------------
    async def init_communicator(self, strategy: dict, sync_info: dict, rank_offset: int) -> int:
        """Build the workers' receivers; returns the new communicator id (older senders are
        refused from now on: their data plane is gone). The workers join in the background
        (model requests go on meanwhile); a later ``init_communicator`` or
        ``close_communicator`` abandons a join still waiting (this call then answers 409)."""
        await self.drop_communicator("the communicator was re-initialised by another sender")
        epoch = self._communicator_epoch
        where = await check_rendezvous(sync_info)
        async with self._guard("init_communicator"):
            if self._communicator_epoch != epoch:  # a close or a newer init came meanwhile
                raise ServiceError(http_status("UpdateRefusedError"),
                                   f"abandoned: {self._dropped_why}",
                                   error_type="UpdateRefusedError")
            await self.call_workers(
                "init_weight_transfer",
                {"strategy_cfg": strategy, "sync_info": sync_info, "rank_offset": rank_offset},
                what=f"init_weight_transfer ({where})", background=True,
            )
            return self._new_communicator_id()

    def _new_communicator_id(self) -> int:
        self._next_id += 1
        self.communicator_id = self._next_id
        return self.communicator_id

    async def drop_communicator(self, why: str) -> None:
        """Abandon the worker calls in progress (a join nobody completes, a chunk whose sender
        is gone), abort the running update (its data plane is about to go), forget the id. A
        join that has not reached the workers yet (it waits for the control call in progress)
        is abandoned too: it will not start there."""
        self._communicator_epoch += 1
        self._dropped_why = why
        await self.workers.abandon(why)
        if self._active is not None:
            await self._abort_active(why)
        self.communicator_id = 0

    async def close_communicator(self) -> None:
        await self.drop_communicator("the communicator was closed")
        async with self._guard("close_communicator"):
            await self.call_workers("close_weight_transfer", {}, background=True)

    def check_communicator(self, communicator_id: int | None) -> None:
        if communicator_id is not None and communicator_id != self.communicator_id:
            raise ServiceError(
                409,
                f"communicator_id: {communicator_id}, but the communicator was replaced (current "
                f"id {self.communicator_id or 'none'}): another sender initialised it or it was "
                f"closed; call /init_communicator again",
            )

    # -- one update: start, chunks, finish ------------------------------------------------------
    async def update_param_batch(
        self,
        metadata: dict,
        training_mode: TrainingMode | None,
        version: int | None,
        communicator_id: int | None = None,
    ) -> dict:
        """Our dialect: ``metadata`` is a start, a strategy's chunk request, a finish, or a whole
        update in one call (``type: apply``; see ``apply``)."""
        self.check_communicator(communicator_id)
        kind = metadata.get("type")
        if kind == "start":
            return await self.start(metadata, training_mode, version)
        if kind == "finish":
            return await self.finish(metadata, version)
        if kind == "apply":
            return await self.apply(metadata, training_mode, version)
        return await self.chunk(metadata, training_mode)

    async def apply(self, metadata: dict, mode: TrainingMode | None,
                    version: int | None) -> dict:
        """``{type: apply, start, requests, finish}``: the endpoint's ``apply_update`` over HTTP
        (``HttpChannel`` carries it): ``start`` (null: the update was started by its own call,
        as the streamed broadcast does), every request in order, then the finish: the same
        steps, gate, checks and logs as the calls one by one, one round trip instead of up to
        three. A refused start, or a failed request, still hands every request not yet run to
        the workers, which refuse it to their receivers (a collective sender waiting on its
        vote gets a no); a failed request has ended the update already (``chunk``)."""
        start, requests, finish = (metadata.get("start"), metadata.get("requests"),
                                   metadata.get("finish"))
        if start is not None and not isinstance(start, dict):
            raise ServiceError(400, "metadata.start: an object, or null when the update was "
                                    "started by its own call")
        if not isinstance(requests, list) or not all(isinstance(r, dict) for r in requests):
            raise ServiceError(400, "metadata.requests: a list of chunk requests (objects)")
        if not isinstance(finish, dict):
            raise ServiceError(400, "metadata.finish: the update's finish (an object)")
        done = 0
        try:
            if start is not None:
                await self.start(start, mode, version)
            for request in requests:
                done += 1
                await self.chunk(request, mode)
        except BaseException:
            for later in requests[done:]:  # each is refused by the workers: peers get a no
                with contextlib.suppress(Exception):
                    await self.call_workers("update_named_weights", {"request": later},
                                            what="a request refused after its update failed")
            raise
        return await self.finish(finish, version)

    async def start(
        self, metadata: dict, mode: TrainingMode | None, version: int | None
    ) -> dict:
        """Drain requests, let the workers validate the manifest (nothing moves if they refuse),
        pause the scheduler where asked; the gate stays closed until ``finish``."""
        from weightsync.types import WeightUpdateStart

        try:
            start = WeightUpdateStart.from_dict(metadata)
        except ValueError as e:
            raise ServiceError(400, f"metadata: {e}") from None
        if version is not None:
            if start.version is not None and start.version != version:
                raise ServiceError(400, f"version: {version} but metadata.version is {start.version}")
            start.version = version
        if mode is not None and start.training_mode is not None and start.training_mode is not mode:
            raise ServiceError(400, f"training_mode: {mode.value} but metadata.training_mode is "
                                    f"{start.training_mode.value!r}")
        mode = mode or start.training_mode or self.default_training_mode
        self.policy.prepare(start, mode, self.head_name_patterns)
        holds_gate = not self.serve_during_updates
        if not holds_gate:
            start.staged = True  # the weights stay the served version until the finish
        self.refuse_during_join(f"update {start.update_id}")
        await self.expire_stale_update()
        t0 = time.monotonic()
        adapter = _adapter_name(start)
        slot, scope = 0, None
        if adapter is not None:
            slot = self._next_slot(adapter)
            start.lora_adapter = {k: v for k, v in start.lora_adapter.items() if k != "slot"}
            if self.adapter_slots > 1:
                start.lora_adapter["slot"] = slot
                scope = _slot_scope(adapter, slot)
            else:
                scope = adapter
        if self._active is not None:
            if self._active.update_id == start.update_id:
                raise ServiceError(409, f"update {start.update_id} was already started")
            # the held gate passes on to an update of the same scope only (the weights, or the
            # same adapter slot): another waits for the requests its scope conflicts with
            held = self._active.holds_gate and self._active.scope == scope
            await self._abort_active(f"superseded by update {start.update_id}",
                                     keep_gate=held and holds_gate)
            if held and holds_gate:
                self.gate.transfer_write(start.update_id)
            elif holds_gate:
                await self._acquire_write(start.update_id, scope)
        elif holds_gate:
            await self._acquire_write(start.update_id, scope)
        drained = time.monotonic() - t0
        idle = self.update_timeout_s if start.idle_timeout_s is None else min(
            float(start.idle_timeout_s), self.update_timeout_s)
        active = _ActiveUpdate(start.update_id, mode, idle_timeout_s=idle, holds_gate=holds_gate,
                               adapter=adapter, slot=slot, scope=scope)
        try:
            async with self._guard(f"the start of update {start.update_id}"):
                await self.call_workers("start_weight_update", {"start": start.to_dict()})
            if self.pause_generation and holds_gate and adapter is None:
                await self._pause(active)
        except BaseException as e:
            await self._resume(active)
            if holds_gate:
                self.gate.release_write(start.update_id)
            log.warning("%s: update %s refused: %s", self.name, start.update_id, _why(e))
            raise
        self._active = active
        active.last_activity = time.monotonic()
        active.watchdog = asyncio.ensure_future(self._watch(active))
        log.info("%s: update %s started: version %s -> %s, %s, mode %s%s (requests drained "
                 "in %.2fs)", self.name, start.update_id, self.version,
                 self.version + 1 if start.version is None else start.version,
                 _manifest_text(start),
                 self.policy.mode_text(mode), ", staged" if start.staged else "", drained)
        return {"ok": True, "update_id": start.update_id, "version": self.version}

    def _next_slot(self, adapter: str) -> int:
        """The slot adapter ``adapter``'s next version goes into: the one after its published
        slot, in turn (0 for its first version, and always 0 with one slot)."""
        if self.adapter_slots == 1 or adapter not in self._adapter_slot:
            return 0
        return (self._adapter_slot[adapter] + 1) % self.adapter_slots

    async def _acquire_write(self, owner: str, adapter: str | None = None) -> None:
        """The gate's write side for update ``owner`` (of the gate scope ``adapter``: a LoRA
        adapter or one of its slots; None: the weights; ``_gate``'s scopes);
        ``ServiceError(503)`` when the requests it waits for do not drain in time."""
        try:
            await self.gate.acquire_write(owner, self.wait_timeout_s, adapter)
        except TimeoutError:
            why = (f"requests in flight did not drain in {self.wait_timeout_s:g}s "
                   f"({self.gate.in_flight(adapter=adapter)}); retry the update")
            log.warning("%s: update %s: %s", self.name, owner, why)
            raise ServiceError(503, why) from None

    async def _pause(self, active: _ActiveUpdate) -> None:
        from weightsync._runtime.vllm_compat import pause_generation

        await pause_generation(self.engine)
        active.paused = True

    def refuse_during_join(self, what: str) -> None:
        """409 while the workers join a communicator: an update waits for the join's answer."""
        join = self.workers.joining()
        if join is not None:
            raise ServiceError(409, f"{what}: the workers are still joining a communicator "
                                    f"({join.describe()}); send the update after "
                                    f"/init_communicator answered, or POST /init_communicator "
                                    f"again to abandon that join")

    async def _watch(self, active: _ActiveUpdate) -> None:
        """Abort ``active`` once no call came for its idle limit (its sender died or hangs)."""
        while self._active is active:
            quiet = time.monotonic() - active.last_activity
            if quiet >= active.idle_timeout_s and not self._control_in_flight:
                await self._abort_active(
                    f"no call from the sender for {active.idle_timeout_s:g}s after "
                    f"{active.chunks} chunk(s): it died or hangs")
                return
            await asyncio.sleep(max(active.idle_timeout_s - quiet, 0.05))

    def _require_active(self, update_id: str, what: str) -> _ActiveUpdate:
        active = self._active
        if active is None or active.update_id != update_id:
            current = f"update {active.update_id} is in progress" if active else "no update is in progress"
            raise ServiceError(409, f"{what} of update {update_id!r} without its start ({current})")
        active.last_activity = time.monotonic()
        return active

    async def chunk(self, metadata: dict, mode: TrainingMode | None) -> dict:
        """``mode`` (None: the start's) must be the mode the update started with."""
        update_id = str(metadata.get("update_id", ""))
        active = self._require_active(update_id, f"chunk {metadata.get('chunk_index')}")
        if (mode is not None and mode is not active.training_mode
                and self.policy.strict_training_mode):
            raise ServiceError(400, f"training_mode: {_mode_name(mode)} but update {update_id} "
                                    f"started as {_mode_name(active.training_mode)}")
        try:
            async with self._guard(f"chunk {metadata.get('chunk_index')} of update {update_id}"):
                await self.call_workers("update_named_weights", {"request": metadata})
        except BaseException as e:
            # the engine refuses every later chunk of this update: end it now, so requests are
            # served again (or told it is torn) without waiting for the sender's abort
            if self._active is active:
                why = e.message if isinstance(e, ServiceError) else f"{type(e).__name__}: {e}"
                await self._abort_active(f"chunk {metadata.get('chunk_index')} failed: {why}")
            raise
        active.chunks += 1
        active.nbytes += request_nbytes(metadata)
        active.last_activity = time.monotonic()
        return {"ok": True, "chunks": active.chunks}

    async def finish(self, metadata: dict, version: int | None) -> dict:
        """Publish the new version if every chunk landed (else: torn or unchanged), reset the
        prefix cache, resume generation, open the gate."""
        from weightsync.types import WeightUpdateFinish

        try:
            finish = WeightUpdateFinish.from_dict(metadata)
        except ValueError as e:
            raise ServiceError(400, f"metadata: {e}") from None
        if version is not None and finish.version is None:
            finish.version = version
        active = self._require_active(finish.update_id, "finish")
        if not active.holds_gate and finish.ok and self.in_flight == "continue":
            return await self._finish_continuing(active, finish)
        if not active.holds_gate:  # staged while serving: drain the requests, then flip
            try:
                await self._acquire_write(finish.update_id, active.scope)
            except ServiceError as e:
                await self._abort_active(f"finish: {e.message}")
                raise
            active.holds_gate = True
            if self.pause_generation and finish.ok and active.adapter is None:
                await self._pause(active)
        published, _ = await self._land(active, finish)
        if finish.ok:
            log.info("%s: update %s landed: version %d, %d chunk(s), %s in %.2fs", self.name,
                     finish.update_id, published, active.chunks, _mb(active.nbytes),
                     time.monotonic() - active.started)
        else:
            log.warning("%s: update %s aborted by its sender after %d chunk(s): %s; %s",
                        self.name, finish.update_id, active.chunks, finish.error or "no reason",
                        self._after_abort())
        return {"ok": finish.ok, "version": published, "state": self.torn_reason or "ready"}

    async def _finish_continuing(self, active: _ActiveUpdate, finish: Any) -> dict:
        """The flip without a drain (``in_flight="continue"``; see the module docstring)."""
        old = self.version
        t0 = time.monotonic()
        published, counts = await self._land(active, finish, freeze=True)
        took = time.monotonic() - t0
        held = active.split_ms.pop("held", None)
        self.flip_seq += 1
        self.flips.append(Flip(self.flip_seq, old, published, counts,
                               took if held is None else held / 1e3, dict(active.split_ms)))
        split = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in active.split_ms.items())
        if held is None:
            how = f"generation paused {took * 1e3:.1f} ms ({split} ms)"
        else:  # flipped by the engine core between two steps (_runtime.vllm_flip)
            how = (f"generation not paused: flipped between two steps in {held:.1f} ms, the "
                   f"step in flight running on (the flip's {split} ms)")
        log.info("%s: update %s landed under %d request(s) in flight, which continue on it: "
                 "version %d, %d chunk(s), %s in %.2fs; %s", self.name, finish.update_id,
                 len(counts), published, active.chunks, _mb(active.nbytes),
                 time.monotonic() - active.started, how)
        return {"ok": True, "version": published, "state": self.torn_reason or "ready"}

    async def _land(self, active: _ActiveUpdate, finish: Any, *, freeze: bool = False,
                    ) -> tuple[int, dict[str, int]]:
        """The workers' finish, then (if it published) the prefix-cache reset and the adapter's
        name; always ends the update (watchdog, generation resumed, the gate released if held).
        ``freeze``: first pause keeping the requests in flight and count their tokens
        (``in_flight="continue"``). -> (the served version, those counts)."""
        counts: dict[str, int] = {}
        split, t = active.split_ms, time.monotonic()

        def lap(phase: str) -> None:
            nonlocal t
            now = time.monotonic()
            split[phase] = (now - t) * 1e3
            t = now

        try:
            async with self._guard(f"the finish of update {finish.update_id}"):
                if freeze and self.keep_kv and await self._between_steps():
                    counts, results = await self._flip_between_steps(active, finish)
                    lap("call")
                else:
                    if freeze:
                        from weightsync._runtime.vllm_compat import freeze_in_flight

                        active.paused = True  # from here on, _resume resumes whatever happens
                        counts = await freeze_in_flight(self.engine, keep_kv=self.keep_kv)
                        lap("freeze")
                    results = await self.call_workers("finish_weight_update",
                                                      {"finish": finish.to_dict()})
                    lap("load")
            if finish.ok:
                # kept KV, or an adapter-only update under scoped requests: later requests are
                # salted by version instead (the reset would fail under requests in flight)
                if not self.keep_kv and not (active.adapter and self.scoped_by_model):
                    await self.reset_prefix_cache()
                lap("prefix_reset")
                if active.adapter:
                    self._adapter_slot[active.adapter] = active.slot
                    if self.adapter_published is not None:
                        self.adapter_published(active.adapter, active.slot)
        except BaseException as e:
            log.warning("%s: update %s did not land: %s", self.name, finish.update_id, _why(e))
            raise
        finally:
            self._active = None
            _stop_watch(active)
            t = time.monotonic()
            await self._resume(active)
            lap("resume")
            if active.holds_gate:
                self.gate.release_write(finish.update_id)
        published = int(results[0]) if results and results[0] is not None else self.version
        return published, counts

    async def _between_steps(self) -> bool:
        if self._flips_between_steps is None:
            from weightsync._runtime.vllm_flip import flip_supported

            self._flips_between_steps = await flip_supported(self.engine)
            if not self._flips_between_steps:
                log.info("%s: the engine core has no weightsync flip (weightsync's vLLM plugin "
                         "did not load there): kept-KV flips pause the scheduler", self.name)
        return self._flips_between_steps

    async def _flip_between_steps(self, active: _ActiveUpdate, finish: Any,
                                  ) -> tuple[dict[str, int], list[Any]]:
        """The kept-KV flip without a pause (``_runtime.vllm_flip``): vLLM's engine core counts
        each request's old-weight tokens and runs the workers' finish between two steps.
        Records the time it held the engine core (``split_ms["held"]``)."""
        from weightsync._runtime.vllm_flip import flip_between_steps

        args = ("finish_weight_update", {"finish": finish.to_dict()})
        answer = await flip_between_steps(self.engine, "weightsync_call", args,
                                          self.update_timeout_s)
        active.split_ms["held"] = answer["held_ms"]
        return answer["counts"], self._results(answer["answers"])

    @staticmethod
    def cache_salt_for(version: int, given: Any = None) -> str:
        """The prefix-cache salt (vLLM's ``cache_salt``) of a request that started on
        ``version`` under ``in_flight_kv="keep"`` or ``scoped_by_model``; a salt the client
        gave (``given``) is kept in front of it, so its own isolation holds too."""
        tag = f"weightsync-v{version}"
        return f"{given}|{tag}" if isinstance(given, str) and given else tag

    def spans_for(self, request_id: str, since: int, version: int) -> dict[str, list] | None:
        """For a request started at flip ``since`` on ``version`` (its ``X-Request-Id``), the
        versions of its output tokens: ``{vLLM request id: [[version, first token index],
        ...]}`` for each of its engine requests that a later flip found in flight; None if no
        flip happened under it."""
        out: dict[str, list] = {}
        for flip in self.flips:
            if flip.seq <= since:
                continue
            for key, count in flip.counts.items():
                rest = key.partition("-")[2]
                if rest == request_id or rest.startswith(request_id + "-"):
                    out.setdefault(key, [[version, 0]]).append([flip.new_version, count])
        return out or None

    def _after_abort(self) -> str:
        torn = self.torn_reason
        return (f"the weights are torn ({torn}): model requests answer 503 until a complete "
                f"update lands" if torn else f"serving version {self.version} unchanged")

    async def _resume(self, active: _ActiveUpdate) -> None:
        if active.paused:
            from weightsync._runtime.vllm_compat import resume_generation

            active.paused = False
            try:
                await resume_generation(self.engine)
            except Exception as e:  # noqa: BLE001 - the engine is gone; health says so
                log.error("%s: resuming generation after update %s failed: %s",
                          self.name, active.update_id, e)

    async def _abort_active(self, why: str, *, keep_gate: bool = False) -> None:
        from weightsync.types import WeightUpdateFinish

        active = self._active
        if active is None:
            return
        self._active = None  # one abort per update, whoever else asks meanwhile
        finish = WeightUpdateFinish(
            update_id=active.update_id, num_chunks=active.chunks, ok=False, error=why
        )
        try:
            async with self._guard(f"the abort of update {active.update_id}"):
                await self.call_workers("finish_weight_update", {"finish": finish.to_dict()})
        except ServiceError as e:  # the workers may not know it (never started there)
            log.warning("%s: abort of update %s: %s", self.name, active.update_id, e.message)
        finally:
            _stop_watch(active)
            await self._resume(active)
            if not keep_gate and active.holds_gate:
                self.gate.release_write(active.update_id)
        log.warning("%s: update %s aborted after %d chunk(s) (%s): %s; %s", self.name,
                    active.update_id, active.chunks, _mb(active.nbytes), why, self._after_abort())

    async def abort(self, update_id: str, why: str) -> None:
        """Abort ``update_id`` if it is still the running update (a transfer that failed)."""
        if self._active is not None and self._active.update_id == update_id:
            await self._abort_active(why)

    async def expire_stale_update(self) -> None:
        active = self._active
        if (active is not None and not self._control_in_flight
                and time.monotonic() - active.last_activity > active.idle_timeout_s):
            await self._abort_active(
                f"no call from the sender for {active.idle_timeout_s:g}s; it died or hangs"
            )

    # -- small things ---------------------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        """The engine's prefix-cache reset, answered within ``ENGINE_CALL_TIMEOUT_S`` (504
        naming the worker calls in progress otherwise)."""
        from weightsync._runtime.vllm_compat import async_reset_prefix_cache

        try:
            return await asyncio.wait_for(async_reset_prefix_cache(self.engine),
                                          ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            raise ServiceError(504, f"the engine did not reset its prefix cache within "
                                    f"{ENGINE_CALL_TIMEOUT_S:g}s (worker calls in progress: "
                                    f"{self.workers.describe()})") from None

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task:
        """Run ``coro`` in the background; it counts in ``/get_num_background_tasks`` until it
        ends; its failure is logged (the caller's coroutine reports it where it matters)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def _done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s: %s failed: %s", self.name, what, t.exception())

        task.add_done_callback(_done)
        return task

    def num_background_tasks(self) -> int:
        """Control calls running + background tasks + the open update (0: all settled)."""
        return (self._control_in_flight + len(self._background)
                + (1 if self._active is not None else 0))

    @property
    def active_update(self) -> str | None:
        return self._active.update_id if self._active is not None else None

    def runtime_version(self) -> dict:
        active = self._active
        torn = self.torn_reason
        out = {
            "version": self.version,
            "state": "torn" if torn else ("updating" if active else "ready"),
            "update_in_progress": active.update_id if active else None,
        }
        if torn:
            out["reason"] = torn  # why the weights are incomplete (what failed, where)
        return out

    async def shutdown(self) -> None:
        """Best effort on the way out: stop background transfers, close the receivers."""
        for t in list(self._background):
            t.cancel()
        try:
            await self.workers.abandon("the server is shutting down")
            await asyncio.wait_for(self.workers.call("close_weight_transfer", {}), 10)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    def _guard(self, what: str) -> _ControlGuard:
        return _ControlGuard(self, what)


def _slot_scope(adapter: str, slot: int) -> str:
    """The gate's scope of one version slot of an adapter (``_gate``: scopes are compared as
    equal or not)."""
    return f"{adapter}\x00{slot}"


def _adapter_name(start: Any) -> str | None:
    """The adapter a LoRA adapter-only update is for (None: an update of the weights)."""
    if start.lora_adapter is None:
        return None
    from weightsync.lora_adapter import DEFAULT_ADAPTER_NAME

    return str(start.lora_adapter.get("name") or DEFAULT_ADAPTER_NAME)


def _stop_watch(active: _ActiveUpdate) -> None:
    task, active.watchdog = active.watchdog, None
    if task is not None and task is not asyncio.current_task() and not task.done():
        task.cancel()


def _mode_name(mode: TrainingMode | None) -> str:
    return mode.value if mode is not None else "none"


class _ControlGuard:
    """Serialises control calls and counts them (``/get_num_background_tasks``); a call waits
    at most the control's ``wait_timeout_s`` for the one in progress (503 naming it)."""

    def __init__(self, control: UpdateControl, what: str) -> None:
        self.c = control
        self.what = what

    async def __aenter__(self) -> None:
        self.c._control_in_flight += 1
        try:
            await asyncio.wait_for(self.c._control.acquire(), self.c.wait_timeout_s)
        except BaseException as e:
            self.c._control_in_flight -= 1
            if isinstance(e, TimeoutError):
                raise ServiceError(503, f"{self.what}: waited {self.c.wait_timeout_s:g}s for the "
                                        f"control call in progress to end (in the workers: "
                                        f"{self.c.workers.describe()}); retry") from None
            raise

    async def __aexit__(self, *exc: Any) -> None:
        self.c._control.release()
        self.c._control_in_flight -= 1


def _why(e: BaseException) -> str:
    """``e`` on one log line (a refusal lists its offenders on lines of their own)."""
    text = e.message if isinstance(e, ServiceError) else f"{type(e).__name__}: {e}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _mb(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MB"


def _manifest_text(start: Any) -> str:
    if start.manifest is None:
        return "no manifest"
    return f"{len(start.manifest)} tensors, {_mb(sum(m.nbytes for m in start.manifest))}"


async def check_rendezvous(sync_info: dict) -> str:
    """What the workers' join will wait for (for messages). For a ``torch_distributed`` sync
    info (the ``broadcast`` strategy: the sender hosts the store before it calls
    ``/init_communicator``) first check that something accepts connections there: 400 naming
    the address otherwise, so no worker waits ``join_timeout_s`` for a store that is not there.
    A connection attempt that merely times out (``RENDEZVOUS_CHECK_S``; a slow network) lets the
    join go ahead. Other sync infos are the workers' to check."""
    from weightsync.strategies.broadcast import TorchDistributedWeightSyncInfo

    kind = sync_info.get("type")
    if kind != TorchDistributedWeightSyncInfo.TYPE:
        return f"building the receivers ({kind} sync info)"
    try:
        info = TorchDistributedWeightSyncInfo.from_dict(sync_info)
    except (ValueError, TypeError, KeyError) as e:
        raise ServiceError(400, f"sync_info: {e}") from None
    where = f"joining the sender's group at {info.master_addr}:{info.master_port}"
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(info.master_addr, int(info.master_port)),
            min(RENDEZVOUS_CHECK_S, info.join_timeout_s))
    except TimeoutError:
        return where
    except (OSError, ValueError, UnicodeError) as e:
        raise ServiceError(400, f"sync_info: nothing accepts connections at "
                                f"{info.master_addr}:{info.master_port} ({type(e).__name__}: "
                                f"{e}); the sender hosts its rendezvous store there before it "
                                f"calls /init_communicator: check master_addr / master_port "
                                f"(reachable from this server)") from None
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return where


#: how long ``check_rendezvous`` tries to connect before it lets the join go ahead
RENDEZVOUS_CHECK_S = 3.0
