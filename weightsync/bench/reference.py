"""Reference bandwidths for ``weightsync bench``, measured in the same run as the strategies.

- ``MemcpyProbe`` / ``memcpy_gbps``: one ``copy_`` of a flat buffer of the same bytes (CPU: host
  memcpy; CUDA: a device-to-device copy; capped at 2 GiB, GB/s does not depend on size beyond
  caches). What a transfer that copies each byte once could reach.
- ``raw_broadcast_gbps``: one flat buffer broadcast from this process to a spawned peer over a
  private 2-rank group (gloo or NCCL), each broadcast acknowledged by a 1-int all_reduce (as a
  strategy's chunk is acknowledged by the engine). What the collective itself can do, without
  weightsync's control plane, packing or loading.

Both return the median GB/s (1e9 bytes/s) over ``repeats`` after one warm-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


class MemcpyProbe:
    """Holds two flat buffers of ``min(nbytes, cap_bytes)`` and times one ``copy_`` between
    them (host memcpy on CPU, device copy on CUDA). The bench calls ``once()`` right before each
    timed sync, so the reference samples the machine's load over the whole run; ``gbps()`` is
    the median of every sample."""

    def __init__(self, nbytes: int, device: str = "cpu", cap_bytes: int = 2 << 30) -> None:
        import torch

        self.nbytes = int(min(nbytes, cap_bytes))
        self.device = device
        self.src = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.src.fill_(7)
        self.dst = torch.empty_like(self.src)
        self.dst.fill_(0)
        self.samples: list[float] = []
        self.once()  # warm-up: pages touched, caches and threads up
        self.samples.clear()

    def once(self) -> float:
        """Seconds for one copy of ``self.nbytes``. Buffers under 64 MiB: the median over 5
        batches of back-to-back copies, each moving at least 51 MiB (timer and thread wake-up
        noise would dominate one small copy; the median drops a batch a busy moment slowed);
        larger ones: one copy. Every call's result is kept in ``samples``."""
        runs = 5 if self.nbytes < (64 << 20) else 1
        k = max(1, -(-(256 << 20) // (runs * max(self.nbytes, 1))))
        batches = []
        for _ in range(runs):
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(k):
                self.dst.copy_(self.src)
            _sync(self.device)
            batches.append((time.perf_counter() - t0) / k)
        seconds = statistics.median(batches)
        self.samples.append(seconds)
        return seconds

    def gbps(self, seconds: list[float] | None = None) -> float:
        """GB/s of the median of ``seconds`` (default: every ``once`` so far)."""
        return self.nbytes / statistics.median(self.samples if seconds is None else seconds) / 1e9

    def close(self) -> None:
        self.src = self.dst = None  # type: ignore[assignment]


def memcpy_gbps(nbytes: int, device: str = "cpu", repeats: int = 3) -> float:
    """Median GB/s of ``repeats`` copies of ``nbytes`` (after one warm-up)."""
    probe = MemcpyProbe(nbytes, device, cap_bytes=nbytes)
    try:
        return probe.gbps([probe.once() for _ in range(repeats)])
    finally:
        probe.close()


def raw_broadcast_gbps(
    nbytes: int,
    backend: str = "gloo",
    device: str = "cpu",
    repeats: int = 3,
    *,
    peer_device: str | list[str] | None = None,
    timeout_s: float = 300.0,
) -> float:
    """Broadcast ``nbytes`` to spawned peer processes (one per entry of ``peer_device``, a
    device or a list of them; default one peer on ``device``); median GB/s (bytes counted once,
    however many peers)."""
    import multiprocessing as mp

    from weightsync._runtime.process_group import build_group, make_master_store
    from weightsync.strategies.broadcast import TorchDistributedWeightSyncInfo

    peers = [peer_device] if isinstance(peer_device, str) else list(peer_device or [device])
    world = 1 + len(peers)
    store = make_master_store(0, world, timeout_s)
    info = TorchDistributedWeightSyncInfo(
        master_addr="127.0.0.1", master_port=int(store.port), world_size=world,
        group_name="bench-reference", backend=backend, timeout_s=timeout_s,
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_peer_main, args=(info.to_dict(), nbytes, repeats, dev, rank),
                    daemon=True)
        for rank, dev in enumerate(peers, start=1)
    ]
    for p in procs:
        p.start()
    try:
        group = build_group(info, 0, store=store, device=device if backend == "nccl" else None)
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buf.fill_(3)
        times = []
        for i in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            group.broadcast(buf, src=0)
            group.all_reduce_min(1)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        group.close()
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return nbytes / statistics.median(times) / 1e9


def _peer_main(info_dict: dict[str, Any], nbytes: int, repeats: int, device: str,
               rank: int = 1) -> None:
    import os

    import torch

    from weightsync._runtime.process_group import build_group
    from weightsync.strategies.broadcast import TorchDistributedWeightSyncInfo

    info = TorchDistributedWeightSyncInfo.from_dict(info_dict)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = build_group(info, rank, device=device if info.backend == "nccl" else None)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(repeats + 1):
        group.broadcast(buf, src=0)
        group.all_reduce_min(1)
    _sync(device)
    group.close()
    os._exit(0)  # a process holding a gloo group may hang in interpreter teardown


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()
