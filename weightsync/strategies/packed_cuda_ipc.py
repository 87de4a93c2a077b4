"""``packed_cuda_ipc``: one contiguous shared buffer per chunk, one handle per dtype group.

The sender packs each chunk into one of ``num_buffers`` (default 2) reusable buffers (a POSIX
shm segment for CPU tensors, a CUDA allocation for CUDA tensors), laid out by
``_layout.plan_layout`` (per dtype group, aligned offsets). The request carries one
``IpcBufferHandle`` per dtype group (the slot's segment / allocation, with the group's byte
offset and size), plus each tensor's group index and offset. Engines map each slot once
(cached) and hand the loader dtype/shape views: no copy besides the loader's own.

Shared weights (``shared_weights.share_cpu_weights`` was called on the model): a CPU chunk's
tensors that already live in a shared-weights segment are not packed; the request gets one
buffer per such segment (the byte range the chunk's tensors span in it) and their offsets in it,
so the engine reads the trainer's memory directly. Tensors that do not (a cast, a replaced
``.data``) are packed into a slot as usual, in the same request.

Memory is bounded by ``num_buffers`` x the largest chunk (about the bucket size), and the pages
of a slot are touched once, not per sync. Slot ``k`` is handed out again only after the chunk
that used it finished its transfer (``_release``), so with overlap on (default) the sender packs
chunk i+1 into one slot while the engines read chunk i from the other.

``cfg.device``: ``"auto"`` puts the buffer where the chunk's tensors are (CUDA if any tensor is
on a GPU), ``"cpu"`` always uses shared memory, ``"cuda"`` always a GPU buffer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from weightsync._runtime.pool import BufferPool
from weightsync._runtime.shm import AttachedSegments
from weightsync.config import StrategyConfig
from weightsync.errors import WeightSyncError
from weightsync.interfaces import (
    InferenceEngineClient,
    WeightLoader,
    WeightTransferReceiver,
    WeightTransferSender,
)
from weightsync.strategies._every_rank import EveryRankSender, pick_replica
from weightsync.strategies._ipc_open import IpcBufferOpener
from weightsync.strategies._layout import DEFAULT_ALIGN, pack_into, plan_layout, views_into
from weightsync.strategies.cuda_ipc import CudaIpcTransferStrategy, bucket_bytes, call_engines
from weightsync.strategies.shared_weights import locate_many
from weightsync.types import (
    IpcBufferHandle,
    TensorMeta,
    WeightChunk,
    WeightUpdateRequest,
    parse_handles,
    parse_replicas,
)

# --------------------------------------------------------------------------------------------
# the strategy's config and wire type
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PackedIpcConfig(StrategyConfig):
    type: str = "packed_cuda_ipc"
    num_buffers: int = 2  # double buffering: pack chunk i+1 while the engine reads chunk i
    every_rank: bool = False  # as for cuda_ipc


@dataclass(kw_only=True)
class PackedCudaIpcWeightUpdateRequest(WeightUpdateRequest):
    """One contiguous buffer per dtype group; tensor ``i`` lives in ``buffers[buffer_index[i]]``
    at byte ``offsets[i]`` and is rebuilt there as a view (no extra copy)."""

    TYPE: ClassVar[str] = "packed_cuda_ipc"
    buffers: list[IpcBufferHandle] = field(default_factory=list)
    buffer_index: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # every_rank mode: the same chunk's buffers packed by training ranks 1.. (one list per rank,
    # parallel to ``buffers``, same layout); an engine worker reads the copy on its own GPU
    replicas: list[list[IpcBufferHandle]] = field(default_factory=list)

    def _coerce(self) -> None:
        super()._coerce()
        self.buffers = parse_handles(self.buffers)
        self.replicas = parse_replicas(self.replicas, self.buffers, "packed_cuda_ipc", "buffers")
        n = len(self.names)
        if len(self.buffer_index) != n or len(self.offsets) != n:
            raise ValueError(
                f"packed_cuda_ipc request: {n} names but {len(self.buffer_index)} buffer "
                f"indices and {len(self.offsets)} offsets"
            )
        for name, bi, off, m in zip(
            self.names, self.buffer_index, self.offsets, self.metas(), strict=True
        ):
            if not (0 <= bi < len(self.buffers)):
                raise ValueError(f"parameter {name!r}: buffer index {bi} out of range")
            if off < 0 or off + m.nbytes > self.buffers[bi].nbytes:
                raise ValueError(
                    f"parameter {name!r}: bytes [{off}, {off + m.nbytes}) fall outside buffer "
                    f"{bi} of {self.buffers[bi].nbytes} bytes"
                )


# --------------------------------------------------------------------------------------------
# sender / receiver
# --------------------------------------------------------------------------------------------


class PackedCudaIpcTransferSender(EveryRankSender, WeightTransferSender):
    handle_field = "buffers"
    overlap = True

    def __init__(self, cfg: PackedIpcConfig) -> None:
        self.cfg = cfg
        self.align_bytes = DEFAULT_ALIGN
        # a slot comes back when the chunk that holds it is transferred (or gives up)
        self.pool = BufferPool(
            int(cfg.num_buffers), shared=True,
            timeout_s=cfg.chunk_timeout_s(int(cfg.bucket_size_mb * (1 << 20))) + 10.0)
        self.shared_tensors = 0  # tensors sent from shared weights (no copy)
        self.packed_tensors = 0  # tensors copied into a pool slot
        self._slot_of: dict[int, int] = {}
        self._lock = threading.Lock()

    def create_request(self, chunk: WeightChunk) -> PackedCudaIpcWeightUpdateRequest:
        import torch

        dtypes, shapes = chunk.dtype_names, chunk.shape_lists  # computed once (per-tensor cost matters)
        metas = [TensorMeta(*m) for m in zip(chunk.names, dtypes, shapes, strict=True)]
        n = len(metas)
        device = self._device_for(chunk)
        locs = locate_many(chunk.tensors) if device.type == "cpu" else [None] * n
        rest = [i for i, loc in enumerate(locs) if loc is None]
        buffers: list[IpcBufferHandle] = []
        buffer_index = [0] * n
        offsets = [0] * n
        k = None
        if rest:
            layout = plan_layout([metas[i] for i in rest], self.align_bytes)
            k, slot = self.pool.acquire(layout.total_nbytes, device)
            try:
                whole = slot.tensor[: layout.total_nbytes]
                pack_into(layout, [chunk.tensors[i] for i in rest], layout.split(whole))
                if whole.is_cuda:
                    torch.cuda.current_stream(whole.device).synchronize()
            except BaseException:
                self.pool.release(k)
                raise
            buffers = [slot.describe(g.start, g.nbytes) for g in layout.groups]
            for j, i in enumerate(rest):
                buffer_index[i] = layout.group_of[j]
                offsets[i] = layout.offsets[j]
            self.packed_tensors += len(rest)
        if len(rest) < n:
            self._describe_shared(metas, locs, buffers, buffer_index, offsets)
            self.shared_tensors += n - len(rest)
        req = PackedCudaIpcWeightUpdateRequest(
            names=list(chunk.names), dtypes=dtypes, shapes=shapes,
            buffers=buffers, buffer_index=buffer_index, offsets=offsets,
        )
        if k is not None:
            with self._lock:
                self._slot_of[id(req)] = k
        return req

    @staticmethod
    def _describe_shared(metas, locs, buffers, buffer_index, offsets) -> None:
        """One buffer per shared-weights segment the chunk touches (the byte range from its
        first to its last tensor there); tensors point into it. Nothing is copied."""
        regions: dict[str, list[int]] = {}  # name -> [lo, hi, segment size]
        for loc in locs:
            if loc is None:
                continue
            r = regions.get(loc.name)
            if r is None:
                regions[loc.name] = [loc.offset, loc.offset + loc.nbytes, loc.segment_nbytes]
                continue
            if loc.offset < r[0]:
                r[0] = loc.offset
            if loc.offset + loc.nbytes > r[1]:
                r[1] = loc.offset + loc.nbytes
        index = {}
        for name, (lo, hi, size) in regions.items():
            index[name] = len(buffers)
            buffers.append(
                IpcBufferHandle(kind="shm", nbytes=hi - lo, name=name, offset=lo,
                                alloc_nbytes=size)
            )
        for i, loc in enumerate(locs):
            if loc is not None:
                buffer_index[i] = index[loc.name]
                offsets[i] = loc.offset - regions[loc.name][0]

    def _device_for(self, chunk: WeightChunk) -> Any:
        import torch

        mode = str(getattr(self.cfg, "device", "auto"))
        if mode == "cpu":
            return torch.device("cpu")
        cuda = next((t.device for t in chunk.tensors if t.is_cuda), None)
        if mode == "cuda":
            return cuda or torch.device("cuda", torch.cuda.current_device())
        return cuda or torch.device("cpu")

    async def _transfer(
        self,
        chunk: WeightChunk,
        request: WeightUpdateRequest,
        inference_client: InferenceEngineClient,
    ) -> None:
        await self.share_handles(request)
        await call_engines(inference_client, request,
                           self.cfg.chunk_timeout_s(request.total_size_bytes))

    def _release(self, request: WeightUpdateRequest) -> None:
        with self._lock:
            k = self._slot_of.pop(id(request), None)
        if k is not None:
            self.pool.release(k)

    async def close(self) -> None:
        self.pool.close()
        self.close_rank_group()


class PackedCudaIpcTransferReceiver(WeightTransferReceiver):
    request_cls = PackedCudaIpcWeightUpdateRequest

    def __init__(self, cfg: PackedIpcConfig, rank_offset: int = 1) -> None:
        self.cfg = cfg
        self.rank_offset = rank_offset
        self.last_replica = 0  # which rank's copy the last chunk was read from (every_rank)
        n = max(int(getattr(cfg, "num_buffers", 2)), 1)
        # room for every slot of the sender's pool plus one regrown slot, sized from the largest
        # slot seen (a chunk of one big tensor can pass the bucket); shared weights apart
        self.buffers = IpcBufferOpener(
            AttachedSegments(max_bytes=(n + 1) * max(bucket_bytes(cfg), 1 << 20), min_slots=n + 1),
            max_cuda_handles=4 * n,
        )

    async def _receive_and_load(
        self, request: WeightUpdateRequest, loader: WeightLoader
    ) -> None:
        if request.chunk_index == 0:
            self.buffers.begin_sync()
        buffers, self.last_replica = pick_replica(request.buffers, request.replicas,
                                                  self.rank_offset)
        raws = [self.buffers.open(h) for h in buffers]
        try:
            tensors = views_into(raws, request.names, request.dtypes, request.shapes,
                                 request.buffer_index, request.offsets)
        except ValueError as e:
            raise WeightSyncError(f"packed_cuda_ipc request: {e}") from None
        await loader.load_weights(tensors)


    def close(self) -> None:
        self.buffers.close()


class PackedCudaIpcTransferStrategy(CudaIpcTransferStrategy):
    name = "packed_cuda_ipc"
    config_cls = PackedIpcConfig
    sender_cls = PackedCudaIpcTransferSender
    receiver_cls = PackedCudaIpcTransferReceiver

    @classmethod
    def get_request_type(cls) -> type[WeightUpdateRequest]:
        return PackedCudaIpcWeightUpdateRequest
