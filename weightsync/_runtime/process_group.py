"""A private torch.distributed process group for the ``broadcast`` strategy.

Built from a ``TorchDistributedWeightSyncInfo`` on every member: rank 0 is the sender (training
process), ranks ``rank_offset..`` the engine workers. It is constructed directly (``TCPStore``
+ ``PrefixStore(group_name)`` + ``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never through
``torch.distributed.init_process_group``: the trainer usually already has a default group (FSDP,
DeepSpeed) and an engine (vLLM) has its own, and this group must not touch either.

Every collective is waited on with the group's timeout; a dead peer turns into
``WeightSyncTimeout`` / ``WeightSyncError`` instead of a hang. Constructing the group blocks
until all ``world_size`` members joined, so callers run it concurrently with the call that makes
the other side join (see ``strategies/broadcast.py``).
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.errors import WeightSyncError, WeightSyncTimeout

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.types import TorchDistributedWeightSyncInfo


def default_master_addr() -> str:
    """This node's address: Ray's node IP when Ray is initialised here, else 127.0.0.1."""
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            if ray.is_initialized():
                return ray.util.get_node_ip_address()
        except Exception:  # pragma: no cover - ray half-imported
            pass
    return "127.0.0.1"


def make_master_store(port: int, world_size: int, timeout_s: float) -> Any:
    """The TCPStore server (lives in the sending process). ``port=0`` picks a free port; the
    store's ``.port`` tells which."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            "0.0.0.0", port, world_size, is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )
    except Exception as e:
        raise WeightSyncError(
            f"could not start the weight-sync rendezvous store on port {port}: {e}; pick another "
            f"master_port (or leave it unset for a free one)"
        ) from e


@dataclass
class Group:
    """A process-group backend plus what its collectives need."""

    backend_name: str
    pg: Any
    rank: int
    world_size: int
    timeout: datetime.timedelta
    device: Any = None  # torch.device for NCCL, cpu for gloo
    store: Any = None
    _extra: dict = field(default_factory=dict)

    def on_device(self) -> Any:
        """Context that makes the group's CUDA device current (a no-op for gloo): collectives
        run in helper threads, whose current device is not the caller's."""
        import contextlib

        dev = self.device
        if dev is not None and dev.type == "cuda":
            import torch

            return torch.cuda.device(dev)
        return contextlib.nullcontext()

    # -- collectives ---------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._wait(self.pg.broadcast([tensor], opts), f"broadcast of {tensor.numel()} bytes")

    def all_reduce_min(self, value: int) -> int:
        """MIN over every rank of one small int (the go/no-go vote before bulk data)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int32, device=self.device or "cpu")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        opts.timeout = self.timeout
        self._wait(self.pg.allreduce([t], opts), "go/no-go all_reduce")
        return int(t.item())

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:
            text = str(e)
            cls = WeightSyncTimeout if "imeout" in text or "imed out" in text else WeightSyncError
            raise cls(
                f"{self.backend_name} {what} on weight-sync rank {self.rank}/{self.world_size} "
                f"failed after at most {self.timeout.total_seconds():g}s: {text.splitlines()[0] if text else type(e).__name__} "
                f"(a peer died or stopped answering?)"
            ) from e

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and self.backend_name == "nccl":
            try:
                pg.abort()
            except Exception:  # pragma: no cover
                pass
        self.store = None


def build_group(
    info: TorchDistributedWeightSyncInfo,
    rank: int,
    *,
    store: Any = None,
    device: Any = None,
) -> Group:
    """Join the private group as ``rank`` (blocks until every member joined or the timeout).

    ``store``: the master TCPStore when this process created it (rank 0); others connect to
    ``info.master_addr:info.master_port``. ``device``: the CUDA device for NCCL (default: the
    current one).
    """
    import torch
    import torch.distributed as dist

    if not (0 <= rank < info.world_size):
        raise ValueError(f"rank {rank} outside the weight-sync group of {info.world_size}")
    timeout = datetime.timedelta(seconds=float(info.timeout_s))
    if store is None:
        try:
            store = dist.TCPStore(
                info.master_addr, int(info.master_port), info.world_size, is_master=False,
                timeout=timeout,
            )
        except Exception as e:
            raise WeightSyncTimeout(
                f"rank {rank} could not reach the weight-sync store at "
                f"{info.master_addr}:{info.master_port} within {info.timeout_s:g}s: {e}"
            ) from e
    prefixed = dist.PrefixStore(f"weightsync/{info.group_name}", store)
    try:
        if info.backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)
            dev = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                raise WeightSyncError("backend 'nccl' needs CUDA; use backend 'gloo' on CPU")
            dev = torch.device(device) if device is not None else torch.device(
                "cuda", torch.cuda.current_device()
            )
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, info.world_size, opts)
    except WeightSyncError:
        raise
    except Exception as e:
        raise WeightSyncTimeout(
            f"rank {rank} could not join the weight-sync group {info.group_name!r} "
            f"({info.backend}, {info.world_size} ranks, store {info.master_addr}:{info.master_port}) "
            f"within {info.timeout_s:g}s: {e}"
        ) from e
    group = Group(info.backend, pg, rank, info.world_size, timeout, device=dev, store=store)
    if info.backend == "nccl":
        # first collective creates the communicator on ``dev``; do it now, inside the rendezvous
        with torch.cuda.device(dev):
            group.all_reduce_min(1)
    return group
