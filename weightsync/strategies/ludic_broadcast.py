"""``ludic_broadcast``: the engine side of the Ludic / TRL weight-sync data plane.

A trainer written against Ludic's vLLM server (and TRL's ``VLLMClient``, which it derives from)
does not speak our ``broadcast`` strategy; it does this:

1. ``GET /get_world_size`` -> ``W`` (the server's workers); it joins a process group of
   ``W + 1`` ranks as the **last** rank ``W``; worker ``i`` of the engine is rank ``i``, and
   rank 0 (worker 0) hosts the rendezvous store at the ``host:port`` the trainer names in
   ``POST /init_communicator {host, port, world_size}``;
2. per update, ``POST /update_param_batch {metadata: [{name, dtype, shape}], version}``, then
   one broadcast per tensor **from rank W**, in the metadata's order, then a barrier;
3. it polls ``POST /get_num_background_tasks`` until 0.

Group flavours (``backend``): ``nccl`` is vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``
(the Ludic/TRL GPU client; barrier = ``StatelessProcessGroup.barrier``); ``gloo`` (CPU) is
``vllm.distributed.utils.stateless_init_torch_distributed_process_group(host, port, rank,
world_size, backend="gloo")`` with ``pg.broadcast(tensor, root=W)`` per tensor and
``pg.barrier()`` at the end.

There is no go/no-go vote in this protocol, so nothing can be refused once the trainer
broadcasts: the whole manifest is validated at ``start`` (the server answers the HTTP call only
after that; a refusal is a 4xx and the trainer never enters its broadcast). A chunk the engine
will not load anyway (``refuse``) is still received and dropped, so the trainer's broadcast and
barrier complete instead of hanging. Received tensors go to the loader in batches of about
``bucket_size_mb`` (the loader keeps a fused layer's parts until the layer is whole).

Only the receiver exists here: the sending side is the trainer's own code (see
``docs/policy_server.md``); weightsync's own senders use ``broadcast``.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from weightsync._runtime.threads import in_thread
from weightsync.config import StrategyConfig
from weightsync.errors import WeightSyncError, WeightSyncTimeout
from weightsync.interfaces import (
    InferenceEngineClient,
    WeightLoader,
    WeightTransferReceiver,
    WeightTransferStrategy,
)
from weightsync.types import TensorMeta, WeightSyncInfo, WeightUpdateRequest, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LudicBroadcastConfig(StrategyConfig):
    """``backend``: ``gloo`` (CPU) or ``nccl`` (GPU, vLLM's PyNccl). ``bucket_size_mb``: bytes
    received before they are handed to the loader. ``timeout_s``: joining the group and each
    collective (gloo; NCCL collectives of vLLM's PyNccl have no timeout)."""

    type: str = "ludic_broadcast"
    backend: str = "gloo"
    bucket_size_mb: float = 256
    timeout_s: float = 120.0
    max_inflight_chunks: int = 1


@dataclass(kw_only=True)
class StatelessGroupSyncInfo(WeightSyncInfo):
    """Where the trainer's group meets: rank 0 (engine worker 0) hosts the store at
    ``host:port``; ``world_size`` = engine workers + 1 (the trainer, last rank)."""

    TYPE: ClassVar[str] = "stateless_group"
    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 120.0

    def _coerce(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (engine workers + the trainer), got "
                             f"{self.world_size}")


@dataclass(kw_only=True)
class LudicWeightUpdateRequest(WeightUpdateRequest):
    """One tensor broadcast per name, in order, from ``src_rank`` (the trainer), then a
    barrier."""

    TYPE: ClassVar[str] = "ludic_broadcast"
    src_rank: int = -1


class LudicBroadcastStrategy(WeightTransferStrategy):
    name = "ludic_broadcast"
    config_cls = LudicBroadcastConfig

    def __init__(self, cfg: LudicBroadcastConfig | None = None) -> None:
        super().__init__(cfg)
        if self.cfg.backend not in ("gloo", "nccl"):
            raise ValueError(f"ludic_broadcast backend must be 'gloo' or 'nccl', got "
                             f"{self.cfg.backend!r}")

    @classmethod
    def get_request_type(cls) -> type[WeightUpdateRequest]:
        return LudicWeightUpdateRequest

    async def create_sync_info(self, cfg: Any, inference_client: InferenceEngineClient) -> Any:
        raise WeightSyncError(_NO_SENDER)

    async def create_sender(self, cfg: Any, inference_client: InferenceEngineClient,
                            sync_info: WeightSyncInfo) -> Any:
        raise WeightSyncError(_NO_SENDER)

    async def create_receiver(
        self, cfg: LudicBroadcastConfig | None, sync_info: WeightSyncInfo, rank_offset: int
    ) -> LudicBroadcastReceiver:
        """Engine worker side: join as rank ``rank_offset`` (worker ``i`` -> rank ``i``). Blocks
        until the trainer joins (or ``timeout_s``)."""
        cfg = self.own_config(cfg)
        if not isinstance(sync_info, StatelessGroupSyncInfo):
            raise ValueError(f"ludic_broadcast needs a stateless_group sync info, got "
                             f"{type(sync_info).__name__}")
        if not 0 <= rank_offset < sync_info.world_size - 1:
            raise ValueError(f"engine rank {rank_offset} outside the {sync_info.world_size - 1} "
                             f"engine ranks of the group (the trainer is the last rank)")
        address = (sync_info.host, int(sync_info.port))
        with _JOINS_LOCK:
            if address in _JOINS:
                raise WeightSyncError(
                    f"{sync_info.host}:{sync_info.port} is still held by an earlier join of this "
                    f"engine that was abandoned (it gives the port back at its timeout, "
                    f"{max(_JOINS[address] - time.monotonic(), 0):.0f}s from now); use another "
                    f"port")
            _JOINS[address] = time.monotonic() + sync_info.timeout_s
        group = await in_thread(_join, sync_info, rank_offset)
        return LudicBroadcastReceiver(cfg, group)


def ludic_group(host: str, port: int, world_size: int, *, backend: str, timeout_s: float,
                bucket_size_mb: float = 256) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(strategy_cfg, sync_info)`` for an engine's workers to join a trainer's group at
    ``host:port`` (the trainer's ``/init_communicator {host, port, world_size}``): what every
    worker's ``init_weight_transfer`` takes. Callers: the servers' Ludic dialect and the
    worker extension's ``init_communicator``."""
    strategy = {"type": "ludic_broadcast", "backend": backend, "timeout_s": timeout_s,
                "bucket_size_mb": bucket_size_mb}
    sync_info = {"type": "stateless_group", "host": host, "port": port,
                 "world_size": world_size, "backend": backend, "timeout_s": timeout_s}
    return strategy, sync_info


def ludic_update(metas: list[TensorMeta], version: int | None, src_rank: int,
                 update_id: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(start, request, finish)`` dicts for one trainer batch (the trainer's
    ``/update_param_batch {metadata, version}``): the whole manifest, one request that receives
    every tensor from ``src_rank`` (the trainer, the group's last rank), and the finish."""
    from weightsync.types import WeightUpdateFinish, WeightUpdateStart

    start = WeightUpdateStart(update_id=update_id, version=version, manifest=metas)
    request = LudicWeightUpdateRequest(
        names=[m.name for m in metas], dtypes=[m.dtype for m in metas],
        shapes=[list(m.shape) for m in metas], update_id=update_id, chunk_index=0,
        is_last=True, version=version, src_rank=src_rank)
    finish = WeightUpdateFinish(update_id=update_id, version=version, num_chunks=1, ok=True)
    return start.to_dict(), request.to_dict(), finish.to_dict()


_NO_SENDER = (
    "ludic_broadcast has no weightsync sender: it is the engine side of the Ludic/TRL trainer "
    "protocol (the trainer broadcasts with its own group). Push from weightsync with the "
    "'broadcast' strategy"
)


# --------------------------------------------------------------------------------------------
# the two group flavours
# --------------------------------------------------------------------------------------------


class _GlooGroup:
    """vLLM's stateless torch process group, gloo backend (CPU trainers)."""

    def __init__(self, info: StatelessGroupSyncInfo, rank: int) -> None:
        from weightsync._runtime.vllm_compat import stateless_gloo_group

        self.rank, self.world_size = rank, info.world_size
        self.timeout = datetime.timedelta(seconds=info.timeout_s)
        self.device: Any = "cpu"
        self.pg = stateless_gloo_group(info.host, info.port, rank, info.world_size, info.timeout_s)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._wait(self.pg.broadcast(tensor, root=src, timeout=self.timeout), "broadcast")

    def barrier(self) -> None:
        self._wait(self.pg.barrier(timeout=self.timeout), "barrier")

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            cls = WeightSyncTimeout if "imeout" in text or "imed out" in text else WeightSyncError
            raise cls(f"gloo {what} on rank {self.rank}/{self.world_size} of the trainer's group "
                      f"failed within {self.timeout.total_seconds():g}s: {text} (did the "
                      f"trainer die or stop broadcasting?)") from e

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort
                pass


class _PyNcclGroup:
    """vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (the Ludic/TRL GPU client)."""

    def __init__(self, info: StatelessGroupSyncInfo, rank: int) -> None:
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.rank, self.world_size = rank, info.world_size
        self.timeout_s = info.timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device())
        spg = StatelessProcessGroup.create(host=info.host, port=info.port, rank=rank,
                                           world_size=info.world_size,
                                           store_timeout=int(info.timeout_s))
        self.comm = PyNcclCommunicator(spg, device=self.device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        import torch

        self.comm.broadcast(tensor, src=src)
        torch.cuda.current_stream(self.device).synchronize()

    def barrier(self) -> None:
        self.comm.group.barrier()

    def close(self) -> None:
        self.comm = None


#: the group addresses a join of this process is still waiting on (-> when it gives up). The
#: join runs on a helper thread that cannot be interrupted: a join the server abandoned (its
#: trainer never came) keeps its rendezvous until its timeout, and a new join on the same address
#: would meet the old one's store, not its own, so it is refused with that reason instead
_JOINS: dict[tuple[str, int], float] = {}
_JOINS_LOCK = threading.Lock()


def _join(info: StatelessGroupSyncInfo, rank: int) -> Any:
    try:
        return _GlooGroup(info, rank) if info.backend == "gloo" else _PyNcclGroup(info, rank)
    except WeightSyncError:
        raise
    except Exception as e:
        raise WeightSyncTimeout(
            f"engine rank {rank} could not join the trainer's {info.backend} group at "
            f"{info.host}:{info.port} ({info.world_size} ranks) within {info.timeout_s:g}s: "
            f"{type(e).__name__}: {e}"
        ) from e
    finally:
        with _JOINS_LOCK:
            _JOINS.pop((info.host, int(info.port)), None)


# --------------------------------------------------------------------------------------------
# receiver
# --------------------------------------------------------------------------------------------


class LudicBroadcastReceiver(WeightTransferReceiver):
    """Engine worker at rank ``group.rank``; the trainer is ``request.src_rank`` (the last)."""

    request_cls = LudicWeightUpdateRequest

    def __init__(self, cfg: LudicBroadcastConfig, group: Any) -> None:
        self.cfg = cfg
        self.group = group
        self.bucket_bytes = int(cfg.bucket_size_mb * (1 << 20))

    async def _receive_and_load(self, request: WeightUpdateRequest, loader: WeightLoader) -> None:
        """(The base class validated the metadata; on a mismatch it ``refuse``s, which drains.)"""
        metas = request.metas()
        src = self._src(request)
        batches = _batches(metas, self.bucket_bytes)
        for i, batch in enumerate(batches):
            tensors = await in_thread(self._recv, batch, src)
            try:
                await loader.load_weights(tensors)
            except BaseException:  # the trainer is still sending: take the rest, then fail
                rest = [m for b in batches[i + 1:] for m in b]
                await in_thread(self._drain, rest, src)
                raise
        await in_thread(self.group.barrier)

    async def refuse(self, request: WeightUpdateRequest) -> None:
        """Receive every tensor of the request and drop it, then the barrier: the trainer
        cannot be told no, so it must be allowed to finish."""
        await in_thread(self._drain, request.metas(), self._src(request))

    def _src(self, request: WeightUpdateRequest) -> int:
        src = int(getattr(request, "src_rank", -1))
        return self.group.world_size - 1 if src < 0 else src

    def _recv(self, metas: list[TensorMeta], src: int) -> dict[str, torch.Tensor]:
        import torch

        out = {}
        for m in metas:
            t = torch.empty(m.shape, dtype=str_to_dtype(m.dtype), device=self.group.device)
            self.group.broadcast(t, src)
            out[m.name] = t
        return out

    def _drain(self, metas: list[TensorMeta], src: int) -> None:
        for _ in self._recv_each(metas, src):
            pass
        self.group.barrier()

    def _recv_each(self, metas: list[TensorMeta], src: int) -> Any:
        for m in metas:
            yield self._recv([m], src)

    def close(self) -> None:
        self.group.close()


def _batches(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    out: list[list[TensorMeta]] = [[]]
    size = 0
    for m in metas:
        if out[-1] and size + m.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(m)
        size += m.nbytes
    return out
