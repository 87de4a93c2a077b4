"""``cuda_ipc``: one shared buffer per tensor, for engines on the same node as the trainer.

- CUDA tensors: zero copy. The request carries the CUDA IPC handle of the allocation that holds
  each tensor (``_runtime.cuda_handles.encode``); the engine opens it once (cached) and reads a view.
- CPU tensors in shared weights (``shared_weights.share_cpu_weights`` was called on the model):
  zero copy as on GPU. The request names the segment that holds the tensor and its offset; the
  engine maps the segment once (kept across syncs while the trainer keeps it) and reads a view.
- Other CPU tensors: POSIX shared memory. The sender copies each tensor into a segment taken
  from a size-keyed pool (``_runtime.pool.SizedSegmentPool``: layers repeat shapes, so segments are reused across
  chunks and syncs and their pages are touched once); the engine maps it by name (cached) and
  builds a dtype/shape view with ``torch.frombuffer``, no copy.

Processes: ``create_sender`` / the sender run in the training process; receivers in the engine
workers. With ``every_rank: true`` (hybrid engines: training rank i and engine worker i share a
GPU) every training rank runs a sender in lockstep and each worker reads its own rank's copy
(``strategies/_every_rank.py``). There is no data-plane rendezvous (``EmptyWeightSyncInfo``); the engine only has to
see the same GPUs / the same ``/dev/shm``. Every request's bytes stay valid until the engine
call that carried it returned (the sender releases them after the engines answered): the
receiver hands its views on as lent (``WeightLoader.load_borrowed``), so the loader copies out
of them before its ``update_named_weights`` returns, or, when that call is the update's one
``apply_update``, before its finish returns (an adapter copies them straight where vLLM holds
it).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from weightsync._runtime import trace
from weightsync._runtime.copy import copy_into
from weightsync._runtime.pool import SizedSegmentPool
from weightsync._runtime.shm import AttachedSegments, Segment
from weightsync.config import StrategyConfig
from weightsync.errors import ManifestUnknownError, WeightSyncError, WeightSyncTimeout
from weightsync.interfaces import (
    InferenceEngineClient,
    WeightLoader,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
)
from weightsync.pipeline import coalesce
from weightsync.strategies._every_rank import (
    EveryRankClient,
    EveryRankSender,
    RankGroup,
    pick_replica,
)
from weightsync.strategies._ipc_open import IpcBufferOpener
from weightsync.strategies._layout import as_bytes, views_into
from weightsync.strategies._replay import (
    KeptLayouts,
    LastUpdate,
    engine_loader,
    held_chunks,
    manifest_ids,
    update_options,
)
from weightsync.strategies.shared_weights import locate_many
from weightsync.types import (
    EmptyWeightSyncInfo,
    IpcBufferHandle,
    SyncStats,
    WeightChunk,
    WeightSyncInfo,
    WeightUpdateRequest,
    is_int,
    parse_handles,
    parse_replicas,
)

if TYPE_CHECKING:  # pragma: no cover
    pass


# --------------------------------------------------------------------------------------------
# the strategy's config and wire type
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class IpcConfig(StrategyConfig):
    type: str = "cuda_ipc"
    # hybrid engines (trainer rank i and engine worker i on one GPU): every training rank sends
    # handles to its own copy of each chunk and each worker reads the copy on its GPU; every
    # rank calls create_sender / send_chunks in lockstep (strategies/_every_rank.py)
    every_rank: bool = False


@dataclass(kw_only=True)
class CudaIpcWeightUpdateRequest(WeightUpdateRequest):
    """One shared buffer per tensor (CUDA IPC for CUDA tensors, shared memory for CPU ones)."""

    TYPE: ClassVar[str] = "cuda_ipc"
    handles: list[IpcBufferHandle] = field(default_factory=list)
    # every_rank mode: the same tensors' handles from training ranks 1.. (one list per rank,
    # parallel to ``handles``); an engine worker reads the copy on its own GPU
    replicas: list[list[IpcBufferHandle]] = field(default_factory=list)
    # names a layout (names, dtypes, shapes, handles) the sender assigned; a request that
    # carries only the key (names empty) means "the same layout as the request that carried
    # this key in full before": the receivers that decoded it keep it (see CudaIpcTransferReceiver)
    layout_key: str = ""

    @property
    def is_reference(self) -> bool:
        """Only ``layout_key``: the receiver fills in the rest from its cache."""
        return bool(self.layout_key) and not self.names and not self.handles

    def _coerce(self) -> None:
        if self.is_reference:
            if self.dtypes or self.shapes or self.replicas:
                raise ValueError("cuda_ipc request: a layout reference carries no tensors")
            if self.checksums is not None:  # their number is checked against the layout
                if not isinstance(self.checksums, (list, tuple)) or not all(
                        is_int(c) and -(1 << 63) <= c < (1 << 63) for c in self.checksums):
                    raise ValueError("cuda_ipc request: checksums must be signed 64-bit ints")
                self.checksums = list(self.checksums)
            return
        super()._coerce()
        self.handles = parse_handles(self.handles)
        if len(self.handles) != len(self.names):
            raise ValueError(
                f"cuda_ipc request: {len(self.names)} names but {len(self.handles)} handles"
            )
        self.replicas = parse_replicas(self.replicas, self.handles, "cuda_ipc", "handles")


# --------------------------------------------------------------------------------------------
# sender, receiver, strategy
# --------------------------------------------------------------------------------------------


class _Encoded:
    """The IPC handles of one request whose tensors are all the trainer's own contiguous CUDA
    memory, kept by the sender for the next request: reused while that request's tensors are
    the very same objects with the same address, dtype and shape (a trainer updating its
    weights in place; a replaced or reallocated tensor encodes anew). Tensors are held by weak
    reference (the trainer owns them)."""

    def __init__(self, chunk: WeightChunk, handles: list[IpcBufferHandle]) -> None:
        self.ids = tuple(map(id, chunk.tensors))
        self.refs = [weakref.ref(t) for t in chunk.tensors]
        self.layout = _layout(chunk)
        self.handles = handles
        self.dtypes: list[str] = []
        self.shapes: list[list[int]] = []
        self.sig: tuple | None = None  # set by the request (its names, dtypes, shapes, handles)

    def holds(self, chunk: WeightChunk) -> bool:
        return self.holds_tensors(chunk.names, chunk.tensors)

    def holds_tensors(self, names: list[str], tensors: list[Any]) -> bool:
        return (tuple(map(id, tensors)) == self.ids
                and all(r() is t for r, t in zip(self.refs, tensors, strict=True))
                and _layout_of(names, tensors) == self.layout)


def _layout(chunk: WeightChunk) -> tuple:
    return _layout_of(chunk.names, chunk.tensors)


def _layout_of(names: list[str], tensors: list[Any]) -> tuple:
    """Names, then each tensor's address, dtype and shape."""
    return tuple(names), tuple((t.data_ptr(), t.dtype, t.shape) for t in tensors)


