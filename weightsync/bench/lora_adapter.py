"""LoRA adapter-only pushes vs a full push vs vLLM's file-based adapter load, in one run:
``benchmarks/bench_lora_adapter.py``.

A causal LM built here (``weightsync.testing.tiny_models``, Qwen2, nothing downloaded) is served
by one in-process vLLM engine (``enable_lora=True``; float32 on CPU, bf16 on GPU) with the
weightsync worker extension. A PEFT adapter on it (rank ``--rank`` on every linear layer vLLM's
LoRA runtime supports) is trained for real (AdamW on a next-token loss over text). After each
step three ways of getting the new policy into the engine are timed:

* ``adapter``: ``ws.connect([llm], strategy, extractor="lora_adapter").push(model)``, the
  adapter's ``lora_A`` / ``lora_B`` from memory into the LoRA runtime (what users call);
* ``full``: the same session pushing the whole model (the served base weights as a state dict:
  the bytes and the work of a full sync of the merged policy, without changing what the engine
  serves);
* ``vllm_file``: vLLM's own way today: the adapter written with PEFT's ``save_pretrained`` and
  loaded with ``LoRARequest(..., load_inplace=True)`` through ``llm.llm_engine.add_lora``.

Every step also checks that the engine's greedy tokens under the pushed adapter equal the merged
model's in transformers (the same dtype); exits 1 if one did not.
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
from dataclasses import asdict, dataclass
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The model is", "Weights move from"]


@dataclass
class LoRABenchConfig:
    hidden_size: int = 256
    layers: int = 4
    vocab_size: int = 4096
    rank: int = 16
    steps: int = 5
    lr: float = 1e-3
    strategy: str = "broadcast"
    seed: int = 0


def run(cfg: LoRABenchConfig) -> dict[str, Any]:
    import torch
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.loaders.vllm_worker import WORKER_EXTENSION
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    with tempfile.TemporaryDirectory(prefix="ws-lora-bench-") as root:
        path = build_tiny_causal_lm(
            f"{root}/base", hidden_size=cfg.hidden_size, num_layers=cfg.layers,
            num_heads=max(2, cfg.hidden_size // 64), num_kv_heads=1,
            vocab_size=cfg.vocab_size, seed=cfg.seed)
        extra = {} if gpu else {"kv_cache_memory_bytes": 64 << 20}
        llm = LLM(model=path, dtype=str(dtype).removeprefix("torch."), max_model_len=256,
                  enforce_eager=True, worker_extension_cls=WORKER_EXTENSION, seed=0,
                  enable_lora=True, max_lora_rank=max(16, cfg.rank), max_loras=2,
                  max_cpu_loras=4, **extra)
        try:
            rows = asyncio.run(_steps(cfg, llm, path, root, dtype))
        finally:
            shutdown_llm(llm)
    return {
        "date": datetime.date.today().isoformat(), "machine": platform.machine(),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "python": sys.version.split()[0], "torch": torch.__version__,
        "config": asdict(cfg), "dtype": str(dtype), "rows": rows, "summary": _summary(rows),
    }


async def _steps(cfg: LoRABenchConfig, llm: Any, path: str, root: str, dtype: Any) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.lora.request import LoRARequest

    import weightsync as ws

    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(
        "cuda" if torch.cuda.is_available() else "cpu")
    model = get_peft_model(base, LoraConfig(r=cfg.rank, lora_alpha=2 * cfg.rank,
                                            target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    # the full push sends the served base weights (a plain copy: the PEFT model's own names
    # carry adapters), through the same session: one engine takes one sender at a time
    plain = dict(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict())
    strategy = {"type": cfg.strategy} if cfg.strategy != "broadcast" else "broadcast"
    rows: list[dict] = []
    async with ws.connect([llm], strategy, extractor="lora_adapter") as sync:
        await sync.push(model)  # not counted: the first push builds the sender
        await sync.push(plain)
        for step in range(1, cfg.steps + 1):
            loss = _train_step(model, tok, opt, step)
            a = await sync.push(model)
            exact = _greedy(llm, ws.lora_request("policy")) == _hf_greedy(model, tok)
            f = await sync.push(plain)
            t0 = time.perf_counter()
            out = f"{root}/adapter-{step}"
            model.save_pretrained(out)
            llm.llm_engine.add_lora(LoRARequest("file", 99, out, load_inplace=True))
            file_s = time.perf_counter() - t0
            rows.append({"step": step, "loss": loss, "adapter_bytes": a.total_bytes,
                         "adapter_s": a.seconds, "full_bytes": f.total_bytes,
                         "full_s": f.seconds, "vllm_file_s": file_s,
                         "bytes_ratio": a.total_bytes / f.total_bytes, "exact": exact})
    return rows


def _train_step(model: Any, tok: Any, opt: Any, step: int) -> float:
    from weightsync.testing.tiny_models import corpus

    batch = tok(corpus(8, seed=1000 + step), return_tensors="pt", padding=True, truncation=True,
                max_length=64).to(model.device)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _greedy(llm: Any, lora_request: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                        lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_greedy(model: Any, tok: Any) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():  # the PEFT model, adapter on: what the merged policy computes
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids.to(model.device)
            gen = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _summary(rows: list[dict]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("adapter_s", "full_s", "vllm_file_s", "bytes_ratio")}
    return {**{f"{k}_median": v for k, v in med.items()},
            "adapter_bytes": rows[0]["adapter_bytes"], "full_bytes": rows[0]["full_bytes"],
            "full_over_adapter": med["full_s"] / med["adapter_s"],
            "file_over_adapter": med["vllm_file_s"] / med["adapter_s"],
            "all_exact": all(r["exact"] for r in rows)}


def format_table(record: dict[str, Any]) -> str:
    s = record["summary"]
    lines = [f"LoRA rank {record['config']['rank']} on {len(TARGETS)} module kinds x "
             f"{record['config']['layers']} layers, {record['dtype']}, {record['device']}; "
             f"strategy {record['config']['strategy']}",
             f"{'step':>4} {'loss':>6} {'adapter MB':>10} {'adapter ms':>10} {'full MB':>8} "
             f"{'full ms':>8} {'vLLM file ms':>12} {'bytes':>7} exact"]
    for r in record["rows"]:
        lines.append(
            f"{r['step']:>4} {r['loss']:>6.3f} {r['adapter_bytes'] / 1e6:>10.3f} "
            f"{r['adapter_s'] * 1e3:>10.1f} {r['full_bytes'] / 1e6:>8.2f} {r['full_s'] * 1e3:>8.1f} "
            f"{r['vllm_file_s'] * 1e3:>12.1f} {r['bytes_ratio']:>6.2%} {r['exact']}")
    lines.append(
        f"medians: adapter {s['adapter_s_median'] * 1e3:.1f} ms ({s['bytes_ratio_median']:.2%} of "
        f"the full bytes); full push {s['full_s_median'] * 1e3:.1f} ms = "
        f"{s['full_over_adapter']:.1f}x; vLLM file load {s['vllm_file_s_median'] * 1e3:.1f} ms = "
        f"{s['file_over_adapter']:.1f}x; exact: {s['all_exact']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--strategy", choices=["broadcast", "cuda_ipc", "packed_cuda_ipc"],
                   default="broadcast")
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args(argv)
    cfg = LoRABenchConfig(hidden_size=a.hidden_size, layers=a.layers, vocab_size=a.vocab_size,
                          rank=a.rank, steps=a.steps, lr=a.lr, strategy=a.strategy)
    t0 = time.perf_counter()
    record = run(cfg)
    record["wall_s"] = time.perf_counter() - t0
    print(format_table(record))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if record["summary"]["all_exact"] else 1
