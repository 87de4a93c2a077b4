"""How an engine should copy an update's tensors into its weights: one batched copy, one copy
per tensor, or both split by size.

    python benchmarks/bench_copies.py [--shape qwen2-7b] [--repeats 10] [--split-mb 1,4,16]
        [--json PATH]

One process, one device (CUDA when there is one, else the CPU). The shape's tensors (bf16 on
CUDA, float32 on the CPU) are the sources, one allocation each, as an IPC engine sees a
trainer's tensors or a receiver its staging views; the destinations are laid out as vLLM lays
out a Qwen2 / Llama model: q/k/v written into row ranges of one fused ``qkv_proj`` (weights and
biases), gate/up into one ``gate_up_proj``, every other tensor into a parameter of its own.
Rows, each the median of ``--repeats`` after one warm-up, device time between two CUDA events
(wall time on the CPU), and the host time to issue it:

- ``flat_copy``: one ``copy_`` of a buffer of every byte into another (at most 2 GiB, its time
  scaled to every byte; the reference, as the ``device_copy`` row of ``bench_vllm_sync.py``).
- ``foreach``: one ``torch._foreach_copy_`` over every (destination view, source) pair (what
  the loaders' copy plan replays: ``weightsync/loaders/copy_plan.py``).
- ``per_tensor``: one ``copy_`` per pair (a contiguous same-dtype ``copy_`` is a memcpy).
- ``split_<MB>``: pairs of at least ``MB`` MB one ``copy_`` each, the rest one
  ``_foreach_copy_``.

Every row is checked: each destination view equals its source after the row (the destinations
are zeroed before it). The ratio column is against ``flat_copy`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

#: the reference's buffer (scaled to the model's bytes beyond it: a 7B shape's sources and
#: destinations take 30 GB already)
FLAT_MAX = 2 << 30


def _pairs(shape: str, device: Any, dtype: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """``(sources, destination views, destination parameters)`` for ``shape``."""
    import torch

    from weightsync.bench.shapes import shape_specs

    specs = shape_specs(shape)
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    groups: dict[str, list[tuple[int, tuple[int, ...]]]] = {}  # fused name -> [(spec, shape)]
    plain: list[int] = []
    for i, (name, dims) in enumerate(specs):
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1] in fused:
            groups.setdefault(f"{parts[0]}.{fused[parts[1]][0]}.{parts[2]}", []).append(
                (i, dims))
        else:
            plain.append(i)
    sources = [torch.empty(dims, dtype=dtype, device=device) for _, dims in specs]
    for s in sources:
        s.uniform_(-0.05, 0.05)
    views: list[Any] = [None] * len(specs)
    params = []
    for members in groups.values():
        rows = sum(d[0] for _, d in members)
        param = torch.empty((rows, *members[0][1][1:]), dtype=dtype, device=device)
        params.append(param)
        at = 0
        for i, dims in members:
            views[i] = param.narrow(0, at, dims[0])
            at += dims[0]
    for i in plain:
        param = torch.empty(specs[i][1], dtype=dtype, device=device)
        params.append(param)
        views[i] = param
    return sources, views, params


def _timed(run: Any, repeats: int, cuda: bool, zero: Any) -> tuple[float, float]:
    """``(median device ms, median host ms)`` of ``run()`` over ``repeats`` after a warm-up."""
    import torch

    device_ms, host_ms = [], []
    for k in range(repeats + 1):
        zero()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (t1 - t0) * 1e3
        if k:
            device_ms.append(elapsed)
            host_ms.append((t1 - t0) * 1e3)
    return statistics.median(device_ms), statistics.median(host_ms)


def _flat_copy(nbytes: int, device: Any, repeats: int) -> tuple[float, float]:
    """The reference: one ``copy_`` of at most ``FLAT_MAX`` bytes, its time scaled to
    ``nbytes``; ``(device ms, host ms)``."""
    import torch

    flat = min(nbytes, FLAT_MAX)
    src = torch.empty(flat, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, host = _timed(lambda: dst.copy_(src), repeats, device.type == "cuda", lambda: None)
    return ms * nbytes / flat, host


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2-7b")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--split-mb", default="1,4,16",
                    help="comma-separated sizes (MB) for the split rows")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sources, views, params = _pairs(args.shape, device, dtype)
    nbytes = sum(s.numel() * s.element_size() for s in sources)

    def zero() -> None:
        torch._foreach_zero_(params)

    def split(limit: int) -> Any:
        large = [(d, s) for d, s in zip(views, sources, strict=True)
                 if s.numel() * s.element_size() >= limit]
        small = [(d, s) for d, s in zip(views, sources, strict=True)
                 if s.numel() * s.element_size() < limit]

        def run() -> None:
            for d, s in large:
                d.copy_(s)
            if small:
                torch._foreach_copy_([d for d, _ in small], [s for _, s in small])
        return run

    rows: list[tuple[str, Any]] = [
        ("foreach", lambda: torch._foreach_copy_(views, sources)),
        ("per_tensor", lambda: [d.copy_(s) for d, s in zip(views, sources, strict=True)]),
    ]
    for mb in (float(x) for x in args.split_mb.split(",") if x):
        rows.append((f"split_{mb:g}", split(int(mb * (1 << 20)))))

    ref_ms, ref_host = _flat_copy(nbytes, device, args.repeats)
    results: list[dict[str, Any]] = [{"row": "flat_copy", "ms": ref_ms, "host_ms": ref_host,
                                      "x_flat": 1.0, "exact": True}]
    for name, run in rows:
        ms, host = _timed(run, args.repeats, cuda, zero)
        exact = all(torch.equal(d, s) for d, s in zip(views, sources, strict=True))
        results.append({"row": name, "ms": ms, "host_ms": host, "x_flat": ms / ref_ms,
                        "exact": exact})
    gbps = nbytes / 1e9
    print(f"{args.shape}: {len(sources)} tensors, {gbps:.2f} GB, {device} "
          f"({torch.cuda.get_device_name(device) if cuda else 'cpu'}), {dtype}")
    print(f"{'row':<14} {'ms':>8} {'GB/s':>8} {'x flat':>7} {'host ms':>8} exact")
    for r in results:
        print(f"{r['row']:<14} {r['ms']:8.2f} {gbps / (r['ms'] / 1e3):8.1f} {r['x_flat']:7.2f} "
              f"{r['host_ms']:8.2f} {'yes' if r['exact'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": str(device), "dtype": str(dtype),
                       "tensors": len(sources), "bytes": nbytes,
                       "gpu": torch.cuda.get_device_name(device) if cuda else None,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": results}, f,
                      indent=2)
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
