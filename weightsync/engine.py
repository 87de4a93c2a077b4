"""Engine-side endpoint: the update lifecycle that every receiving engine runs.

``WeightUpdateEndpoint`` lives in the engine process (or a vLLM worker). Whatever carries the
control plane (a Ray actor, a local serving loop, an HTTP server's routes, a vLLM worker
extension, an in-process channel) forwards the client's plain-dict calls to it, usually through
``call(method, kwargs)``:

    init_weight_transfer(strategy_cfg, sync_info, rank_offset)  build the receiver
    start_weight_update(start)     validate the whole manifest (names, shapes, dtypes, the
                                   training mode's name policy) before any byte moves
    update_named_weights(request)  validate one chunk, receive its bytes, load them
    finish_weight_update(finish)   run the finish hook, publish the version if every chunk landed
    apply_update(start, requests, finish)   the three above in one call (one round trip;
                                            start None: started by its own call)
    close_weight_transfer()        drop the receiver (the endpoint can be initialised again)
    status()                       state, version, last error, the update in progress

The endpoint runs every loader hook itself (``validate``, ``start_update``, the receiver's load,
``finish_update``) and owns one explicit state (``EndpointState``)::

    IDLE --start--> RECEIVING --finish--> FINISHING --commit + hook ok--> IDLE (version published)
                        |                     '--commit or hook raised--> TORN
                        |--failed / abort / abandon after bytes were loaded--> TORN
                        '--failed / abort / abandon before any (staged: always)--> IDLE
    TORN --start--> TORN (repairing) --finish--> FINISHING --> IDLE
    any --close()--> CLOSED (every later call is refused)

What the receiver loads into is an ``UpdateSink`` (``weightsync.update_sink``) around the
loader, one per update: it checks the chunk's checksums when the sender sent them
(``ChecksumMismatchError``), refuses a name the update already carried, and loads in place or,
for a staged update (the start's ``staged``, or ``stage_updates=True``), keeps a copy until the
finish, where it is replayed into the loader. So "torn" means: the loader was given bytes of an
update that then failed. A staged update that fails never gets there (the weights are the last
version exactly), an in-place one that fails before its first load does not either.

A call cancelled at one of its ``await``s (a server abandoning it: ``weightsync_cancel`` in
``weightsync.loaders.vllm_worker``) ends like a call that failed there: an init leaves no
receiver, a chunk fails its update (torn if bytes had landed), the lock is released.

A start that carries a ``delta`` (``weightsync.delta``) is validated as the tensors it
updates and refused (``DeltaBaseMismatchError``, nothing changes) unless the engine serves the
delta's base version and keeps what applying it needs (``weightsync.delta.store.DeltaStore``,
one per endpoint: valid after every complete update with a ``delta``, dropped by any other
update and by torn weights); its chunks are received into a ``DeltaLoader`` in the sink.

Serving: ``check_serving()`` passes in IDLE and RECEIVING (between chunks of a live update the
weights may be partly new: a server that serves concurrently holds requests during an update,
as the reward server's gate does) and raises in FINISHING and TORN (``UpdateIncompleteError``)
and CLOSED: the engine never serves a silent mix of old and new weights; it serves again once a
complete update lands. Versions are published only by a complete update and increase (0 or
none asks for the next one), unless the start allows a reset (``allow_version_reset``: the
version is taken as given, the reference's rule for a trainer that restarted its count).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import operator
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from weightsync._runtime import trace
from weightsync.delta.store import DeltaLoader, DeltaStore
from weightsync.errors import (
    ManifestUnknownError,
    UpdateIncompleteError,
    UpdateRefusedError,
    WeightMismatchError,
    WeightSyncError,
)
from weightsync.interfaces import WeightLoader, WeightTransferReceiver
from weightsync.types import TensorMeta, WeightUpdateFinish, WeightUpdateStart
from weightsync.update_sink import UpdateSink

log = logging.getLogger(__name__)

#: manifests an endpoint keeps for starts that refer to them (``manifest_of``): one per
#: trainer or adapter pushing into it, a few of each
KEPT_MANIFESTS = 8


class EndpointState(enum.StrEnum):
    """Where an endpoint is in the update lifecycle (see the module docstring)."""

    IDLE = "idle"
    RECEIVING = "receiving"
    FINISHING = "finishing"
    TORN = "torn"
    CLOSED = "closed"


@dataclass(frozen=True)
class UpdateProgress:
    """The update in progress: its id and version, chunks loaded, why it failed (if a chunk
    failed: later chunks are refused), whether it is staged and how many bytes wait in staging."""

    update_id: str
    version: int | None
    chunks_done: int = 0
    failed: str = ""
    staged: bool = False
    staged_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"update_id": self.update_id, "version": self.version,
                "chunks_done": self.chunks_done, "failed": self.failed,
                "staged": self.staged, "staged_bytes": self.staged_bytes}


@dataclass(frozen=True)
class EndpointStatus:
    """A snapshot of one endpoint: ``state``, the served ``version``, ``last_error`` (why the
    weights are torn, or why the last update failed; empty after a complete update) and the
    ``update`` in progress."""

    name: str
    state: EndpointState
    version: int
    last_error: str
    update: UpdateProgress | None
    has_receiver: bool
    sync_info: dict[str, Any] | None = None  # what the receiver was built from
    #: what the engine keeps for delta updates (``weightsync.delta.store``): ``{"version",
    #: "shadow_bytes"}``, or None when it keeps nothing
    delta: dict[str, Any] | None = None
    #: where the last complete update's time went in this endpoint, in ms: ``start`` (its
    #: validation and the loader's start), ``chunks`` (receiving and loading every chunk),
    #: ``commit`` (a staged update landing), ``finish`` (the loader's finish: an adapter is
    #: built and installed here); None before the first
    last_update_ms: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "version": self.version,
                "last_error": self.last_error,
                "update": self.update.to_dict() if self.update else None,
                "has_receiver": self.has_receiver, "sync_info": self.sync_info,
                "delta": self.delta, "last_update_ms": self.last_update_ms}


@dataclass
class _Update:
    """Book-keeping of the update in progress (private to the endpoint)."""

    start: WeightUpdateStart
    sink: UpdateSink  # what the receiver loads into (checksums; in place or staged)
    delta: DeltaLoader | None = None  # a delta update: the sink loads into it
    # the loader of this update: the engine's, or an adapter's (a LoRA adapter-only update)
    loader: WeightLoader | None = None
    chunks_done: int = 0
    failed: str = ""  # why a chunk of this update failed; later chunks are refused
    ms: dict[str, float] = field(default_factory=dict)  # EndpointStatus.last_update_ms

    @property
    def touched(self) -> bool:
        """The engine's weights were (possibly partly) written by this update (never, for a
        loader that changes what is served only in its finish, all or nothing)."""
        if self.loader is not None and self.loader.changes_at_finish_only:
            return False
        return self.sink.touched

    def progress(self) -> UpdateProgress:
        return UpdateProgress(self.start.update_id, self.start.version, self.chunks_done,
                              self.failed, self.sink.staged, self.sink.staged_bytes)


class WeightUpdateEndpoint:
    """Receiver + loader + version bookkeeping for one engine (worker).

    ``loader``: the engine's ``WeightLoader``; ``version``: the version the engine serves at
    start; ``name``: how the engine is named in errors. ``stage_updates``: None (default) stages
    an update when its start asks for it (``staged``), True stages every update, False never
    (a start that asks is refused: the engine has no memory for a second copy). Calls are
    serialised (one at a time, in the order they arrive on the endpoint's event loop).
    """

    def __init__(self, loader: WeightLoader, *, version: int = 0, name: str = "engine",
                 stage_updates: bool | None = None) -> None:
        self.loader = loader
        self.name = name
        self.stage_updates = stage_updates
        self._receiver: WeightTransferReceiver | None = None
        self._sync_info: dict[str, Any] | None = None
        self._version = int(version)
        self._state = EndpointState.IDLE
        self._last_error = ""
        self._update: _Update | None = None
        self._lock = asyncio.Lock()
        # the last manifest parsed (raw, parsed) and the last one accepted (parsed, mode, heads)
        self._last_manifest: tuple[list, list[TensorMeta]] | None = None
        # the parsed manifests of the last updates that carried one, by update id (what a
        # start's ``manifest_of`` refers to), most recent last
        self._manifests: collections.OrderedDict[str, list[TensorMeta]] = (
            collections.OrderedDict())
        self._accepted: tuple[list[TensorMeta], Any, Any] | None = None
        self._accepted_adapter: tuple[list[TensorMeta], Any] | None = None  # (manifest, spec)
        # the last request found to carry its update's whole manifest: (names, dtypes, shapes,
        # manifest), the very objects (a receiver that caches a layout hands the same ones)
        self._manifest_request: tuple[Any, Any, Any, Any] | None = None
        self._deltas = DeltaStore(name)  # what delta updates need (weightsync.delta.store)
        self._last_update_ms: dict[str, float] | None = None

    # -- read-only views ------------------------------------------------------------------------
    @property
    def state(self) -> EndpointState:
        return self._state

    @property
    def version(self) -> int:
        """The version of the last complete update (what the engine serves)."""
        return self._version

    @property
    def last_error(self) -> str:
        return self._last_error

    @property
    def receiver(self) -> WeightTransferReceiver | None:
        return self._receiver

    def status(self) -> EndpointStatus:
        return EndpointStatus(
            name=self.name, state=self._state, version=self._version,
            last_error=self._last_error,
            update=self._update.progress() if self._update is not None else None,
            has_receiver=self._receiver is not None,
            sync_info=self._sync_info if self._receiver is not None else None,
            delta=None if self._deltas.version is None else {
                "version": self._deltas.version, "shadow_bytes": self._deltas.nbytes},
            last_update_ms=self._last_update_ms,
        )

    def check_serving(self) -> None:
        """Raise unless the weights are one complete version (callers: the engine's request
        path). ``UpdateIncompleteError`` while torn or finishing an update."""
        if self._state is EndpointState.TORN:
            raise UpdateIncompleteError(
                f"{self.name}: weights are incomplete after a failed update "
                f"({self._last_error}); refusing to serve until a complete update lands (last "
                f"complete version {self._version})"
            )
        if self._state is EndpointState.FINISHING:
            assert self._update is not None
            raise UpdateIncompleteError(
                f"{self.name}: update {self._update.start.update_id} is being finished; retry "
                f"in a moment (serving version {self._version} resumes or the new one starts)"
            )
        if self._state is EndpointState.CLOSED:
            raise WeightSyncError(f"{self.name}: the endpoint is closed")

    # -- set-up -----------------------------------------------------------------------------
    async def init_weight_transfer(
        self, strategy_cfg: dict, sync_info: dict, rank_offset: int
    ) -> None:
        from weightsync.config import build_strategy
        from weightsync.types import WeightSyncInfo

        async with self._lock:
            self._refuse_if_closed("init_weight_transfer")
            self._drop_receiver()
            strategy = build_strategy(strategy_cfg)
            info = WeightSyncInfo.from_dict(sync_info)
            self._receiver = await strategy.create_receiver(None, info, rank_offset)
            self._sync_info = info.to_dict()

    async def close_weight_transfer(self) -> None:
        """Drop the receiver; the endpoint may be initialised again (a new sender)."""
        async with self._lock:
            self._drop_receiver()

    async def close(self) -> None:
        """Close for good (the engine shuts down): drop the receiver; an update in progress is
        abandoned (the state does not matter any more); every later call is refused."""
        async with self._lock:
            self._drop_receiver()
            if self._update is not None:
                self._update.sink.discard()
                if self._update.touched:
                    self._last_error = (
                        f"closed during update {self._update.start.update_id} after "
                        f"{self._update.chunks_done} chunk(s) loaded"
                    )
            self._update = None
            self._deltas.drop()
            self._state = EndpointState.CLOSED

    # -- one update ---------------------------------------------------------------------------
    async def start_weight_update(self, start: dict) -> None:
        """Validate the whole update before any byte moves; raise (nothing changes) if the
        manifest or the version is refused."""
        with trace.span("endpoint.start"):
            await self._start_update(start)

    async def _start_update(self, start: dict) -> None:
        msg = self._parse_start(start)
        trace.mark("endpoint.start.parsed")
        async with self._lock:
            t0 = time.perf_counter()
            self._refuse_if_closed("start_weight_update")
            self._abandon_current(f"superseded by update {msg.update_id}")
            staged = msg.staged if self.stage_updates is None else self.stage_updates
            if msg.staged and self.stage_updates is False:
                raise UpdateRefusedError(
                    f"{self.name}: update {msg.update_id} asks to be staged, but this engine "
                    f"does not stage updates (no memory for a second copy); send it with "
                    f"staged: false"
                )
            delta = None
            loader = self._loader_for(msg)
            if msg.delta is not None:  # validated as its targets; refused if it cannot apply
                delta = self._deltas.begin(msg, self.loader, served=self._version,
                                           idle=self._state is EndpointState.IDLE)
                self._validate(delta.targets, msg, whole_update=True)
                delta.check_base()
            elif loader is not self.loader:  # an adapter: its own names and checks
                if msg.manifest is not None and not self._adapter_accepted_before(msg):
                    self._validate(msg.manifest, msg, whole_update=True, loader=loader)
                    self._accepted_adapter = (msg.manifest, msg.lora_adapter)
                # installed whole at finish (the engine serves the last version until then);
                # the adapter loader keeps its own copies of what arrives, so the sink does not
                # stage them too (one copy per tensor, not two)
                staged = False
            elif msg.manifest is not None and not self._accepted_before(msg):
                self._validate(msg.manifest, msg, whole_update=True)
                self._accepted = (msg.manifest, msg.training_mode, msg.head_name_patterns)
            if msg.version and msg.version <= self._version and not msg.allow_version_reset:
                raise UpdateRefusedError(
                    f"{self.name}: update version {msg.version} is not newer than the served "
                    f"version {self._version}; versions must increase (send no version, or 0, "
                    f"to publish the next one; a server started without --monotonic-versions "
                    f"takes it as given)"
                )
            trace.mark("endpoint.start.checked")
            # may refuse too (nothing loaded yet); a delta's loader sees its targets
            await loader.start_update(delta.loader_start(msg) if delta else msg)
            trace.mark("endpoint.start.loaded")
            self._update = _Update(
                msg, UpdateSink(delta or loader, staged=staged, name=self.name), delta, loader,
                ms={"start": (time.perf_counter() - t0) * 1e3, "chunks": 0.0})
            if self._state is EndpointState.IDLE:
                self._state = EndpointState.RECEIVING

    async def update_named_weights(self, request: dict) -> None:
        """Receive and load one chunk; chunks must come in ``chunk_index`` order (put a
        ``ChunkTurnstile`` in front on a transport that may reorder calls). A chunk that is not
        loaded is still ``refuse``d to the receiver, so a collective strategy's peers are
        released."""
        with trace.span("endpoint.update"):
            await self._update_chunk(request)

    async def _update_chunk(self, request: dict) -> None:
        async with self._lock:
            self._refuse_if_closed("update_named_weights")
            receiver = self._receiver
            if receiver is None:
                raise WeightSyncError(
                    f"{self.name}: no receiver; call init_weight_transfer before updating weights"
                )
            req = receiver.parse_request(request)
            trace.mark("endpoint.update.parsed")
            update = self._update
            problem = ""
            if update is None or req.update_id != update.start.update_id:
                problem = (
                    f"chunk {req.chunk_index} of update {req.update_id!r} arrived without a "
                    f"matching start_weight_update"
                )
            elif update.failed:
                problem = (
                    f"chunk {req.chunk_index} refused: an earlier chunk of this update failed "
                    f"({update.failed})"
                )
            elif req.chunk_index != update.chunks_done:
                problem = f"expected chunk {update.chunks_done}, got {req.chunk_index}"
            if problem:
                await self._refuse(receiver, req)
                raise UpdateRefusedError(f"{self.name}: {problem}")
            assert update is not None
            t0 = time.perf_counter()
            req.validated = self._carries_manifest(req, update.start.manifest)
            try:
                try:
                    if not req.validated:
                        self._check_chunk(update.delta.targets_of(req.metas()) if update.delta
                                          else req.metas(), update.start)
                    update.sink.begin_chunk(req)  # a name this update already carried: no
                except WeightMismatchError:
                    await self._refuse(receiver, req)  # its peers still get a no
                    raise
                trace.mark("endpoint.update.checked")
                # the receiver validates the chunk against the loader before any byte moves,
                # then hands the bytes to the sink (checksums; the loader or staging)
                await receiver.receive_and_load_weights(req, update.sink)
            except BaseException as e:
                update.failed = f"chunk {req.chunk_index}: {type(e).__name__}: {e}"[:500]
                if update.touched:  # the weights hold part of this update now
                    self._mark_torn(f"chunk {req.chunk_index} of update {req.update_id} "
                                    f"failed after bytes of the update were loaded: "
                                    f"{type(e).__name__}: {e}")
                raise
            update.sink.end_chunk()
            update.chunks_done += 1
            update.ms["chunks"] += (time.perf_counter() - t0) * 1e3

    async def finish_weight_update(self, finish: dict) -> int:
        """Close an update: publish its version if every chunk landed and the finish hook ran;
        returns the served version. A sender's abort (``ok=False``) returns the old version
        without raising; an incomplete update or a failing finish hook raises. Either leaves
        the weights torn if a chunk had landed."""
        try:
            with trace.span("endpoint.finish"):
                return await self._finish_update(finish)
        finally:
            trace.flush()  # every update this engine finished is on disk

    async def _finish_update(self, finish: dict) -> int:
        msg = WeightUpdateFinish.from_dict(finish)
        async with self._lock:
            self._refuse_if_closed("finish_weight_update")
            update = self._update
            if update is None or update.start.update_id != msg.update_id:
                raise UpdateRefusedError(
                    f"{self.name}: finish for unknown update {msg.update_id!r}"
                )
            complete = msg.ok and not update.failed and update.chunks_done == msg.num_chunks
            if not complete:
                self._update = None
                update.sink.discard()
                reason = msg.error or update.failed or (
                    f"{update.chunks_done} of {msg.num_chunks} chunks landed"
                )
                if update.touched:
                    self._mark_torn(f"update {msg.update_id} aborted: {reason}")
                elif self._state is EndpointState.RECEIVING:
                    self._state = EndpointState.IDLE
                if msg.ok:
                    raise WeightSyncError(f"{self.name}: incomplete update: {reason}")
                return self._version
            was_torn = self._state is EndpointState.TORN
            self._state = EndpointState.FINISHING
            try:
                t0 = time.perf_counter()
                await update.sink.commit()  # a staged update lands now (in place: nothing left)
                t1 = time.perf_counter()
                if update.delta is not None:
                    await update.delta.complete()
                await (update.loader or self.loader).finish_update(msg)
                update.ms.update(commit=(t1 - t0) * 1e3, finish=(time.perf_counter() - t1) * 1e3)
            except BaseException as e:
                self._update = None
                update.sink.discard()
                if update.touched or was_torn:
                    self._mark_torn(
                        f"finishing update {msg.update_id} failed: {type(e).__name__}: {e}"
                    )
                else:  # nothing was loaded: the weights are still the last complete version
                    self._state = EndpointState.IDLE
                raise
            self._update = None
            # None or 0: the next version (the reference's "bump")
            version = int(msg.version or update.start.version or self._version + 1)
            self._version = version if update.start.allow_version_reset else max(
                version, self._version)
            if update.delta is not None:
                self._deltas.published(self._version)
            else:
                self._deltas.drop()  # what it kept is not what the engine serves any more
            self._state = EndpointState.IDLE
            self._last_error = ""
            self._last_update_ms = update.ms
            return self._version

    async def apply_update(self, start: dict | None, requests: list[dict], finish: dict) -> int:
        """A whole update in one call: ``start_weight_update(start)``, ``update_named_weights``
        for each request in order, ``finish_weight_update(finish)``; returns the served version.
        Same rules as the three calls made one by one (validation before any byte, torn weights
        after a failure once a chunk landed, versions published only by a complete update):

        * a refused start raises and changes nothing; every request is still ``refuse``d to the
          receiver, so a collective strategy's peers (the sender voting on each chunk) are
          released;
        * a failed chunk raises its error after the remaining chunks were refused and the update
          was closed as a sender would close it (``finish`` with ``ok=False``).

        ``start`` None: the update was started by its own ``start_weight_update`` call already
        (the streamed broadcast starts every engine before any rank enters a collective, then
        sends its one request and the finish as this one call).

        For senders that can make every request before the first is loaded (one chunk, or
        requests that hold no buffer a later chunk needs); channels that carry it set
        ``one_call = True``."""
        if start is not None:
            try:
                await self.start_weight_update(start)
            except BaseException:
                await self._refuse_all(requests)
                raise
        if self._update is not None:  # this call carries the finish too: views lent to the
            self._update.sink.one_call = True  # chunks stay valid until it (load_borrowed)
        for i, request in enumerate(requests):
            try:
                await self.update_named_weights(request)
            except BaseException as e:
                for later in requests[i + 1:]:  # each votes no (an earlier chunk failed)
                    with contextlib.suppress(Exception):
                        await self.update_named_weights(later)
                abort = {**finish, "ok": False,
                         "error": f"chunk {i}: {type(e).__name__}: {e}"[:2000]}
                with contextlib.suppress(Exception):
                    await self.finish_weight_update(abort)
                raise
        return await self.finish_weight_update(finish)

    async def _refuse_all(self, requests: list[dict]) -> None:
        receiver = self._receiver
        if receiver is None:
            return
        for request in requests:
            try:
                req = receiver.parse_request(request)
            except Exception:  # not this strategy's request: nobody waits on it
                continue
            await self._refuse(receiver, req)

    # -- dispatch for transports that carry (method, kwargs) ---------------------------------
    async def call(self, method: str, kwargs: dict | None = None) -> Any:
        """One endpoint method by name (``METHODS``) with plain-data kwargs; ``status``
        answers a plain dict."""
        if method not in METHODS:
            raise WeightSyncError(
                f"{self.name}: unknown endpoint method {method!r}; known: {sorted(METHODS)}"
            )
        if method == "status":
            return self.status().to_dict()
        return await getattr(self, method)(**(kwargs or {}))

    # -- internals ---------------------------------------------------------------------------
    def _parse_start(self, start: dict) -> WeightUpdateStart:
        """The start message; a manifest equal to the last one parsed (a trainer sends the same
        one every step) is not parsed again, and a start that refers to it (``manifest_of``
        the id of the update that carried it) gets it; one that refers to any other is
        refused (``ManifestUnknownError``), before anything changes."""
        raw = start.get("manifest") if isinstance(start, dict) else None
        last = self._last_manifest
        if raw is not None and last is not None and raw == last[0] and not start.get(
                "manifest_of"):
            msg = WeightUpdateStart.from_dict({**start, "manifest": None})
            msg.manifest = last[1]
        else:
            msg = WeightUpdateStart.from_dict(start)
        if msg.manifest_of:
            held = self._manifests.get(msg.manifest_of)
            if held is None:
                raise ManifestUnknownError(
                    f"{self.name}: update {msg.update_id} refers to the manifest of update "
                    f"{msg.manifest_of}, which this engine does not hold (restarted, or it "
                    f"took {KEPT_MANIFESTS} other manifests since); send the manifest in full")
            self._manifests.move_to_end(msg.manifest_of)
            msg.manifest = held
        elif raw is not None and msg.manifest is not None:
            if last is None or last[1] is not msg.manifest:
                self._last_manifest = (raw, msg.manifest)
            self._manifests[msg.update_id] = msg.manifest  # what later starts may refer to
            while len(self._manifests) > KEPT_MANIFESTS:
                self._manifests.popitem(last=False)
        return msg

    def _carries_manifest(self, req: Any, manifest: list[TensorMeta] | None) -> bool:
        """The request carries exactly the update's manifest (checked at start: the chunk is
        not checked again). The very lists found to match last time match again without a
        compare (a cached layout's request and a reused parsed manifest are the same objects
        from one update to the next)."""
        last = self._manifest_request
        if last is not None and manifest is not None and all(
                map(operator.is_, last, (req.names, req.dtypes, req.shapes, manifest))):
            return True
        found = _is_manifest(req, manifest)
        self._manifest_request = (req.names, req.dtypes, req.shapes, manifest) if found else None
        return found

    def _accepted_before(self, msg: WeightUpdateStart) -> bool:
        """This very manifest (the same list object: ``_parse_start`` reuses it) was accepted
        with the same training mode and head patterns: the loader's answer would be the same
        (what the model accepts does not change while the engine runs)."""
        last = self._accepted
        return last is not None and last[0] is msg.manifest and last[1:] == (
            msg.training_mode, msg.head_name_patterns)

    def _adapter_accepted_before(self, msg: WeightUpdateStart) -> bool:
        """This very manifest (the same list object) was accepted for an adapter of the same
        name and config: the adapter loader's answer would be the same (it depends on those
        and the served model only, not on the version slot the server picked)."""
        last = self._accepted_adapter
        return last is not None and last[0] is msg.manifest and _without_slot(
            last[1]) == _without_slot(msg.lora_adapter)

    def _loader_for(self, msg: WeightUpdateStart) -> WeightLoader:
        """The engine's loader, or for a LoRA adapter-only update (``lora_adapter`` in the
        start) the adapter loader the engine's loader gives (refused: nothing changes)."""
        if msg.lora_adapter is None:
            return self.loader
        from weightsync.lora_adapter import LoRAAdapterSpec

        if msg.delta is not None:
            raise UpdateRefusedError(f"{self.name}: update {msg.update_id} is a delta and a LoRA "
                                     f"adapter update; send an adapter whole (it is small)")
        try:
            spec = LoRAAdapterSpec.from_dict(msg.lora_adapter)
        except ValueError as e:
            raise UpdateRefusedError(f"{self.name}: update {msg.update_id}: {e}") from None
        return self.loader.adapter_loader(spec)

    def _validate(
        self, metas: list[TensorMeta], start: WeightUpdateStart, *, whole_update: bool,
        loader: WeightLoader | None = None,
    ) -> None:
        """The loader's check and the training mode's name policy, as one error that lists
        every offender of both (an adapter update has no training-mode policy: it carries
        adapter tensors by definition)."""
        from weightsync.validation import size_offenders

        loader = loader or self.loader
        offenders: list[str] = []
        target = "target model"
        try:
            loader.validate(metas)
        except WeightMismatchError as e:
            offenders += e.offenders
            target = e.target
        if not offenders:
            offenders += size_offenders(metas, loader.expected_metadata(), whole_update=True)
        if start.training_mode is not None and start.lora_adapter is None:
            from weightsync.validation import training_mode_offenders

            offenders += training_mode_offenders(
                [m.name for m in metas], start.training_mode, start.head_name_patterns,
                whole_update=whole_update,
            )
        if offenders:
            raise WeightMismatchError(offenders, target=target)

    def _check_chunk(self, metas: list[TensorMeta], start: WeightUpdateStart) -> None:
        """One chunk against the update's training mode and the model's size limits (the whole
        manifest was checked at start, when there was one; the loader checks names and shapes
        in the receiver)."""
        from weightsync.validation import size_offenders, training_mode_offenders

        update = self._update
        loader = update.loader if update is not None and update.loader else self.loader
        offenders = size_offenders(metas, loader.expected_metadata())
        if start.training_mode is not None and start.lora_adapter is None:
            offenders += training_mode_offenders(
                [m.name for m in metas], start.training_mode, start.head_name_patterns
            )
        if offenders:
            target = (f"{start.training_mode.value} update" if start.training_mode is not None
                      else "target model")
            raise WeightMismatchError(offenders, target=target)

    def _abandon_current(self, why: str) -> None:
        update = self._update
        if update is None:
            return
        self._update = None
        update.sink.discard()
        if update.touched:
            self._mark_torn(
                f"update {update.start.update_id} was abandoned after {update.chunks_done} "
                f"chunk(s) loaded ({why})"
            )
        elif self._state is EndpointState.RECEIVING:
            self._state = EndpointState.IDLE

    async def _refuse(self, receiver: WeightTransferReceiver, req: Any) -> None:
        try:
            await receiver.refuse(req)
        except Exception as e:  # the data plane is gone too; the refusal is the news
            log.warning("%s: refusing chunk %s failed: %s", self.name, req.chunk_index, e)

    def _drop_receiver(self) -> None:
        if self._receiver is not None:
            receiver, self._receiver = self._receiver, None
            receiver.close()

    def _refuse_if_closed(self, method: str) -> None:
        if self._state is EndpointState.CLOSED:
            raise UpdateRefusedError(f"{self.name}: the endpoint is closed; cannot {method}")

    def _mark_torn(self, why: str) -> None:
        self._deltas.drop()
        self._state = EndpointState.TORN
        self._last_error = why
        log.error("%s: %s", self.name, why)


def _is_manifest(request: Any, manifest: list[TensorMeta] | None) -> bool:
    """The request carries exactly the update's manifest (a streamed update's one request)."""
    if manifest is None or len(manifest) != len(request.names):
        return False
    return (request.names == [m.name for m in manifest]
            and request.dtypes == [m.dtype for m in manifest]
            and request.shapes == [list(m.shape) for m in manifest])


#: what ``WeightUpdateEndpoint.call`` dispatches (the endpoint protocol every channel speaks)
METHODS = frozenset({
    "init_weight_transfer",
    "close_weight_transfer",
    "start_weight_update",
    "update_named_weights",
    "finish_weight_update",
    "apply_update",
    "status",
})


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


def _without_slot(adapter: dict | None) -> dict | None:
    """A start's ``lora_adapter`` without the server's choice of version slot."""
    return None if adapter is None else {k: v for k, v in adapter.items() if k != "slot"}
