"""IPC from every training rank: the hybrid-engine layout of the IPC strategies.

In a hybrid (colocated) RL setup a sharded trainer (FSDP2 over N ranks) and a tensor-parallel
vLLM engine (TP = N) share the same N GPUs: engine worker ``i`` sits on the GPU of training
rank ``i``. Each rank gathers the full weights anyway (``full_tensor()``), so each engine worker
can read its rank's copy through CUDA IPC on its own GPU instead of pulling every byte across
GPUs from rank 0. With ``every_rank: true`` in the IPC strategies' config:

* every training rank builds a sender (``strategy.create_sender(cfg, client, info)`` on rank 0,
  ``create_sender(cfg, None, info)`` elsewhere) and calls ``send_chunks`` with the same chunks in
  lockstep (the ``fsdp`` extractor with ``is_sender: true`` on every rank yields them);
* per chunk, each rank makes handles to its own copy; ``RankGroup.gather`` collects them on
  rank 0, which sends one request whose ``replicas`` hold the other ranks' handles, and tells
  the other ranks how the engines answered (``EveryRankClient``): every rank leaves every call
  together, with the same outcome, and releases its copy only after the engines loaded it;
* an engine worker reads the copy on its own GPU (``pick_replica``: by device UUID; for
  shared-memory handles, which have no device, worker ``rank_offset - 1`` of the engine reads
  training rank ``rank_offset - 1``'s copy, the same pairing as GPUs); one chunk at a time.

The ranks talk over a gloo group made from the trainer's default ``torch.distributed`` group
(``torch.distributed`` must be initialised on every rank) with the strategy's timeout, so a rank
that died turns into ``WeightSyncTimeout`` on the others instead of a hang.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from weightsync._runtime.threads import in_thread
from weightsync.errors import WeightSyncError, WeightSyncTimeout, error_from_dict, error_to_dict
from weightsync.interfaces import InferenceEngineClient

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.types import IpcBufferHandle


class RankGroup:
    """A gloo group over the trainer's default process group, for small objects."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise WeightSyncError(
                "every_rank IPC needs torch.distributed initialised on every training rank "
                "(init_process_group before create_sender), or set every_rank: false"
            )
        self.timeout_s = timeout_s
        self.group = dist.new_group(backend="gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:  # gloo raises RuntimeError on timeouts and dead peers
            raise WeightSyncTimeout(
                f"every_rank IPC: {what} between the training ranks failed within "
                f"{self.timeout_s:g}s (a rank died or stopped iterating?): {e}"
            ) from e

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (in rank order), on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        self._call("gathering handles", dist.all_gather_object, out, obj, self.group)
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        src = dist.get_global_rank(self.group, 0) if hasattr(dist, "get_global_rank") else 0
        self._call("sharing rank 0's outcome", dist.broadcast_object_list, box, src, self.group)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        try:
            dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


class EveryRankClient(InferenceEngineClient):
    """The client every rank's sender talks to: rank 0 forwards each call to the engines'
    client and broadcasts the outcome; the other ranks (``inner`` None) wait for it. Every rank
    then returns the same result or raises the same error. One chunk at a time."""

    max_inflight_updates = 1

    def __init__(self, inner: InferenceEngineClient | None, group: RankGroup) -> None:
        if group.rank == 0 and inner is None:
            raise WeightSyncError("every_rank IPC: rank 0 needs the engines' client")
        self.inner = inner
        self.group = group

    async def _agree(self, method: str, *args: Any) -> Any:
        outcome: dict[str, Any] | None = None
        if self.group.rank == 0:
            assert self.inner is not None
            try:
                outcome = {"ok": True, "result": await getattr(self.inner, method)(*args)}
            except Exception as e:  # shared with the other ranks, then raised here too
                outcome = {"ok": False, "error": error_to_dict(e), "exc": e}
        shared = await in_thread(self.group.from_rank0,
                                 None if outcome is None else {k: v for k, v in outcome.items()
                                                               if k != "exc"})
        if outcome is not None and not outcome["ok"]:
            raise outcome["exc"]
        if not shared["ok"]:
            raise error_from_dict(shared["error"], engine="rank 0's engines", method=method)
        return shared["result"]

    async def get_world_sizes(self) -> list[int]:
        return await self._agree("get_world_sizes")

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        await self._agree("init_weight_transfer", strategy_cfg, sync_info)

    async def start_weight_update(self, start: dict) -> None:
        await self._agree("start_weight_update", start)

    async def update_named_weights(self, request: dict) -> None:
        await self._agree("update_named_weights", request)

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        return await self._agree("finish_weight_update", finish)

    async def close_weight_transfer(self) -> None:
        await self._agree("close_weight_transfer")


class EveryRankSender:
    """Mixin for the IPC senders (before ``WeightTransferSender`` in the bases): with a
    ``rank_group`` (every_rank mode) ``send_chunks`` runs in lockstep on every rank through an
    ``EveryRankClient``, and ``share_handles`` gathers each chunk's handles on rank 0."""

    rank_group: RankGroup | None = None
    handle_field: str = "handles"  # the request field that lists this rank's buffers

    async def send_chunks(self, chunks: Any, inference_client: Any, **kwargs: Any) -> Any:
        group = self.rank_group
        if group is not None:
            inference_client = EveryRankClient(inference_client if group.rank == 0 else None,
                                               group)
        return await super().send_chunks(chunks, inference_client, **kwargs)  # type: ignore[misc]

    async def share_handles(self, request: Any) -> None:
        """Every rank: contribute this chunk's handles; rank 0 puts the other ranks' into
        ``request.replicas``."""
        group = self.rank_group
        if group is None:
            return
        from weightsync.types import IpcBufferHandle

        mine = [h.to_dict() for h in getattr(request, self.handle_field)]
        every = await in_thread(group.gather, mine)
        if group.rank == 0:
            request.replicas = [[IpcBufferHandle.from_dict(h) for h in hs] for hs in every[1:]]

    def close_rank_group(self) -> None:
        if self.rank_group is not None:
            self.rank_group.close()
            self.rank_group = None


def pick_replica(
    primary: list[IpcBufferHandle], replicas: list[list[IpcBufferHandle]], rank_offset: int
) -> tuple[list[IpcBufferHandle], int]:
    """``(handles, index)``: the copy an engine worker should read (index 0 = rank 0's).

    CUDA handles: the copy on this worker's GPU (by UUID), else rank 0's (read over peer
    access). Shared-memory handles: training rank ``rank_offset - 1``'s copy (modulo the number
    of copies), the pairing of a hybrid layout's worker and rank."""
    options = [primary, *replicas]
    if len(options) == 1:
        return primary, 0
    cuda = next((h for h in primary if h.kind == "cuda"), None)
    if cuda is not None:
        import torch

        from weightsync._runtime.cuda_handles import device_uuid

        mine = device_uuid(torch.cuda.current_device())
        for i, opt in enumerate(options):
            first = next((h for h in opt if h.kind == "cuda"), None)
            if first is not None and first.device_uuid == mine:
                return opt, i
        return primary, 0
    i = (max(rank_offset, 1) - 1) % len(options)
    return options[i], i
