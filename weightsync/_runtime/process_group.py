"""A private torch.distributed process group for the ``broadcast`` strategy.

Built from a ``TorchDistributedWeightSyncInfo`` on every member: rank 0 is the sender (training
process), ranks ``rank_offset..`` the engine workers. It is constructed directly (``TCPStore``
+ ``PrefixStore(group_name)`` + ``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never through
``torch.distributed.init_process_group``: the trainer usually already has a default group (FSDP,
DeepSpeed) and an engine (vLLM) has its own, and this group must not touch either.

Every collective is waited on with its own timeout: the sync info's ``timeout_s`` plus
``timeout_s_per_gb`` for every GB it moves (``weightsync.config.scaled_timeout``, the rule the
sender's waits follow too); a dead or stuck peer turns into ``WeightSyncTimeout`` /
``WeightSyncError`` naming this rank, the operation and the peer it waited for, instead of a
hang. Constructing the group blocks until all ``world_size`` members joined (at most
``join_timeout_s``), so callers run it concurrently with the call that makes the other side join
(see ``strategies/broadcast.py``); every member first marks itself in the store, so a group that
does not come together says which ranks never arrived (``GroupJoinError.missing``).
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.errors import CollectiveError, CollectiveTimeout, WeightSyncError, WeightSyncTimeout


class GroupJoinError(WeightSyncTimeout):
    """The group did not come together within its join timeout (``join_s``); ``missing`` lists
    the ranks that never arrived (empty when the store could not tell)."""

    def __init__(self, message: str, missing: list[int] | None = None,
                 join_s: float = 0.0) -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.join_s = join_s

if TYPE_CHECKING:  # pragma: no cover
    import torch


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
class Pending:
    """A collective issued by ``Group.start_broadcast`` and not yet waited for: it keeps its
    tensor alive until ``Group.finish_all``."""

    work: Any
    tensor: Any
    what: str
    timeout: datetime.timedelta


@dataclass
class Group:
    """A process-group backend plus what its collectives need."""

    backend_name: str
    pg: Any
    rank: int
    world_size: int
    timeout: datetime.timedelta  # the fixed part of every collective's wait
    device: Any = None  # torch.device for NCCL, cpu for gloo
    store: Any = None
    timeout_s_per_gb: float = 0.0  # a collective waits this much longer per GB it moves
    _extra: dict = field(default_factory=dict)

    def op_timeout(self, nbytes: int) -> datetime.timedelta:
        from weightsync.config import scaled_timeout

        return datetime.timedelta(seconds=scaled_timeout(
            self.timeout.total_seconds(), self.timeout_s_per_gb, nbytes))

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
        nbytes = tensor.numel() * tensor.element_size()
        opts = _broadcast_options(src, self.op_timeout(nbytes))
        self._wait(self.pg.broadcast([tensor], opts),
                   f"broadcast of {nbytes} bytes {_from(src)}", opts.timeout)

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0,
                        timeout_s: float | None = None) -> Pending:
        """Issue a broadcast without waiting for it (NCCL: queued on the communicator's stream;
        gloo: waited for here, so gloo's operations complete in issue order). Finish a batch of
        them with ``finish_all``. ``timeout_s``: the wait's limit (default: the group's fixed
        part plus its per-GB part for these bytes)."""
        nbytes = tensor.numel() * tensor.element_size()
        opts = _broadcast_options(src, self.op_timeout(nbytes) if timeout_s is None
                                  else datetime.timedelta(seconds=float(timeout_s)))
        pending = Pending(self.pg.broadcast([tensor], opts), tensor,
                          f"broadcast of {nbytes} bytes {_from(src)}", opts.timeout)
        if self.backend_name != "nccl":
            self._wait(pending.work, pending.what, pending.timeout)
            pending.work = None
        return pending

    def can_group(self) -> bool:
        """Whether ``start_broadcasts(grouped=True)`` issues one NCCL group call here (NCCL and
        a torch whose backend coalesces)."""
        return (self.backend_name == "nccl" and hasattr(self.pg, "_start_coalescing")
                and bool(getattr(self.pg, "supports_coalescing", True)))

    def start_broadcasts(self, tensors: list[torch.Tensor], src: int = 0, *,
                         grouped: bool = False) -> list[Pending]:
        """``start_broadcast`` for each of ``tensors``, in order. ``grouped`` (NCCL only; every
        member of the group must pass the same): the broadcasts are issued as one NCCL group
        call (``ncclGroupStart`` .. ``ncclGroupEnd``, torch's coalescing), so the device runs
        them as one launch instead of one kernel after another, and they complete as one
        ``Pending``. Elsewhere (gloo, a single tensor) the same as one call per tensor."""
        tensors = list(tensors)
        if not grouped or not self.can_group() or len(tensors) < 2:
            return [self.start_broadcast(t, src) for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        opts = _broadcast_options(src, self.op_timeout(nbytes))
        self.pg._start_coalescing()
        try:
            for t in tensors:
                self.pg.broadcast([t], opts)
        finally:
            work = self.pg._end_coalescing()
        return [Pending(work, tensors, f"{len(tensors)} grouped broadcasts of {nbytes} bytes "
                                       f"{_from(src)}", opts.timeout)]

    def finish_all(self, pending: list[Pending]) -> None:
        """Wait until every broadcast of ``pending`` completed (its tensors may be reused, read
        or freed after this), within the sum of their timeouts; a failure or timeout names the
        operation as ``broadcast`` does. NCCL: the current stream is ordered after them and the
        host waits once, on an event after the last."""
        works = [p for p in pending if p.work is not None]
        if not works:
            return

        import torch

        for p in works:
            p.work.wait()  # stream order only: the current stream waits for the communicator's
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        limit = sum(p.timeout.total_seconds() for p in works)
        if not _poll(done.query, limit):
            last = works[-1]
            raise CollectiveTimeout(
                f"{self.backend_name} {last.what} (and {len(works) - 1} more) on weight-sync "
                f"rank {self.rank}/{self.world_size} did not complete within {limit:g}s (a "
                f"peer died or stopped answering?)")
        for p in works:
            p.work = None

    def all_reduce_min(self, value: int) -> int:
        """MIN over every rank of one small int (the go/no-go vote before bulk data)."""
        return self.finish_all_reduce_min(self.start_all_reduce_min(value))

    def start_all_reduce_min(self, value: int) -> Pending:
        """``all_reduce_min`` issued, not waited for (``finish_all_reduce_min``; whether it
        completed: ``pending.work.is_completed()``): the caller works while the peers vote."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int32, device=self.device or "cpu")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        opts.timeout = self.timeout
        return Pending(self.pg.allreduce([t], opts), t, f"go/no-go all_reduce {self.peers()}",
                       self.timeout)

    def finish_all_reduce_min(self, pending: Pending) -> int:
        self._wait(pending.work, pending.what, pending.timeout)
        return int(pending.tensor.item())

    def peers(self) -> str:
        """Who this rank waits for in a collective of the whole group (for error texts): the
        sender is rank 0, every engine worker one of the others."""
        others = self.world_size - 1 if self.rank == 0 else self.world_size - 2
        if self.rank == 0:
            return f"with the {others} receiver rank(s)"
        if others <= 0:
            return "with the sender (rank 0)"
        return f"with the sender (rank 0) and {others} other receiver rank(s)"

    def _wait(self, work: Any, what: str, timeout: datetime.timedelta) -> None:
        try:
            if self.backend_name == "nccl":
                # torch's NCCL wait(timeout) sleeps between its checks (its
                # kSynchronizeBusyWaitMillis): a traced vote, done on the devices, ended 0.9 ms
                # later on the trainer's host than on the engine's. Polled first, the wait
                # below returns at once, or raises the failure or the timeout as before
                _poll(work.is_completed, timeout.total_seconds())
            work.wait(timeout)
        except Exception as e:
            text = str(e)
            cls = CollectiveTimeout if "imeout" in text or "imed out" in text else CollectiveError
            raise cls(
                f"{self.backend_name} {what} on weight-sync rank {self.rank}/{self.world_size} "
                f"failed after at most {timeout.total_seconds():g}s: {text.splitlines()[0] if text else type(e).__name__} "
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


def _poll(done: Any, limit_s: float) -> bool:
    """Call ``done()`` until it is true (-> True) or ``limit_s`` passed (-> False): spinning
    first, then 0.1 ms apart (a host wait for device work that ends within microseconds)."""
    import time

    t0 = time.perf_counter()
    spins = 0
    while not done():
        if time.perf_counter() - t0 > limit_s:
            return False
        spins += 1
        time.sleep(0 if spins < 2000 else 1e-4)
    return True


def _broadcast_options(src: int, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = timeout
    return opts


def _from(src: int) -> str:
    """Whom a broadcast's receivers wait for (error texts)."""
    return "from the sender (rank 0)" if src == 0 else f"from rank {src}"


def build_group(
    info: Any,  # a strategies.broadcast.TorchDistributedWeightSyncInfo (no import back)
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
    join_s = float(getattr(info, "join_timeout_s", info.timeout_s))
    join = datetime.timedelta(seconds=join_s)
    if store is None:
        try:
            store = dist.TCPStore(
                info.master_addr, int(info.master_port), info.world_size, is_master=False,
                timeout=join,
            )
        except Exception as e:
            raise WeightSyncTimeout(
                f"rank {rank} could not reach the weight-sync store at "
                f"{info.master_addr}:{info.master_port} within {join_s:g}s: {e}"
            ) from e
    prefixed = dist.PrefixStore(f"weightsync/{info.group_name}", store)
    prefixed.set(f"joined/{rank}", "1")  # so a group that does not form can say who is missing
    try:
        if info.backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, info.world_size, join)
            dev = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                raise WeightSyncError("backend 'nccl' needs CUDA; use backend 'gloo' on CPU")
            dev = torch.device(device) if device is not None else torch.device(
                "cuda", torch.cuda.current_device()
            )
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = join
            pg = dist.ProcessGroupNCCL(prefixed, rank, info.world_size, opts)
    except WeightSyncError:
        raise
    except Exception as e:
        raise _join_error(prefixed, info, rank, join_s, e) from e
    group = Group(info.backend, pg, rank, info.world_size,
                  datetime.timedelta(seconds=float(info.timeout_s)), device=dev, store=store,
                  timeout_s_per_gb=float(getattr(info, "timeout_s_per_gb", 0.0)))
    if info.backend == "nccl":
        # first collective creates the communicator on ``dev``; do it now, inside the rendezvous
        with torch.cuda.device(dev):
            try:
                group.all_reduce_min(1)
            except WeightSyncError as e:
                raise _join_error(prefixed, info, rank, join_s, e) from e
    return group


def missing_ranks(store: Any, world_size: int) -> list[int]:
    """The ranks that have not marked themselves in ``store`` (``build_group``'s first step)."""
    out = []
    for r in range(world_size):
        try:
            if not store.check([f"joined/{r}"]):
                out.append(r)
        except Exception:  # noqa: BLE001 - the store itself is gone: nobody can tell
            return []
    return out


def _join_error(store: Any, info: Any, rank: int, join_s: float, e: BaseException) -> GroupJoinError:
    missing = missing_ranks(store, info.world_size)
    who = (f"rank(s) {missing} never joined" if missing
           else "every rank reached the store but the group did not form")
    return GroupJoinError(
        f"rank {rank} could not join the weight-sync group {info.group_name!r} ({info.backend}, "
        f"{info.world_size} ranks, store {info.master_addr}:{info.master_port}) within "
        f"{join_s:g}s: {who} ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
        missing, join_s,
    )