def bucket_bytes(cfg: Any) -> int:
    return int(float(cfg.bucket_size_mb) * (1 << 20))


async def call_engines(
    inference_client: InferenceEngineClient, request: WeightUpdateRequest, timeout_s: float
) -> None:
    """``update_named_weights`` with the chunk's timeout (the strategy's ``chunk_timeout_s``; a
    dead engine never hangs us). The client's own timeout is the same rule, so its error, which
    names the engine, normally comes first; this is the backstop."""
    try:
        await asyncio.wait_for(
            inference_client.update_named_weights(request.to_dict()), timeout_s + 5.0
        )
    except WeightSyncTimeout:
        raise  # the client's own, naming the engine
    except TimeoutError:
        raise WeightSyncTimeout(
            f"chunk {request.chunk_index}: the engines did not load it within {timeout_s:g}s "
            f"(an engine died or hangs?)"
        ) from None


class CudaIpcTransferSender(EveryRankSender, WeightTransferSender):
    """Makes one handle per tensor; CPU tensors are copied into pooled shm segments unless they
    already live in shared weights. ``shared_tensors`` / ``copied_tensors`` count both kinds."""

    overlap = True

    def __init__(self, cfg: IpcConfig) -> None:
        self.cfg = cfg
        self.shared_tensors = 0
        self.copied_tensors = 0
        # room for two chunks plus one tensor larger than the bucket (an embedding): steady-state
        # syncs then reuse every segment, so engines never re-map
        self.pool = SizedSegmentPool(max_free_bytes=2 * bucket_bytes(cfg), room_for_largest=True)
        self._held: dict[int, list[Any]] = {}  # id(request) -> segments / tensors kept alive
        self._lock = threading.Lock()
        # layouts every engine has decoded: signature -> layout key (see create_request)
        self._known: OrderedDict[tuple, str] = OrderedDict()
        self._new_layout: dict[int, tuple[tuple, str]] = {}  # id(request) -> (signature, key)
        self.references = 0  # requests sent as a layout reference (tests and benchmarks read it)
        self._encoded: _Encoded | None = None  # the last request's handles, while reusable
        self.reencoded_skipped = 0  # requests that reused them (tests and benchmarks read it)
        self._last: LastUpdate | None = None  # the last one-call update, while replayable
        self._sent: tuple[WeightChunk, dict, str] | None = None  # chunk, start, layout key
        self.replayed = 0  # updates sent by ``_replay`` (tests and benchmarks read it)

    async def send_chunks(self, chunks: Any, inference_client: Any, **kwargs: Any) -> SyncStats:
        """As every sender's; an update of the very chunks of the last one, sent the same way
        (one ``apply_update`` call, a request the engines decoded before), is replayed
        (``_replay``)."""
        held = held_chunks(chunks)
        last = self._last
        if last is not None and held is not None and last.fits(held, kwargs):
            stats = await self._replay(last, chunks, inference_client, kwargs)
            if stats is not None:
                return stats
        self._last = self._sent = None
        stats = await super().send_chunks(chunks, inference_client, **kwargs)
        self._last = self._replayable(held, kwargs, stats)
        return stats

    def _replayable(self, held: list | None, kwargs: dict, stats: SyncStats) -> LastUpdate | None:
        """What the next update of the same chunks may replay: an update of one call whose
        request's handles are the trainer's own CUDA memory (reused while it holds the same
        tensors) and whose layout every engine decoded; no checksums (they change with the
        values), no delta, no extras."""
        sent, self._sent = self._sent, None
        if (held is None or sent is None or stats.num_chunks != 1
                or getattr(self.cfg, "checksum", False)
                or kwargs.get("delta") is not None or kwargs.get("extras")
                or getattr(self, "rank_group", None) is not None):
            return None
        chunk, start, key = sent
        encoded = self._encoded
        with self._lock:
            known = key in self._known.values()
        if (not key or not known or encoded is None
                or encoded.ids != tuple(map(id, chunk.tensors))):
            return None
        reference = CudaIpcWeightUpdateRequest(names=[], dtypes=[], shapes=[], layout_key=key)
        return LastUpdate(held=list(held), options=update_options(kwargs),
                          manifest_ids=manifest_ids(kwargs.get("manifest")), start=start,
                          request=reference.to_dict(), chunk=chunk)

    async def _replay(self, last: LastUpdate, chunks: Any, client: Any,
                      kwargs: dict) -> SyncStats | None:
        """The last update again, without making it anew: the same chunks (a held stream's,
        whose check that the model still holds them is awaited first: it raises as the
        stream would; a list's, compared with what the handles were made for, else None: sent
        the usual way), the same request (a reference to the layout the engines decoded), the
        start and finish of this update; one ``apply_update`` call. The trainer's writes land
        before it (``torch.cuda.synchronize``)."""
        import torch

        trace.mark("ipc.replay.begin")
        if isinstance(chunks, (list, tuple)):  # the caller's: their tensors now, as encoded?
            names = [n for c in chunks for n in c.names]
            tensors = [t for c in chunks for t in c.tensors]
            if self._encoded is None or not self._encoded.holds_tensors(names, tensors):
                return None
        else:
            async for _ in chunks:  # a held stream: raises if the model changed
                pass
        stats = SyncStats(update_id=uuid.uuid4().hex)
        t0 = time.perf_counter()
        # the manifest by reference to the update that carried it (each engine keeps it)
        start, request, finish = last.messages(stats.update_id, kwargs.get("version"))
        torch.cuda.synchronize()
        timeout_s = self.cfg.chunk_timeout_s(last.chunk.total_size_bytes)
        trace.mark("ipc.replay.call")
        try:
            versions = await asyncio.wait_for(client.apply_update(start, [request], finish),
                                              timeout_s + 5.0)
        except BaseException as e:
            self._last = None
            if isinstance(e, ManifestUnknownError) and len(getattr(client, "names", ())) == 1:
                return None  # its one engine refused the start, nothing changed: send it anew
            with self._lock:  # whatever the engines hold now, send every layout in full again
                self._known.clear()
            if isinstance(e, TimeoutError) and not isinstance(e, WeightSyncTimeout):
                raise WeightSyncTimeout(
                    f"the engines did not load the update within {timeout_s:g}s (an engine "
                    f"died or hangs?)") from None
            raise
        self.replayed += 1
        self.references += 1
        self.reencoded_skipped += 1
        stats.num_chunks, stats.num_tensors = 1, len(last.chunk)
        stats.total_bytes = last.chunk.total_size_bytes
        stats.versions = list(versions)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _coalesce(self, chunks: Any, *, held: bool) -> Any:
        """Chunks whose handles point at the trainer's own memory (contiguous CUDA tensors, or
        tensors in shared weights) of ``borrowed`` chunks (or of a list the caller holds) are
        sent as one request: they take no transfer buffer, so the bucket bounds nothing and one
        request per update saves a control round trip per chunk. With ``every_rank`` the ranks
        send chunk by chunk, as they come."""
        if getattr(self, "rank_group", None) is not None:
            return chunks

        def zero_copy(chunk: WeightChunk) -> bool:
            if not (held or chunk.borrowed):
                return False
            if all(t.is_cuda and t.is_contiguous() for t in chunk.tensors):
                return True
            return all(loc is not None for loc in locate_many(chunk.tensors))

        return coalesce(chunks, zero_copy)

    def prepares_inline(self, chunk: WeightChunk) -> bool:
        """The very tensors of the last request (a trainer pushing the same parameters again):
        its handles are reused, so the request is made without encoding anything."""
        again = self._encoded
        return (again is not None and getattr(self, "rank_group", None) is None
                and again.ids == tuple(map(id, chunk.tensors)))

    def create_request(self, chunk: WeightChunk) -> CudaIpcWeightUpdateRequest:
        trace.mark("ipc.request.begin", tensors=len(chunk.names))
        again = self._encoded
        if again is not None and again.holds(chunk):
            # the very CUDA tensors of the last request, where they were: the same handles
            # (encoding them again is ~10 us a tensor); the trainer's writes must still land
            import torch

            torch.cuda.synchronize()
            held = list(chunk.tensors)
            req = self._request(chunk, again.handles, zero_copy=True, encoded=again)
            self.reencoded_skipped += 1
        else:
            req, held = self._encode(chunk)
        with self._lock:
            self._held[id(req)] = held
        trace.mark("ipc.request.end")
        return req

    def _encode(self, chunk: WeightChunk) -> tuple[CudaIpcWeightUpdateRequest, list[Any]]:
        from weightsync._runtime import cuda_handles

        handles: list[IpcBufferHandle | None] = []
        held: list[Any] = []
        locs = locate_many(chunk.tensors)
        on_gpu: list[int] = []  # positions of the CUDA tensors
        gpu: list[Any] = []
        shared = 0  # tensors read from shared weights
        copied = 0  # CUDA tensors .contiguous() copied
        try:
            for t, loc in zip(chunk.tensors, locs, strict=True):
                if t.is_cuda:
                    copied += not t.is_contiguous()
                    t = t.detach().contiguous()
                    held.append(t)
                    gpu.append(t)
                    on_gpu.append(len(handles))
                    handles.append(None)  # encoded below, all at once
                elif loc is not None:
                    held.append(t)  # the trainer's own memory: no copy
                    handles.append(
                        IpcBufferHandle(kind="shm", nbytes=loc.nbytes, name=loc.name, offset=loc.offset,
                                        alloc_nbytes=loc.segment_nbytes)
                    )
                    self.shared_tensors += 1
                    shared += 1
                else:
                    src = as_bytes(t)
                    self.copied_tensors += 1
                    seg = self.pool.acquire(src.numel())
                    held.append(seg)
                    if src.numel():
                        copy_into(seg.tensor[: src.numel()], src)
                    handles.append(
                        IpcBufferHandle(kind="shm", nbytes=src.numel(), name=seg.name,
                                        alloc_nbytes=seg.capacity)
                    )
            if gpu:
                for i, h in zip(on_gpu, cuda_handles.encode_many(gpu), strict=True):
                    handles[i] = h
        except BaseException:
            self._give_back(held)
            raise
        if gpu:
            import torch

            torch.cuda.synchronize()  # .contiguous() copies must land before the engine reads
        # every tensor the trainer's own CUDA memory, none copied by .contiguous(): the next
        # request for these very tensors reuses the handles
        reusable = len(gpu) == len(chunk) and not copied
        encoded = _Encoded(chunk, handles) if reusable else None  # type: ignore[arg-type]
        req = self._request(chunk, handles, zero_copy=len(gpu) + shared == len(chunk),  # type: ignore[arg-type]
                            encoded=encoded)
        self._encoded = encoded
        return req, held

    def _request(self, chunk: WeightChunk, handles: list[IpcBufferHandle],
                 zero_copy: bool, encoded: _Encoded | None = None) -> CudaIpcWeightUpdateRequest:
        """The chunk's request. A chunk of the trainer's own memory (CUDA tensors, shared
        weights) whose names, dtypes, shapes and handles equal those of a request every engine
        already decoded goes as a reference to that layout: a few bytes instead of a few
        hundred handles, and the engines reuse what they decoded (their views included). The
        signature holds the allocation handles, so memory the trainer re-allocated is a new
        layout."""
        if encoded is not None and encoded.sig is not None:
            dtypes, shapes, sig = encoded.dtypes, encoded.shapes, encoded.sig
        else:
            dtypes, shapes = chunk.dtype_names, chunk.shape_lists
            sig = None
        if not zero_copy or getattr(self, "rank_group", None) is not None:
            return CudaIpcWeightUpdateRequest(names=list(chunk.names), dtypes=list(dtypes),
                                              shapes=[list(s) for s in shapes], handles=handles)
        if sig is None:
            sig = (tuple(chunk.names), tuple(dtypes), tuple(map(tuple, shapes)),
                   tuple((h.kind, h.name, h.handle, h.offset, h.nbytes, h.device_uuid)
                         for h in handles))
            if encoded is not None:
                encoded.dtypes, encoded.shapes, encoded.sig = dtypes, shapes, sig
        with self._lock:
            key = self._known.get(sig)
            if key is not None:
                self._known.move_to_end(sig)
        if key is not None:
            self.references += 1
            return CudaIpcWeightUpdateRequest(names=[], dtypes=[], shapes=[], layout_key=key)
        key = uuid.uuid4().hex
        req = CudaIpcWeightUpdateRequest(names=list(chunk.names), dtypes=list(dtypes),
                                         shapes=[list(s) for s in shapes], handles=handles,
                                         layout_key=key)
        with self._lock:
            self._new_layout[id(req)] = (sig, key)
        return req

    async def _transfer(
        self,
        chunk: WeightChunk,
        request: WeightUpdateRequest,
        inference_client: InferenceEngineClient,
    ) -> None:
        await self.share_handles(request)
        start = getattr(inference_client, "start", None)  # a SingleCallClient's: one call
        if isinstance(start, dict):
            self._sent = (chunk, start, getattr(request, "layout_key", ""))
        try:
            await call_engines(inference_client, request,
                               self.cfg.chunk_timeout_s(chunk.total_size_bytes))
        except BaseException:
            with self._lock:  # whatever the engines hold now, send every layout in full again
                self._known.clear()
            raise
        with self._lock:
            new = self._new_layout.pop(id(request), None)
            if new is not None:  # every engine decoded it: later syncs may refer to it
                self._known[new[0]] = new[1]
                while len(self._known) > MAX_KNOWN_LAYOUTS:
                    self._known.popitem(last=False)

    def _release(self, request: WeightUpdateRequest) -> None:
        with self._lock:
            held = self._held.pop(id(request), [])
            self._new_layout.pop(id(request), None)
        self._give_back(held)

    def _give_back(self, held: list[Any]) -> None:
        for h in held:
            if isinstance(h, Segment):
                self.pool.release(h)

    async def close(self) -> None:
        with self._lock:
            pending = list(self._held.values())
            self._held.clear()
        for held in pending:
            self._give_back(held)
        self.pool.close()
        self.close_rank_group()


