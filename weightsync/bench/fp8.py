"""FP8 targets: what a push into an FP8 engine costs and carries, beside a bf16 push, in one run:
``benchmarks/bench_fp8.py``.

A Qwen2-shaped model (``--size``: ``small``, ``0.5b``, ``1.5b``, ``7b``; random bf16 weights,
nothing downloaded) is pushed by this process through ``ws.connect(engine, strategy)`` into an
engine process (``weightsync.local.LocalEngineProcess``, a torch module holding the target's
layout, on ``--device``), three ways, each timed over ``--repeats`` pushes:

* ``bf16``: the bf16 weights into a bf16 engine (the reference: a full sync as today);
* ``fp8_block``: the same weights with ``quantize=`` into an engine holding the decoder's linear
  weights in FP8 with 128 x 128 block scales (DeepSeek-V3 / Qwen3-FP8 layout);
* ``fp8_tensor``: the same into per-tensor scaled FP8.

Columns: bytes on the wire, the push's median (and min) milliseconds, its ratio to ``bf16``, and
the sender's quantisation alone (``Fp8Layout.quantize`` over every tensor, on the trainer's
device, synchronised). Every FP8 row also checks that what landed is bit for bit what the
sender quantised (the engine's tensor digests); exits 1 if one was not.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

LINEAR = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
          "gate_proj.weight", "up_proj.weight", "down_proj.weight")
ROWS = {"bf16": None, "fp8_block": (128, 128), "fp8_tensor": ()}  # () : per-tensor


@dataclass
class Fp8BenchConfig:
    size: str = "small"
    strategy: str = "packed_cuda_ipc"
    device: str = "cpu"
    repeats: int = 5


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_row(name: str, cfg: Fp8BenchConfig) -> dict[str, Any]:
    import weightsync as ws
    from weightsync.digest import tensor_digest
    from weightsync.fp8 import Fp8Layout
    from weightsync.local import LocalEngineProcess
    from weightsync.local.modules import qwen2_metas, qwen2_module

    block = ROWS[name]
    metas = qwen2_metas(cfg.size, "bfloat16")
    layout = None if block is None else Fp8Layout(
        frozenset(m.name for m in metas if m.name.endswith(LINEAR)),
        weight_block_size=block or None)
    engine_metas = metas if layout is None else layout.manifest(metas)
    state = {n: t.to(cfg.device) for n, t in
             qwen2_module(cfg.size, "bfloat16", seed=1).state_dict().items()}
    quantize_ms = 0.0
    want = None
    if layout is not None:
        t0 = time.perf_counter()
        quantized = [p for n, t in state.items() for p in layout.quantize(n, t)]
        _sync(cfg.device)
        quantize_ms = (time.perf_counter() - t0) * 1000
        want = {n: tensor_digest(t.cpu()) for n, t in quantized}
        del quantized
    engine = LocalEngineProcess.spawn(
        "weightsync.local.modules:metas_module",
        {"metas": [m.to_dict() for m in engine_metas], "device": cfg.device}, name=name)
    try:
        async def pushes() -> tuple[list[float], int, bool]:
            times, nbytes = [], 0
            async with ws.connect([engine], {"type": cfg.strategy, "timeout_s": 600},
                                  quantize=layout) as sync:
                base = await engine.call("get_version")
                for i in range(cfg.repeats + 1):  # the first one warms the path
                    t0 = time.perf_counter()
                    stats = await sync.push(state, version=base + 1 + i)
                    if i:
                        times.append((time.perf_counter() - t0) * 1000)
                    nbytes = stats.total_bytes
            exact = True
            if want is not None:
                got = await engine.call("state_digest")
                exact = {n: d["digest"] for n, d in got.items()} == want
            return times, nbytes, exact

        times, nbytes, exact = asyncio.run(pushes())
    finally:
        engine.stop()
    return {"row": name, "wire_bytes": nbytes, "push_ms": statistics.median(times),
            "push_min_ms": min(times), "quantize_ms": quantize_ms, "exact": exact}


def run(cfg: Fp8BenchConfig) -> dict[str, Any]:
    rows = [run_row(name, cfg) for name in ROWS]
    ref = rows[0]["push_ms"]
    for r in rows:
        r["ratio"] = r["push_ms"] / ref if ref else 0.0
        r["wire_ratio"] = r["wire_bytes"] / rows[0]["wire_bytes"]
    return {
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "device": _device_name(cfg.device), "config": asdict(cfg),
        "command": "python benchmarks/bench_fp8.py " + " ".join(sys.argv[1:]),
        "rows": rows, "all_exact": all(r["exact"] for r in rows),
    }


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def format_table(record: dict[str, Any]) -> str:
    c = record["config"]
    lines = [f"FP8 targets: qwen2-{c['size']} shape, {c['strategy']}, {record['device']}, "
             f"{c['repeats']} pushes per row ({record['date']})",
             f"{'row':<11} {'wire MB':>9} {'wire/bf16':>9} {'push ms':>9} {'min ms':>8} "
             f"{'x bf16':>7} {'quantize ms':>11} {'exact':>6}"]
    for r in record["rows"]:
        lines.append(f"{r['row']:<11} {r['wire_bytes'] / 1e6:>9.1f} {r['wire_ratio']:>9.2f} "
                     f"{r['push_ms']:>9.1f} {r['push_min_ms']:>8.1f} {r['ratio']:>7.2f} "
                     f"{r['quantize_ms']:>11.1f} {'yes' if r['exact'] else 'NO':>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small", "0.5b", "1.5b", "7b"],
                   help="the Qwen2 shape (default small)")
    p.add_argument("--strategy", choices=["broadcast", "cuda_ipc", "packed_cuda_ipc"],
                   default="packed_cuda_ipc", help="default packed_cuda_ipc")
    p.add_argument("--device", default="cpu", help="trainer and engine device (default cpu)")
    p.add_argument("--repeats", type=int, default=5, help="timed pushes per row (default 5)")
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args(argv)
    record = run(Fp8BenchConfig(size=a.size, strategy=a.strategy, device=a.device,
                                repeats=a.repeats))
    print(format_table(record))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if record["all_exact"] else 1
