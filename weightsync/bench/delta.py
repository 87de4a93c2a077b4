"""Full vs delta pushes after real fine-tuning steps, in one run: ``benchmarks/bench_delta_sync.py``.

A causal LM built here (``weightsync.testing.tiny_models``, Qwen2, nothing downloaded) is
fine-tuned for real: float32 masters of its bf16 weights (a bf16 checkpoint loaded for
training), AdamW on a next-token loss over text, one learning rate per series. After each step
the trainer pushes its weights cast to bf16 (the served dtype) twice, to two identical engines
in child processes (``LocalEngineProcess``, a bf16 torch module each, over the chosen strategy,
gloo broadcast by default): once as a full update (the reference, a plain session) and once
through a ``delta=True`` session. Per step: bytes on the data plane and seconds of each push
(the delta's include encoding it on the sender), the fraction of bf16 elements that changed,
the encodings chosen, and whether the delta engine's weights are bit for bit the trainer's
bf16 cast (``state_digest``). A series starts with one full push to both (not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

STRATEGIES = {
    "broadcast": {"type": "broadcast", "backend": "gloo"},
    "cuda_ipc": {"type": "cuda_ipc"},
    "packed_cuda_ipc": {"type": "packed_cuda_ipc"},
}


@dataclass
class DeltaBenchConfig:
    hidden_size: int = 256
    layers: int = 4
    vocab_size: int = 4096
    steps: int = 5
    lrs: list[float] = field(default_factory=lambda: [1e-5, 1e-6])
    batch: int = 8
    seq_len: int = 64
    strategy: str = "broadcast"
    seed: int = 0


def run(cfg: DeltaBenchConfig) -> dict[str, Any]:
    """Every series; returns the JSON record (``rows``: one per step and learning rate)."""
    import torch

    from weightsync.local import LocalEngineProcess
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="ws-delta-bench-") as root:
        path = build_tiny_causal_lm(
            root, hidden_size=cfg.hidden_size, num_layers=cfg.layers,
            num_heads=max(2, cfg.hidden_size // 64), num_kv_heads=1,
            vocab_size=cfg.vocab_size, seed=cfg.seed)
        model, tok = _trainer(path, cfg.lrs[0])
        metas = [m.to_dict() for m in _manifest(model)]
        engines = [LocalEngineProcess.spawn("weightsync.local.modules:metas_module",
                                            {"metas": metas}, name=name, num_threads=1)
                   for name in ("full", "delta")]
        try:
            rows = asyncio.run(_series_all(cfg, path, engines))
        finally:
            for e in engines:
                e.stop()
    full_bytes = rows[0]["full_bytes"] if rows else 0
    return {
        "date": datetime.date.today().isoformat(), "machine": platform.machine(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "config": asdict(cfg), "model_bytes_bf16": full_bytes,
        "tensors": len(metas), "rows": rows, "summary": _summary(rows),
    }


async def _series_all(cfg: DeltaBenchConfig, path: str, engines: list[Any]) -> list[dict]:
    import weightsync as ws

    strategy = STRATEGIES[cfg.strategy]
    rows: list[dict] = []
    version = 0
    for lr in cfg.lrs:
        model, tok = _trainer(path, lr)
        opt = _optimizer(model, lr)
        async with ws.connect(engines[0], strategy) as full, \
                ws.connect(engines[1], strategy, delta=True) as delta:
            version += 1  # not counted: both engines start from the trainer's weights
            await full.push(model, version=version, dtype="bfloat16")
            await delta.push(model, version=version, dtype="bfloat16")
            for step in range(1, cfg.steps + 1):
                loss = _step(model, tok, opt, cfg, step)
                version += 1
                f = await full.push(model, version=version, dtype="bfloat16")
                d = await delta.push(model, version=version, dtype="bfloat16")
                rows.append({
                    "lr": lr, "step": step, "loss": loss,
                    "full_bytes": f.total_bytes, "full_s": f.seconds,
                    "delta_bytes": d.total_bytes, "delta_s": d.seconds,
                    "delta_encode_s": d.delta["encode_s"],
                    "bytes_ratio": d.total_bytes / f.total_bytes,
                    "changed_fraction": d.delta["changed_fraction"],
                    "encodings": d.delta["encodings"], "fallback": d.delta["fallback"],
                    "exact": await _exact(model, engines[1]),
                })
    return rows


def _trainer(path: str, lr: float) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, AutoTokenizer.from_pretrained(path)


def _optimizer(model: Any, lr: float) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def _step(model: Any, tok: Any, opt: Any, cfg: DeltaBenchConfig, step: int) -> float:
    """One AdamW step on a next-token loss over ``cfg.batch`` texts; returns the loss."""
    from weightsync.testing.tiny_models import corpus

    texts = corpus(cfg.batch, seed=1000 + step)
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True,
                max_length=cfg.seq_len)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _manifest(model: Any) -> list[Any]:
    import torch

    from weightsync.config import build_extractor

    return build_extractor({"type": "hf"}).metadata(model, torch.bfloat16)


async def _exact(model: Any, engine: Any) -> bool:
    import torch

    from weightsync.digest import compare_digests, state_digest

    want = state_digest({m.name: dict(model.named_parameters())[m.name].detach().to(
        torch.bfloat16) for m in _manifest(model)})
    got = await engine.call("state_digest")
    return not compare_digests(want, got)


def _summary(rows: list[dict]) -> list[dict]:
    out = []
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        rs = [r for r in rows if r["lr"] == lr]
        out.append({
            "lr": lr, "steps": len(rs),
            "bytes_ratio_median": statistics.median(r["bytes_ratio"] for r in rs),
            "bytes_ratio_max": max(r["bytes_ratio"] for r in rs),
            "changed_fraction_median": statistics.median(r["changed_fraction"] for r in rs),
            "full_s_median": statistics.median(r["full_s"] for r in rs),
            "delta_s_median": statistics.median(r["delta_s"] for r in rs),
            "all_exact": all(r["exact"] for r in rs),
        })
    return out


def format_table(record: dict[str, Any]) -> str:
    lines = [f"model: {record['tensors']} tensors, {record['model_bytes_bf16'] / 1e6:.2f} MB "
             f"in bf16; strategy {record['config']['strategy']}",
             f"{'lr':>7} {'step':>4} {'loss':>6} {'full MB':>8} {'full s':>7} {'delta MB':>9} "
             f"{'delta s':>8} {'bytes':>7} {'changed':>8} exact  encodings"]
    for r in record["rows"]:
        enc = ", ".join(f"{k} {v}" for k, v in sorted(r["encodings"].items()))
        lines.append(
            f"{r['lr']:>7.0e} {r['step']:>4} {r['loss']:>6.3f} {r['full_bytes'] / 1e6:>8.3f} "
            f"{r['full_s']:>7.4f} {r['delta_bytes'] / 1e6:>9.4f} {r['delta_s']:>8.4f} "
            f"{r['bytes_ratio']:>6.2%} {r['changed_fraction']:>8.2%} {str(r['exact']):5}  {enc}")
    for s in record["summary"]:
        lines.append(
            f"lr {s['lr']:.0e}: delta = {s['bytes_ratio_median']:.2%} of the full bytes (median, "
            f"max {s['bytes_ratio_max']:.2%}), {s['changed_fraction_median']:.2%} of elements "
            f"changed; full {s['full_s_median'] * 1e3:.1f} ms, delta "
            f"{s['delta_s_median'] * 1e3:.1f} ms (medians); exact: {s['all_exact']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", default="1e-5,1e-6", help="comma-separated learning rates")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="broadcast")
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args(argv)
    cfg = DeltaBenchConfig(hidden_size=a.hidden_size, layers=a.layers, vocab_size=a.vocab_size,
                           steps=a.steps, lrs=[float(x) for x in a.lr.split(",")],
                           batch=a.batch, strategy=a.strategy)
    t0 = time.perf_counter()
    record = run(cfg)
    record["wall_s"] = time.perf_counter() - t0
    print(format_table(record))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if all(s["all_exact"] for s in record["summary"]) else 1