class CudaIpcTransferReceiver(WeightTransferReceiver):
    """Opens handles (cached) and hands dtype/shape views to the loader; no copy."""

    request_cls = CudaIpcWeightUpdateRequest

    def __init__(self, cfg: IpcConfig, rank_offset: int = 1) -> None:
        self.cfg = cfg
        self.rank_offset = rank_offset
        self.last_replica = 0  # which rank's copy the last chunk was read from (every_rank)
        self.buffers = IpcBufferOpener(AttachedSegments(max_bytes=4 * bucket_bytes(cfg)))
        # layouts decoded from requests that carried a layout key, most recent last
        self.layouts = KeptLayouts(MAX_KNOWN_LAYOUTS * 2)

    def parse_request(self, request_dict: dict) -> WeightUpdateRequest:
        """As the base class; a layout reference is filled in from the layout the same key
        carried in full before (a key this receiver does not hold is an error that says so)."""
        req = super().parse_request(request_dict)
        key = getattr(req, "layout_key", "")
        if not key:
            return req
        if req.is_reference:
            layout = self.layouts.find(key)
            if layout is None:
                raise WeightSyncError(
                    f"cuda_ipc: the request refers to layout {key[:8]}, which this engine "
                    f"does not hold (its receiver was re-initialised by another sender?); "
                    f"connect again (a new sender sends every layout in full)"
                )
            full = layout.request
            req.names, req.dtypes, req.shapes = full.names, full.dtypes, full.shapes
            req.handles, req.replicas = full.handles, full.replicas
            if req.checksums is not None and len(req.checksums) != len(req.names):
                raise WeightSyncError(
                    f"cuda_ipc: {len(req.checksums)} checksums for layout {key[:8]} of "
                    f"{len(req.names)} tensors"
                )
        else:
            self.layouts.keep(key, _Layout(req))
        return req

    def _known_valid(self, request: WeightUpdateRequest, loader: WeightLoader) -> bool:
        layout = self.layouts.get(getattr(request, "layout_key", "") or "")
        return layout is not None and layout.valid_for is engine_loader(loader)

    async def _receive_and_load(
        self, request: WeightUpdateRequest, loader: WeightLoader
    ) -> None:
        if request.chunk_index == 0:
            self.buffers.begin_sync()
        handles, self.last_replica = pick_replica(request.handles, request.replicas,
                                                  self.rank_offset)
        layout = self.layouts.get(getattr(request, "layout_key", "") or "")
        if (layout is not None and layout.views is not None
                and layout.epoch == self.buffers.epoch and layout.replica == self.last_replica):
            tensors = layout.views  # same memory, same views: nothing to open or rebuild
        else:
            tensors = self._views(request, handles)
            if layout is not None:
                layout.views, layout.epoch = tensors, self.buffers.epoch
                layout.replica = self.last_replica
        if layout is not None:  # the template validated it before calling us
            layout.valid_for = engine_loader(loader)
        if request.replicas:
            await loader.load_weights(tensors)
        else:  # the sender holds every buffer of the request until the engines answered
            await loader.load_borrowed(tensors)

    def _views(self, request: WeightUpdateRequest, handles: list[IpcBufferHandle]) -> dict:
        raws = []
        for m, h in zip(request.metas(), handles, strict=True):
            if h.nbytes != m.nbytes:
                raise WeightSyncError(
                    f"{m.name}: handle has {h.nbytes} bytes but {m.dtype}{m.shape} needs {m.nbytes}"
                )
            raws.append(self.buffers.open(h))
        n = len(raws)
        try:
            return views_into(raws, request.names, request.dtypes, request.shapes, range(n),
                              [0] * n)
        except ValueError as e:
            raise WeightSyncError(f"cuda_ipc request: {e}") from None


    def close(self) -> None:
        self.buffers.close()


