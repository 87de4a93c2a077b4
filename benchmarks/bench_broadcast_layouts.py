"""How a model's tensors should cross one NCCL broadcast group: per tensor, grouped, or packed.

    python benchmarks/bench_broadcast_layouts.py [--shape qwen2-7b] [--repeats 5]
        [--packs 16:256,64,256] [--json PATH]

Two processes (GPU 0 sends, GPU 1 receives), the shape's tensors (bf16) on both, no vLLM and no
weightsync control plane: only the data plane's choices, each timed on the sender from the first
issue to the receiver's acknowledgement (a 1-int all_reduce), median of ``--repeats`` after one
warm-up:

- ``flat``: one broadcast of one buffer of every byte (the reference; no copies).
- ``per_tensor``: one NCCL call per tensor, straight into the receiver's tensors, in chunks of
  1 GB (chunk ``k + 1`` issued before ``k`` is waited for).
- ``grouped``: the same with each chunk's calls as one NCCL group call.
- ``packed_<B>_<S>`` (``--packs B:S``; ``S`` alone means ``S:S``): each 1 GB chunk cut as the
  streamed broadcast cuts it (``strategies/_stream.plan_transfers`` with ``pack_below_mb`` B and
  ``pack_mb`` S): tensors of at least ``B`` MB alone (into their tensors), the others packed in
  order into buffers of at most ``S`` MB; the sender copies a slice's tensors into one of two
  pack buffers (one ``torch._foreach_copy_``), broadcasts it into one of two receive buffers,
  and the receiver copies them out (one ``_foreach_copy_``); stream order only, the host waits
  once at the end.

Each row is checked: the receiver's tensors equal the sender's (a per-tensor float64 sum of the
bits, compared on the sender). ``host ms`` is how long the receiver's Python took to issue the
row's work (the part that grows with the number of tensors). The table and JSON say which layout
reaches the floor on this machine; ``strategies/_stream.py`` chooses its packing from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

CHUNK = 1 << 30


def _packs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        if part:
            below, _, size = part.partition(":")
            out.append((int(below), int(size or below)))
    return out


def _chunks(nbytes: list[int]) -> list[list[int]]:
    out, cur, size = [], [], 0
    for i, n in enumerate(nbytes):
        if cur and size + n > CHUNK:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


def _rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.bench.shapes import shape_specs
    from weightsync.strategies._layout import view_as
    from weightsync.strategies._stream import plan_transfers
    from weightsync.types import TensorMeta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpu = torch.cuda.device_count() >= 2
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev,
                                timeout=timedelta(seconds=120))
    else:  # a check of the layouts' bookkeeping on CPU (gloo: no group calls, no overlap)
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    pg = dist.group.WORLD._get_backend(dev)
    specs = shape_specs(args.shape)
    tensors = [torch.empty(s, dtype=torch.bfloat16, device=dev) for _, s in specs]
    for t in tensors:
        if rank == 0:
            t.normal_()
        else:
            t.zero_()
    nbytes = [t.numel() * t.element_size() for t in tensors]
    metas = [TensorMeta(n, "bfloat16", list(sh)) for n, sh in specs]
    total = sum(nbytes)
    flat = torch.empty(total, dtype=torch.uint8, device=dev)

    def bcast(t: torch.Tensor) -> object:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return pg.broadcast([t], opts)

    def ack() -> None:
        x = torch.ones(1, device=dev)
        dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize(dev)

    def as_u8(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1).view(torch.uint8)

    def run_flat() -> None:
        bcast(flat).wait()

    def run_per_tensor(grouped: bool) -> None:
        prev = None
        for chunk in _chunks(nbytes):
            if grouped and gpu:
                pg._start_coalescing()
                for i in chunk:
                    bcast(as_u8(tensors[i]))
                works = [pg._end_coalescing()]
            else:
                works = [bcast(as_u8(tensors[i])) for i in chunk]
            if prev is not None:
                for w in prev:
                    w.wait()
            prev = works
        for w in prev or []:
            w.wait()

    bufs: dict[int, list[torch.Tensor]] = {}

    def run_packed(below: int, slice_bytes: int) -> None:
        two = bufs.setdefault(slice_bytes, [torch.empty(slice_bytes, dtype=torch.uint8,
                                                        device=dev) for _ in range(2)])
        works: list[object] = []
        last: list[object] = [None, None]  # the broadcast that last used each buffer
        k = 0
        for chunk in _chunks(nbytes):  # the streamed broadcast's own cut of each chunk
            for tr in plan_transfers([metas[i] for i in chunk], below, slice_bytes):
                members = [chunk[m] for m in tr.members]
                if not tr.packed:
                    works.append(bcast(as_u8(tensors[members[0]])))
                    continue
                slot = k % 2
                buf = two[slot][: tr.nbytes]
                k += 1
                if rank == 0 and last[slot] is not None:
                    last[slot].wait()  # stream order: the pack waits until that one read it
                views = [view_as(buf, off, metas[i]) for i, off in zip(members, tr.offsets,
                                                                         strict=True)]
                if rank == 0:
                    torch._foreach_copy_(views, [tensors[i] for i in members])
                    w = bcast(buf)
                else:  # the next broadcast into buf is issued after this copy: NCCL waits
                    w = bcast(buf)
                    w.wait()  # the current stream waits for the bytes (no host wait)
                    torch._foreach_copy_([tensors[i] for i in members], views)
                last[slot] = w
                works.append(w)
        for w in works:
            w.wait()

    rows = [("flat", run_flat), ("per_tensor", lambda: run_per_tensor(False)),
            ("grouped", lambda: run_per_tensor(True))]
    for below, mb in args.packs:
        rows.append((f"packed_{below}_{mb}", lambda b=below << 20, m=mb << 20: run_packed(b, m)))
    report: dict = {"shape": args.shape, "tensors": len(tensors), "bytes": total, "rows": {}}
    for name, fn in rows:
        if rank == 1:
            for t in tensors:
                t.zero_()
        times, hosts = [], []
        for r in range(args.repeats + 1):
            ack()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            ack()
            t2 = time.perf_counter()
            if r:
                times.append((t2 - t0) * 1e3)
                hosts.append((t1 - t0) * 1e3)
        sums = torch.stack([t.float().sum(dtype=torch.float64) for t in tensors])
        got = [torch.empty_like(sums) for _ in range(2)]
        dist.all_gather(got, sums)
        # (flat: the buffer is not the tensors, nothing to compare)
        exact = None if name == "flat" else bool(torch.equal(got[0], got[1]))
        host = torch.tensor([statistics.median(hosts)], dtype=torch.float64, device=dev)
        hall = [torch.empty_like(host) for _ in range(2)]
        dist.all_gather(hall, host)
        if rank == 0:
            report["rows"][name] = {"ms": statistics.median(times), "min_ms": min(times),
                                    "sender_host_ms": hall[0].item(),
                                    "receiver_host_ms": hall[1].item(), "exact": exact}
            with open(out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import socket

    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-7b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--packs", default="16:256,64,256", type=_packs,
                   help="B:S (pack tensors under B MB into slices of S MB) or S (= S:S), "
                        "comma-separated")
    p.add_argument("--json", default="broadcast_layouts.json")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("fewer than 2 GPUs: gloo on the CPU (checks the layouts, times nothing useful)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port, args.json), nprocs=2, join=True)
    with open(args.json) as f:
        report = json.load(f)
    rows = report["rows"]
    ref = rows["flat"]["ms"]
    print(f"{args.shape}: {report['tensors']} tensors, {report['bytes'] / 1e9:.2f} GB, bf16, "
          f"GPU0 -> GPU1")
    print(f"{'layout':<16} {'ms':>8} {'x flat':>7} {'send host ms':>13} {'recv host ms':>13} exact")
    bad = False
    for name, r in rows.items():
        print(f"{name:<16} {r['ms']:8.2f} {r['ms'] / ref:7.2f} {r['sender_host_ms']:13.2f} "
              f"{r['receiver_host_ms']:13.2f} {'-' if r['exact'] is None else r['exact']}")
        bad |= r["exact"] is False
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
