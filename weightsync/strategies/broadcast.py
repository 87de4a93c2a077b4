"""``broadcast``: weights travel as torch.distributed broadcasts over a private group.

Processes: the sender is rank 0 (the training process that holds the gathered weights); every
engine worker is a receiver at ``rank_offset + local rank``. The group (gloo on CPU, NCCL on GPU)
is built by ``create_sender`` on the trainer *concurrently* with the engines' receivers (through
``inference_client.init_weight_transfer``), so one call on the trainer wires everything.

Per chunk (one ``BroadcastWeightUpdateRequest`` on the control plane):
1. every receiver checks the request against its loader (``loader.validate``, in the receiver
   base class's template);
2. all ranks ``all_reduce(MIN)`` a go/no-go flag: if any receiver said no (a rejecting receiver
   votes no through ``refuse``), no rank moves the bulk bytes; the rejecting receiver raises
   ``WeightMismatchError`` (its engine's error reaches the sender through
   ``update_named_weights``) and the sender raises too;
3. bulk bytes: ``packed`` (default) sends one broadcast per dtype group of a flat buffer laid
   out by ``_layout.plan_layout``; otherwise one broadcast per tensor. Receivers keep one
   receive buffer, grown only when a chunk is bigger, so they allocate at most the bucket.

The sender runs its collectives in a thread concurrently with
``inference_client.update_named_weights``; whichever side fails first decides the error. A
failure in the middle of the bulk data leaves the group unusable (peers disagree on what comes
next): the sender then refuses further syncs and says to re-create it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from weightsync._runtime import trace
from weightsync._runtime.pool import BufferPool
from weightsync._runtime.process_group import (
    Group,
    Pending,
    build_group,
    default_master_addr,
    make_master_store,
)
from weightsync._runtime.threads import SerialLane, in_thread, spawn
from weightsync.config import StrategyConfig
from weightsync.errors import (
    EngineDiedError,
    ManifestUnknownError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncTimeout,
)
from weightsync.interfaces import (
    InferenceEngineClient,
    WeightLoader,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
)
from weightsync.raw_weights import stream_manifest
from weightsync.strategies._layout import (
    DEFAULT_ALIGN,
    PackedLayout,
    as_bytes,
    pack_into,
    plan_layout,
)
from weightsync.strategies._replay import (
    KeptLayouts,
    LastUpdate,
    engine_loader,
    held_chunks,
    manifest_ids,
    update_options,
)
from weightsync.strategies._stream import (
    PACK_BYTES,
    SMALL_BYTES,
    WIRE_VERSION,
    ChunkLayouts,
    Staging,
    StreamFeed,
    StreamReceiver,
    send_stream,
)
from weightsync.types import (
    MAX_WORLD_SIZE,
    SyncStats,
    TensorMeta,
    WeightChunk,
    WeightSyncInfo,
    WeightUpdateFinish,
    WeightUpdateRequest,
    check_timeouts,
    is_int,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

# Grace period for the engines' answer once the data plane failed: their error names the engine.
# Longer than the fan-out's own grace (``clients.policy.DEFAULT_GRACE_S``), so that a silent
# engine is reported by the fan-out before we give up on its answer.
_ENGINE_ERROR_GRACE_S = 5.0


def _grace(client: Any) -> float:
    return float(getattr(client, "grace_s", _ENGINE_ERROR_GRACE_S)) + 2.0


# --------------------------------------------------------------------------------------------
# the strategy's config and wire types
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class BroadcastConfig(StrategyConfig):
    type: str = "broadcast"
    backend: str = "gloo"  # "gloo" (CPU) or "nccl" (GPU)
    master_addr: str | None = None  # default: this node's address (from Ray when running there)
    master_port: int | None = None  # default: a free port
    group_name: str = "weightsync"
    # the whole update in one control call, the bytes straight into the engines' weights
    # (strategies/_stream.py); False: one control call, one vote and one packed buffer per chunk
    stream: bool = True
    packed: bool = True  # (stream: false) one broadcast per dtype per chunk, not one per tensor
    # (stream, NCCL) each chunk's broadcasts as one NCCL group call: one launch for the chunk's
    # tensors instead of one kernel per tensor (the fixed cost of a model with many mid-sized
    # tensors); False: one NCCL call per tensor, as before
    group_calls: bool = True
    # (stream) chunk k + 1 moves while chunk k is waited for and landed, on both sides
    # (strategies/_stream.py); False: one chunk at a time, as before (the bench's
    # broadcast_serial row)
    overlap_chunks: bool = True
    # (stream) tensors under pack_below_mb MB travel packed, in buffers of at most pack_mb MB
    # (one broadcast for many small tensors: fewer calls for the host to issue, one copy in and
    # out); larger ones straight from the trainer's tensor into the engine's (strategies/
    # _stream.py says how the defaults were measured). The engines follow the request
    pack_below_mb: float = SMALL_BYTES / (1 << 20)
    pack_mb: float = PACK_BYTES / (1 << 20)
    # 2 works over gloo (tested) and cut a 7B NCCL sync from 0.111 to 0.097 s on 2 x H200, but in
    # that run the bench's check after the syncs did not finish in time and the cause is not
    # known yet (docs/benchmarks.md). Until a GPU run clears it, broadcast sends one chunk at a
    # time unless asked for more.
    max_inflight_chunks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pack_below_mb >= 0:
            raise ValueError(f"strategy {self.type!r}: pack_below_mb must be >= 0, got "
                             f"{self.pack_below_mb!r}")
        if not self.pack_mb > 0:
            raise ValueError(f"strategy {self.type!r}: pack_mb must be > 0, got {self.pack_mb!r}")


@dataclass(kw_only=True)
class TorchDistributedWeightSyncInfo(WeightSyncInfo):
    """Rendezvous for a private torch.distributed group: rank 0 sends, ranks 1.. receive."""

    TYPE: ClassVar[str] = "torch_distributed"
    master_addr: str
    master_port: int
    world_size: int
    group_name: str = "weightsync"
    backend: str = "gloo"
    # the group's waits (``StrategyConfig``'s timeouts): each collective ``timeout_s`` plus
    # ``timeout_s_per_gb`` per GB it moves; building the group ``join_timeout_s``
    timeout_s: float = 30.0
    timeout_s_per_gb: float = 20.0
    join_timeout_s: float = 120.0

    def _coerce(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a host name, got {self.master_addr!r}")
        if not is_int(self.master_port) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port!r}")
        if not is_int(self.world_size) or not 2 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in [2, {MAX_WORLD_SIZE}] (1 sender + "
                             f"receivers), got {self.world_size!r}")
        if not isinstance(self.group_name, str):
            raise ValueError(f"group_name must be a string, got {self.group_name!r}")
        check_timeouts(self, "timeout_s", "timeout_s_per_gb", "join_timeout_s")


@dataclass(kw_only=True)
class BroadcastWeightUpdateRequest(WeightUpdateRequest):
    """Bytes follow as collective broadcasts from ``src_rank``.

    ``packed``: one flat broadcast per dtype group (tensors in request order, offsets derived
    from shapes, each start aligned to ``align_bytes``); otherwise one broadcast per tensor.
    ``stream``: see the field.
    """

    TYPE: ClassVar[str] = "broadcast"
    src_rank: int = 0
    packed: bool = True
    align_bytes: int = 256
    #: the whole update as one request: its tensors are the manifest, in stream order, and the
    #: bytes follow as the streamed protocol (``strategies/_stream.py``); ``packed`` and
    #: ``align_bytes`` do not apply
    stream: bool = False
    #: (stream, NCCL) each chunk's broadcasts are one NCCL group call on every rank; receivers
    #: must issue theirs the same way, so the sender decides and says so here
    grouped: bool = False
    #: (stream) the order of the stream's collectives (``strategies/_stream.py``); an engine
    #: that speaks another refuses the update before any byte moves. Absent: 1 (an older sender)
    wire_version: int = 1
    #: (stream) how each chunk's tensors are cut into broadcasts (``plan_transfers``): tensors
    #: under ``pack_below_bytes`` packed into buffers of at most ``pack_bytes``
    pack_below_bytes: int = SMALL_BYTES
    pack_bytes: int = PACK_BYTES
    #: (stream) names the request's entries (names, dtypes, shapes), as the sender assigned;
    #: a request that carries only the key (no names) means "the entries of the request that
    #: carried this key in full before": each receiver keeps them decoded
    #: (``BroadcastTransferReceiver.parse_request``)
    layout_key: str = ""

    @property
    def is_reference(self) -> bool:
        """Only ``layout_key``: the receiver fills in the entries it keeps for it."""
        return bool(self.layout_key) and not self.names

    def _coerce(self) -> None:
        if self.is_reference and (self.dtypes or self.shapes or self.checksums):
            raise ValueError("broadcast request: a layout reference carries no entries (dtypes, "
                             "shapes, checksums)")
        if not isinstance(self.layout_key, str):
            raise ValueError(f"broadcast request: layout_key must be a string, got "
                             f"{self.layout_key!r}")
        super()._coerce()
        for f, low in (("wire_version", 1), ("pack_below_bytes", 0), ("pack_bytes", 1)):
            v = getattr(self, f)
            if not is_int(v) or v < low:
                raise ValueError(f"broadcast request: {f} must be an int >= {low}, got {v!r}")


# --------------------------------------------------------------------------------------------
# strategy
# --------------------------------------------------------------------------------------------


class BroadcastTransferStrategy(WeightTransferStrategy):
    name = "broadcast"
    config_cls = BroadcastConfig

    def __init__(self, cfg: BroadcastConfig | None = None) -> None:
        super().__init__(cfg)
        if self.cfg.backend not in ("gloo", "nccl"):
            raise ValueError(f"broadcast backend must be 'gloo' or 'nccl', got {self.cfg.backend!r}")
        self._stores: dict[tuple[str, int], Any] = {}  # master stores made by create_sync_info
        self._world_sizes: dict[tuple[str, int], list[int]] = {}  # the engines' sizes, likewise

    @classmethod
    def get_request_type(cls) -> type[WeightUpdateRequest]:
        return BroadcastWeightUpdateRequest

    async def create_sync_info(
        self, cfg: BroadcastConfig | None, inference_client: InferenceEngineClient
    ) -> TorchDistributedWeightSyncInfo:
        """Trainer side: world size from the engines, address from Ray/cfg, a fresh port."""
        cfg = self.own_config(cfg)
        world_sizes = await inference_client.get_world_sizes()
        if not world_sizes or any(int(w) < 1 for w in world_sizes):
            raise WeightSyncError(f"engines reported world sizes {world_sizes}; need >= 1 each")
        world_size = 1 + sum(int(w) for w in world_sizes)
        addr = cfg.master_addr or default_master_addr()
        store = make_master_store(int(cfg.master_port or 0), world_size, cfg.join_timeout_s)
        port = int(store.port)
        self._stores[(addr, port)] = store
        self._world_sizes[(addr, port)] = [int(w) for w in world_sizes]
        return TorchDistributedWeightSyncInfo(
            master_addr=addr, master_port=port, world_size=world_size,
            group_name=cfg.group_name, backend=cfg.backend, timeout_s=float(cfg.timeout_s),
            timeout_s_per_gb=float(cfg.timeout_s_per_gb),
            join_timeout_s=float(cfg.join_timeout_s),
        )

    async def create_sender(
        self,
        cfg: BroadcastConfig | None,
        inference_client: InferenceEngineClient,
        sync_info: WeightSyncInfo,
    ) -> BroadcastTransferSender:
        """Trainer side: join as rank 0 while every engine joins through the client."""
        cfg = self.own_config(cfg)
        info = _as_info(sync_info)
        store = self._stores.pop((info.master_addr, info.master_port), None)
        sizes = self._world_sizes.pop((info.master_addr, info.master_port), None)
        if store is None:  # sync info made elsewhere: host the store here if nobody does
            with contextlib.suppress(WeightSyncError):
                store = make_master_store(info.master_port, info.world_size, info.join_timeout_s)
        device = None
        if info.backend == "nccl":
            import torch

            device = torch.device("cuda", torch.cuda.current_device())

        own = asyncio.ensure_future(
            in_thread(lambda: build_group(info, 0, store=store, device=device))
        )
        engines = asyncio.ensure_future(
            inference_client.init_weight_transfer(self.config_dict(), info.to_dict())
        )
        try:
            group = await _first_failure(
                own, engines, info.join_timeout_s + _ENGINE_ERROR_GRACE_S,
                "joining the weight-sync group", grace_s=_grace(inference_client))
        except BaseException as e:
            if not own.done():  # our side fails at the same deadline: it knows who is missing
                await asyncio.wait({own}, timeout=_ENGINE_ERROR_GRACE_S)
            raise _name_missing_engines(e, own, sizes, inference_client) from None
        return BroadcastTransferSender(cfg, group, info)

    async def create_receiver(
        self, cfg: BroadcastConfig | None, sync_info: WeightSyncInfo, rank_offset: int
    ) -> BroadcastTransferReceiver:
        """Engine side: join the group as ``rank_offset``."""
        cfg = self.own_config(cfg)
        info = _as_info(sync_info)
        device = None
        if info.backend == "nccl":
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        group = await in_thread(lambda: build_group(info, rank_offset, device=device))
        return BroadcastTransferReceiver(cfg, group)


# --------------------------------------------------------------------------------------------
# sender
# --------------------------------------------------------------------------------------------


class BroadcastTransferSender(WeightTransferSender):
    """Rank 0. ``create_request`` packs a chunk into one of two reusable buffers (in a worker
    thread, overlapping the previous chunk's transfer); ``_transfer`` runs the go/no-go vote and
    the broadcasts in a thread while the engines receive.

    A streamed update into **one engine** whose client carries ``apply_update`` is one control
    call: ``apply_update(start, [request], finish)``, issued while the lane enters the vote
    (a refused start refuses the request too, so the engine votes no and the sender gets its
    error; an engine that died fails the call like a death mid-update does). With **several
    engines** the start goes out alone first: it confirms that every engine is alive and
    accepts the update before any rank enters a collective (with one call, an engine found
    dead at start would leave the others in the vote until the group's timeout). Their one
    request and its finish then travel as one ``apply_update`` call (``start`` None) where the
    client carries it and the update is not staged: two control round trips per update, not
    three. Each engine then publishes the update as soon as it holds all of it; a staged
    update keeps the finish apart, sent once every engine received, so that one engine's
    failure leaves every engine on its old weights (with one engine, all or nothing is the
    engine's own: it publishes only a complete update)."""

    single_call = False

    def __init__(self, cfg: BroadcastConfig, group: Group, info: TorchDistributedWeightSyncInfo):
        self.cfg = cfg
        self.group = group
        self.info = info
        self.packed = bool(cfg.packed)
        self.align_bytes = DEFAULT_ALIGN
        self.overlap = True
        self._broken: str | None = None
        self._failed_update: str | None = None
        # one thread runs every vote and broadcast, in the order the requests were issued
        self._lane = SerialLane("ws-broadcast-lane")
        # a buffer comes back when the chunk that holds it is transferred (or gives up)
        self._buffers = BufferPool(
            2, timeout_s=cfg.chunk_timeout_s(int(cfg.bucket_size_mb * (1 << 20))) + 10.0,
            shared=False)
        self._inflight: dict[int, tuple[int | None, torch.Tensor | None, PackedLayout | None]] = {}
        self._lock = threading.Lock()
        # a streamed chunk's packed small tensors: two buffers, chunk k in the k % 2nd
        self._packs = (Staging(group.device), Staging(group.device))
        self._grouped = bool(cfg.group_calls) and group.can_group()
        self._wire = WIRE_VERSION  # the order of the stream's collectives this sender issues
        self._pack = (int(float(cfg.pack_below_mb) * (1 << 20)),
                      max(1, int(float(cfg.pack_mb) * (1 << 20))))
        self._layouts = ChunkLayouts()  # the chunk layouts the lane planned, kept
        self._last: LastUpdate | None = None  # the last streamed update, while replayable
        self.replayed = 0  # streamed updates sent as a replay (tests and benchmarks read it)

    # -- one streamed update --------------------------------------------------------------------
    async def send_chunks(
        self,
        chunks: Any,
        inference_client: InferenceEngineClient,
        *,
        version: int | None = None,
        manifest: list[TensorMeta] | None = None,
        training_mode: Any = None,
        head_name_patterns: list[str] | None = None,
        extras: dict | None = None,
        delta: dict | None = None,
        lora_adapter: dict | None = None,
    ) -> SyncStats:
        """One update. With ``stream`` (default) and a manifest: the streamed protocol
        (``strategies/_stream.py``): the whole update as one request while its chunks are
        broadcast as the extraction yields them; one control call into one engine that carries
        ``apply_update`` (start, request and finish together), else two (the start; the request
        with its finish where every engine carries ``apply_update`` and the update is not
        staged, else the finish as a third call; see the class docstring). Otherwise one
        control call, one vote and one packed broadcast per chunk (the base class)."""
        if manifest is None and isinstance(chunks, (list, tuple)):
            manifest = [m for c in chunks for m in c.metas()]
        elif manifest is None:  # an extractor's dict: its manifest, from the same extraction
            manifest = await stream_manifest(chunks)
        if not self.cfg.stream or manifest is None:
            return await super().send_chunks(
                chunks, inference_client, version=version, manifest=manifest,
                training_mode=training_mode, head_name_patterns=head_name_patterns,
                extras=extras, delta=delta, lora_adapter=lora_adapter)
        self._check_usable()
        options = {"manifest": manifest, "training_mode": training_mode,
                   "head_name_patterns": head_name_patterns, "extras": extras, "delta": delta,
                   "lora_adapter": lora_adapter}
        held = held_chunks(chunks)
        last, self._last = self._last, None  # kept again once this update went through
        try:
            stats = await self._send_stream(chunks, inference_client, version, options, held,
                                            last)
        except ManifestUnknownError:
            # a replay's start referred to a manifest its one engine no longer keeps: refused
            # before anything changed (the engine voted no): the update in full
            stats = await self._send_stream(chunks, inference_client, version, options, held,
                                            None)
        return stats

    async def _send_stream(self, chunks: Any, inference_client: InferenceEngineClient,
                           version: int | None, options: dict, held: list | None,
                           last: LastUpdate | None) -> SyncStats:
        """One streamed update (see ``send_chunks``). An update of the very chunks of the last
        one (``held``, ``last.fits``: the front door's held update or the same list, the same
        options and manifest) is *replayed*: the start and request of ``last`` with this
        update's id and version; the request refers to the layout every engine keeps decoded
        (``layout_key``) and, with one engine, the start to the manifest it keeps
        (``manifest_of``): nothing is planned, serialized or validated again. Else the
        update is sent in full, with a layout key when it may be replayed."""
        manifest = options["manifest"]
        stats = SyncStats(update_id=uuid.uuid4().hex)
        t0 = time.perf_counter()
        carries_apply = bool(getattr(inference_client, "supports_apply_update", False))
        one_engine = carries_apply and len(getattr(inference_client, "names", None) or ()) == 1
        replay = last is not None and held is not None and last.fits(held, options)
        total = last.nbytes if replay and last is not None else sum(m.nbytes for m in manifest)
        if replay:
            assert last is not None
            start_d, request_d, finish_d = last.messages(stats.update_id, version,
                                                         manifest_by_reference=one_engine)
            staged = bool(start_d.get("staged"))
            self.replayed += 1
            trace.mark("lane.replay", tensors=len(manifest))
        else:
            start = self.start_message(stats.update_id, version, manifest,
                                       options["training_mode"], options["head_name_patterns"],
                                       options["extras"], delta=options["delta"],
                                       lora_adapter=options["lora_adapter"])
            replayable = (held is not None and not self.cfg.checksum
                          and options["delta"] is None and not options["extras"])
            request = BroadcastWeightUpdateRequest(
                names=[m.name for m in manifest], dtypes=[m.dtype for m in manifest],
                shapes=[list(m.shape) for m in manifest], src_rank=0, packed=False,
                stream=True, grouped=self._grouped, wire_version=self._wire,
                pack_below_bytes=self._pack[0], pack_bytes=self._pack[1],
                update_id=stats.update_id, chunk_index=0, is_last=True, version=version,
                checksums=[0] * len(manifest) if self.cfg.checksum else None,
                layout_key=uuid.uuid4().hex if replayable else "")
            finish = WeightUpdateFinish(update_id=stats.update_id, version=version,
                                        num_chunks=1)
            start_d, request_d, finish_d = start.to_dict(), request.to_dict(), finish.to_dict()
            staged = start.staged
            if replayable:
                assert held is not None
                last = LastUpdate(held=list(held), options=update_options(options),
                                  manifest_ids=manifest_ids(manifest), start=start_d,
                                  request={**request_d, "names": [], "dtypes": [],
                                           "shapes": []}, nbytes=total)
        if one_engine:
            # one engine: the whole update is one call (see the class docstring)
            trace.mark("rpc.apply.begin", tensors=len(manifest), bytes=total)
            # issued here, before the lane starts its vote (a channel that can sends the call
            # before apply_update returns: the engine's start overlaps the lane's set-up); one
            # refused before it left raises here, before any rank enters a collective
            engines = asyncio.ensure_future(_applied(inference_client.apply_update(
                start_d, [request_d], finish_d)))
        else:
            # the start on its own first: every engine is alive and accepts the update before
            # any rank enters a collective (see the class docstring)
            trace.mark("rpc.start.begin", tensors=len(manifest), bytes=total)
            await inference_client.start_weight_update(start_d)
            trace.mark("rpc.start.end")
            engines = asyncio.ensure_future(_chunk_then_finish(
                inference_client, request_d, finish_d, fused=carries_apply and not staged))
        # chunk k - 1 in flight, k going out, k + 1 announced; chunks that exist already (a
        # list, or an iterable that says ``ready_made``) are handed over before the vote ends
        feed = StreamFeed(depth=3, early=isinstance(chunks, (list, tuple))
                          or bool(getattr(chunks, "ready_made", False)))
        data = asyncio.wrap_future(self._lane.submit(
            self._stream_data, feed))
        feeder = asyncio.ensure_future(feed.fill(chunks, manifest))
        try:
            outcome = await _first_failure(
                data, engines, self.cfg.chunk_timeout_s(total) + self.cfg.join_timeout_s,
                "the streamed update", grace_s=_grace(inference_client))
        except BaseException as e:
            dead = isinstance(e, (EngineDiedError, WeightSyncTimeout))
            if not feeder.done():  # the lane then sends the abort: the group stays in step
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
            if not data.done() and not dead:  # the lane is still in step (a refusal, an abort)
                await asyncio.wait({data}, timeout=_ENGINE_ERROR_GRACE_S)
            data_failed = not data.done() or data.cancelled() or data.exception() is not None
            if not isinstance(e, WeightMismatchError) and (data_failed or dead):
                self._broken = self._broken or f"{type(e).__name__}: {e}"[:300]
            raise _stream_error(feeder, e) from None
        finally:
            if not feeder.done():
                feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        if outcome == "aborted":  # pragma: no cover - the engines always refuse an abort
            raise _stream_error(feeder, WeightSyncError("the update was aborted"))
        if outcome is False:  # pragma: no cover - engines answered OK but someone voted no
            raise WeightSyncError("an engine refused the streamed update but reported no error")
        answer = engines.result()
        stats.versions = list(answer if answer is not None else [])
        stats.num_chunks, stats.num_tensors, stats.total_bytes = (
            feed.chunks, feed.tensors, feed.nbytes)
        stats.seconds = time.perf_counter() - t0
        self._last = last  # every engine holds its manifest and layout now
        return stats

    def _stream_data(self, feed: StreamFeed) -> bool | str:
        """On the lane thread: the whole streamed update's collectives."""
        try:
            return send_stream(self.group, feed, checksum=bool(self.cfg.checksum),
                               idle_timeout_s=float(self.cfg.idle_timeout_s), packs=self._packs,
                               grouped=self._grouped, overlap=bool(self.cfg.overlap_chunks),
                               pack_below=self._pack[0], pack_bytes=self._pack[1],
                               layouts=self._layouts)
        except BaseException as e:
            self._broken = self._broken or f"{type(e).__name__}: {e}"[:300]
            raise

    def _check_usable(self) -> None:
        if self._broken:
            raise WeightSyncError(
                f"the broadcast group is unusable after an earlier failure ({self._broken}); "
                f"create a new sender (strategy.create_sender) and re-initialise the engines"
            )

    # -- per chunk ---------------------------------------------------------------------------
    def create_request(self, chunk: WeightChunk) -> BroadcastWeightUpdateRequest:
        req = BroadcastWeightUpdateRequest(
            names=list(chunk.names), dtypes=chunk.dtype_names, shapes=chunk.shape_lists,
            src_rank=0, packed=self.packed, align_bytes=self.align_bytes,
        )
        slot = buf = layout = None
        if self.packed:
            layout = plan_layout(req.metas(), self.align_bytes)
            device = self._device_for(chunk)
            slot, held = self._buffers.acquire(layout.total_nbytes, device)
            buf = held.tensor[: layout.total_nbytes]
            pack_into(layout, chunk.tensors, layout.split(buf))
            if buf.is_cuda:
                import torch

                torch.cuda.current_stream(buf.device).synchronize()
        with self._lock:
            self._inflight[id(req)] = (slot, buf, layout)
        return req

    async def _transfer(
        self,
        chunk: WeightChunk,
        request: WeightUpdateRequest,
        inference_client: InferenceEngineClient,
    ) -> None:
        self._check_usable()
        with self._lock:
            _, buf, layout = self._inflight.get(id(request), (None, None, None))
        # The data job is queued on the lane before the engines' request is issued, with no
        # await in between: every request the engines get has exactly one sender vote, in
        # chunk order, even if this task is cancelled or an earlier chunk failed.
        data = asyncio.wrap_future(
            self._lane.submit(self._send_data, chunk, buf, layout, request.update_id)
        )
        engines = asyncio.ensure_future(inference_client.update_named_weights(request.to_dict()))
        try:
            go = await _first_failure(
                data, engines, self.cfg.chunk_timeout_s(request.total_size_bytes),
                f"chunk {request.chunk_index}", grace_s=_grace(inference_client),
            )
        except BaseException as e:
            self._failed_update = request.update_id  # later chunks of it: the lane votes no
            # A refusal (mismatch) leaves the group in step. It is out of step when our side of
            # the collective did not finish, and also when a member died or hung, even if our
            # sends already left (gloo completes a broadcast into the socket buffers of a peer
            # that is dead by now).
            dead = isinstance(e, (EngineDiedError, WeightSyncTimeout))
            if not data.done() and not dead:  # a refusing engine still votes: let it finish
                await asyncio.wait({data}, timeout=_ENGINE_ERROR_GRACE_S)
            data_failed = not data.done() or data.cancelled() or data.exception() is not None
            if not isinstance(e, WeightMismatchError) and (data_failed or dead):
                self._broken = self._broken or f"{type(e).__name__}: {e}"[:300]
            raise
        if go is False:  # pragma: no cover - engines answered OK but someone voted no
            raise WeightSyncError(
                f"an engine rejected chunk {request.chunk_index} but reported no error"
            )

    def _send_data(
        self,
        chunk: WeightChunk,
        buf: torch.Tensor | None,
        layout: PackedLayout | None,
        update_id: str,
    ) -> bool:
        """On the lane thread: vote (no, once a chunk of this update failed), then broadcast
        the bytes. Returns False if anyone voted no. A failed collective breaks the group."""
        try:
            return self._vote_and_send(chunk, buf, layout, update_id != self._failed_update)
        except BaseException as e:
            self._broken = self._broken or f"{type(e).__name__}: {e}"[:300]
            raise

    def _vote_and_send(
        self, chunk: WeightChunk, buf: torch.Tensor | None, layout: PackedLayout | None, go: bool
    ) -> bool:
        import torch

        dev = self.group.device
        with self.group.on_device():
            if self.group.all_reduce_min(1 if go else 0) == 0:
                return False
            if buf is not None and layout is not None:
                for part in layout.split(buf):
                    if part.numel():
                        self.group.broadcast(part, src=0)
            else:
                for t in chunk.tensors:
                    b = as_bytes(t)
                    if b.numel():
                        self.group.broadcast(self._on_group_device(b), src=0)
            if dev is not None and dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()  # buffers reusable after this
        return True

    def _on_group_device(self, b: torch.Tensor) -> torch.Tensor:
        dev = self.group.device
        if dev is not None and b.device != dev:
            return b.to(dev)
        return b

    def _device_for(self, chunk: WeightChunk) -> Any:
        import torch

        if self.group.backend_name == "nccl":
            return self.group.device
        return torch.device("cpu")

    def _release(self, request: WeightUpdateRequest) -> None:
        with self._lock:
            slot, _, _ = self._inflight.pop(id(request), (None, None, None))
        if slot is not None:
            self._buffers.release(slot)

    async def close(self) -> None:
        self._lane.close()
        self._buffers.close()
        for pack in self._packs:
            pack.close()
        self.group.close()


# --------------------------------------------------------------------------------------------
# receiver
# --------------------------------------------------------------------------------------------


class BroadcastTransferReceiver(WeightTransferReceiver):
    """Engine worker at rank ``group.rank``. One receive buffer, reused across chunks."""

    request_cls = BroadcastWeightUpdateRequest

    def __init__(self, cfg: BroadcastConfig, group: Group) -> None:
        self.cfg = cfg
        self.group = group
        self._buf: torch.Tensor | None = None
        self.stream = StreamReceiver(group, Staging(group.device),
                                     header_timeout_s=float(cfg.idle_timeout_s),
                                     overlap=bool(cfg.overlap_chunks))
        # the entries of streamed requests that carried a layout key, most recent last
        self.layouts = KeptLayouts(KEPT_LAYOUTS)

    def parse_request(self, request_dict: dict) -> WeightUpdateRequest:
        """As the base class; a layout reference gets the entries the request that carried its
        key in full had (the very lists: the endpoint then knows them for the update's manifest
        without a compare). A key this receiver does not hold leaves the reference bare: it is
        refused before the vote (``_cannot_stream``), so the group stays in step."""
        req = super().parse_request(request_dict)
        key = getattr(req, "layout_key", "")
        if not key:
            return req
        if req.is_reference:
            known = self.layouts.find(key)
            if known is not None:
                req.names, req.dtypes, req.shapes = known.names, known.dtypes, known.shapes
        else:
            self.layouts.keep(key, _Entries(req.names, req.dtypes, req.shapes))
        return req

    def _known_valid(self, request: WeightUpdateRequest, loader: WeightLoader) -> bool:
        known = self.layouts.get(getattr(request, "layout_key", "") or "")
        return (known is not None and request.names is known.names
                and known.valid_for is engine_loader(loader))

    async def _receive_and_load(
        self, request: WeightUpdateRequest, loader: WeightLoader
    ) -> None:
        if getattr(request, "stream", False):
            why = self._cannot_stream(request)
            if why:
                await in_thread(self._vote_no)  # nobody moves a byte
                raise WeightSyncError(f"update {request.update_id}: {why}; this engine's "
                                      f"weights are unchanged")
            trace.mark("recv.vote")
            known = self.layouts.get(request.layout_key) if request.layout_key else None
            if known is not None:  # the template validated it before calling us
                known.valid_for = engine_loader(loader)
            # issued here (so it is out before this thread's next Python), waited for on a
            # helper thread; meanwhile: the update's entries, the first chunk's plan
            voting = spawn(self._vote_yes, self._start_vote_yes())
            try:
                prepared = self.stream.prepare(
                    request, loader, known.metas() if known is not None else None)
            finally:
                go = await asyncio.wrap_future(voting)  # (the vote goes on either way)
            if not go:
                raise WeightSyncError(
                    f"update {request.update_id} was rejected by another engine; nothing was "
                    f"moved (this engine's weights are unchanged)")
            trace.mark("recv.voted")
            await self.stream.run(request, loader, prepared)
            return
        tensors = await in_thread(self._recv_data, request)
        if tensors is None:
            raise WeightSyncError(
                f"chunk {request.chunk_index} was rejected by another engine; nothing was "
                f"moved (this engine's weights are unchanged)"
            )
        await loader.load_weights(tensors)

    def _cannot_stream(self, request: BroadcastWeightUpdateRequest) -> str:
        """Why this engine cannot take a streamed update as the sender will send it ('' if it
        can): checked before the vote, so a refusal moves no byte."""
        if request.wire_version != WIRE_VERSION:
            return (f"the sender streams wire version {request.wire_version}, this engine "
                    f"speaks {WIRE_VERSION} (weightsync versions differ between trainer and "
                    f"engine: install the same on both)")
        if request.is_reference:
            return (f"the request refers to layout {request.layout_key[:8]}, which this engine "
                    f"does not hold (its receiver was re-initialised?); connect again (a new "
                    f"sender sends every layout in full)")
        if request.grouped and not self.group.can_group():
            return (f"it asks for grouped NCCL broadcasts (the sender's group_calls: true) but "
                    f"this engine's {self.group.backend_name} group cannot issue them (torch "
                    f"without coalescing); set group_calls: false on the sender")
        return ""

    async def refuse(self, request: WeightUpdateRequest) -> None:
        await in_thread(self._vote_no)

    def _vote_no(self) -> None:
        with self.group.on_device():
            self.group.all_reduce_min(0)

    def _start_vote_yes(self) -> Pending:
        with self.group.on_device():
            return self.group.start_all_reduce_min(1)

    def _vote_yes(self, issued: Pending) -> bool:
        """Wait for this engine's yes vote (``issued`` by ``_start_vote_yes``): whether every
        member voted yes."""
        trace.mark("recv.vote.thread")
        with self.group.on_device():
            return self.group.finish_all_reduce_min(issued) == 1

    def _recv_data(self, request: BroadcastWeightUpdateRequest) -> dict[str, torch.Tensor] | None:
        """Vote yes (the chunk was validated); None if anyone voted no, else the chunk's
        tensors as views of the receive buffer."""
        with self.group.on_device():
            if self.group.all_reduce_min(1) == 0:
                return None
            layout = plan_layout(request.metas(), request.align_bytes)
            buf = self._buffer(layout.total_nbytes)
            parts = layout.split(buf)
            if request.packed:
                for part in parts:
                    if part.numel():
                        self.group.broadcast(part, src=request.src_rank)
            else:
                for i, m in enumerate(layout.metas):
                    if m.nbytes:
                        g, off = layout.group_of[i], layout.offsets[i]
                        self.group.broadcast(parts[g][off : off + m.nbytes], src=request.src_rank)
            return layout.tensor_views(parts)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # free the old one before allocating the bigger one
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.group.device)
        return self._buf[:nbytes]

    def close(self) -> None:
        self._buf = None
        self.stream.close()
        self.group.close()


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


#: streamed layouts a receiver keeps for references (a sender refers to its last update's)
KEPT_LAYOUTS = 16


class _Entries:
    """A streamed request's entries kept for its layout key (receiver side): the lists it
    carried, the loader that accepted them, and their ``TensorMeta`` s made once (the same
    objects every update: the stream's chunk plans are kept for them)."""

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.valid_for: Any = None
        self._metas: list[TensorMeta] | None = None

    def metas(self) -> list[TensorMeta]:
        if self._metas is None:
            self._metas = [TensorMeta(n, d, s) for n, d, s in
                           zip(self.names, self.dtypes, self.shapes, strict=True)]
        return self._metas


async def _applied(call: Any) -> list[int | None]:
    """The answer to a streamed update's one ``apply_update`` call into one engine (issued
    already). A failed call sends nothing more: the engine's ``apply_update`` closed its own
    update, or never opened it (a refused start)."""
    versions = list(await call)
    trace.mark("rpc.apply.end")
    return versions


async def _chunk_then_finish(client: InferenceEngineClient, request: dict,
                             finish: dict, *, fused: bool = False) -> list[int | None]:
    """A streamed update's one request, then its finish (its start was answered by its own
    call): one ``apply_update(None, [request], finish)`` call with ``fused``, else two calls,
    the finish once every engine answered the request. A failed request call closes the
    update as aborted on the engines that are left; a failed fused call sends nothing more
    (an engine's ``apply_update`` closes its own update when it fails; an engine that died or
    hangs gets its update superseded by the next start)."""
    if fused:
        return await _applied(client.apply_update(None, [request], finish))
    try:
        await client.update_named_weights(request)
        trace.mark("rpc.request.end")
    except BaseException as e:  # close the update on the engines that are left, in the background
        abort = {**finish, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        with contextlib.suppress(Exception):
            closing = asyncio.ensure_future(client.finish_weight_update(abort))
            closing.add_done_callback(_consume)
        raise
    versions = list(await client.finish_weight_update(finish))
    trace.mark("rpc.finish.end")
    return versions


def _stream_error(feeder: asyncio.Future, error: BaseException) -> BaseException:
    """The error to raise for a failed streamed update: the sender's own stream failure (an
    extraction error, a chunk that does not follow the manifest) when there was one, since the
    engines only saw the abort it caused; else ``error``."""
    if feeder.done() and not feeder.cancelled() and feeder.exception() is not None:
        return feeder.exception()  # type: ignore[return-value]
    return error


def _as_info(sync_info: Any) -> TorchDistributedWeightSyncInfo:
    info = sync_info if isinstance(sync_info, WeightSyncInfo) else WeightSyncInfo.from_dict(sync_info)
    if not isinstance(info, TorchDistributedWeightSyncInfo):
        raise ValueError(
            f"broadcast needs a torch_distributed sync info, got {type(info).__name__}"
        )
    return info


async def _first_failure(
    data: asyncio.Future, engines: asyncio.Future, timeout_s: float, what: str,
    *, grace_s: float = _ENGINE_ERROR_GRACE_S,
) -> Any:
    """Await both; the first failure wins (engine errors preferred: they name the engine).

    Returns ``data``'s result. A data-plane failure waits a short grace for the engines' error.
    Nothing is left un-retrieved: a future still running when we raise gets a callback that
    consumes its outcome.
    """
    try:
        done, _ = await asyncio.wait(
            {data, engines}, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION
        )
        if engines in done and engines.exception() is not None:
            raise engines.exception()  # type: ignore[misc]
        if data in done and data.exception() is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(engines), grace_s)
            if engines.done() and not engines.cancelled() and engines.exception() is not None:
                raise engines.exception()  # type: ignore[misc]
            raise data.exception()  # type: ignore[misc]
        if data in done and data.result() is False:
            # a receiver voted no: its engine's WeightMismatchError is on the way
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(engines), timeout_s)
            if engines.done() and engines.exception() is not None:
                raise engines.exception()  # type: ignore[misc]
            return False
        if len(done) < 2:
            if not engines.done():  # the fan-out's own timeout names the silent engine
                with contextlib.suppress(asyncio.TimeoutError, Exception):
                    await asyncio.wait_for(asyncio.shield(engines), grace_s)
                if engines.done() and not engines.cancelled() and engines.exception() is not None:
                    raise engines.exception()  # type: ignore[misc]
            late = "the engines" if not engines.done() else "the data plane"
            raise WeightSyncTimeout(
                f"{what}: no answer from {late} within {timeout_s:g}s (an engine died or hangs?)"
            )
        return data.result()
    finally:
        for f in (data, engines):
            if not f.done():
                f.add_done_callback(_consume)
            else:
                _consume(f)


def _consume(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def _name_missing_engines(
    e: BaseException, own: asyncio.Future, sizes: list[int] | None, client: Any
) -> BaseException:
    """A group that did not form: when our side knows which ranks never arrived, name the
    engines that own them (rank 0 is us; engine ``i`` holds ``world_sizes[i]`` ranks in
    order), ahead of the follow-on errors of the engines that did arrive."""
    from weightsync._runtime.process_group import GroupJoinError

    mine = own.exception() if own.done() and not own.cancelled() else None
    if not isinstance(mine, GroupJoinError) or not mine.missing or not sizes:
        return e
    names = list(getattr(client, "names", None) or [f"engine {i}" for i in range(len(sizes))])
    offsets = InferenceEngineClient.rank_offsets(sizes)
    culprits = [
        f"{name} (ranks {off}..{off + w - 1})"
        for name, off, w in zip(names, offsets, sizes, strict=False)
        if any(off <= r < off + w for r in mine.missing)
    ]
    err = GroupJoinError(
        f"the weight-sync group did not form within {mine.join_s:g}s: "
        f"{', '.join(culprits) or f'ranks {mine.missing}'} never joined; check that "
        f"{'they are' if len(culprits) > 1 else 'it is'} alive and can reach the rendezvous "
        f"(the other engines answered: {type(e).__name__}: {str(e)[:300]})",
        mine.missing, mine.join_s,
    )
    return err