#: layouts a sender refers to (the receivers keep twice as many)
MAX_KNOWN_LAYOUTS = 8


class _Layout:
    """A decoded request of one layout key (receiver side): its metadata and handles, the
    loader that accepted its metadata, and the tensor views over its buffers with the opener
    epoch and replica they were made under."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.valid_for: Any = None
        self.views: dict | None = None
        self.epoch = -1
        self.replica = 0


class CudaIpcTransferStrategy(WeightTransferStrategy):
    name = "cuda_ipc"
    config_cls = IpcConfig
    sender_cls: ClassVar[type[WeightTransferSender]] = CudaIpcTransferSender
    receiver_cls: ClassVar[type[WeightTransferReceiver]] = CudaIpcTransferReceiver

    @classmethod
    def get_request_type(cls) -> type[WeightUpdateRequest]:
        return CudaIpcWeightUpdateRequest

    async def create_sync_info(
        self, cfg: Any, inference_client: InferenceEngineClient
    ) -> WeightSyncInfo:
        return EmptyWeightSyncInfo()

    async def create_sender(
        self, cfg: Any, inference_client: InferenceEngineClient | None, sync_info: WeightSyncInfo
    ) -> WeightTransferSender:
        """The sending process's sender. With ``every_rank`` every training rank calls this
        (rank 0 with the engines' client, the others with None) and gets a sender that sends
        in lockstep with the others (``strategies/_every_rank.py``)."""
        cfg = self.own_config(cfg)
        group = None
        if getattr(cfg, "every_rank", False):
            from weightsync._runtime.threads import in_thread

            # the other ranks wait for rank 0's engine calls: a chunk's (or a start's) timeout
            group = await in_thread(RankGroup, float(cfg.join_timeout_s)
                                    + 2 * cfg.chunk_timeout_s(bucket_bytes(cfg)))
            inference_client = EveryRankClient(
                inference_client if group.rank == 0 else None, group)
        elif inference_client is None:
            raise ValueError(f"{self.name}: create_sender needs the engines' client (None is "
                             f"only for ranks other than 0 with every_rank: true)")
        try:
            await self._init_engines(cfg, inference_client, sync_info)
        except BaseException:
            if group is not None:
                group.close()
            raise
        sender = self.sender_cls(cfg)
        sender.rank_group = group
        return sender

    async def _init_engines(
        self, cfg: Any, inference_client: InferenceEngineClient, sync_info: WeightSyncInfo
    ) -> None:
        """Have every engine build its receiver (nothing to join on our side)."""
        try:
            await asyncio.wait_for(
                inference_client.init_weight_transfer(self.config_dict(), _info_dict(sync_info)),
                cfg.join_timeout_s + 10.0,  # the client's own timeout names the silent engine
            )
        except WeightSyncTimeout:
            raise
        except TimeoutError:
            raise WeightSyncTimeout(
                f"the engines did not set up their {self.name} receivers within "
                f"{cfg.join_timeout_s:g}s"
            ) from None

    async def create_receiver(
        self, cfg: Any, sync_info: WeightSyncInfo, rank_offset: int
    ) -> WeightTransferReceiver:
        return self.receiver_cls(self.own_config(cfg), rank_offset=rank_offset)


def _info_dict(sync_info: Any) -> dict:
    return sync_info.to_dict() if hasattr(sync_info, "to_dict") else dict(sync_info)
