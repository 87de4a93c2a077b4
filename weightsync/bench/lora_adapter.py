"""LoRA adapter-only pushes vs a full push vs vLLM's file-based adapter load, in one run:
``benchmarks/bench_lora_adapter.py``.

A Qwen2 causal LM of the given sizes (or a named shape such as ``qwen2-7b``; nothing downloaded)
is served by one in-process vLLM engine (``enable_lora=True``; float32 on CPU, bf16 on GPU,
the engine on the second GPU when there are two) with the weightsync worker extension, started
with dummy weights and sent the trainer's base weights first. A PEFT adapter on the trainer's
model (rank ``--rank`` on every linear layer vLLM's LoRA runtime supports) is trained for real
(AdamW on a next-token loss over seeded token sequences). After each step three ways of getting
the new policy into the engine are timed:

* ``adapter``: ``ws.connect([llm], strategy, extractor="lora_adapter").push(model)``, the
  adapter's ``lora_A`` / ``lora_B`` from memory into the LoRA runtime (what users call);
* ``full``: the same session pushing the whole model (the base weights under their served
  names: the bytes and the work of a full sync of the merged policy, without changing what the
  engine serves);
* ``vllm_file``: vLLM's own way today: the adapter written with PEFT's ``save_pretrained`` and
  loaded with ``LoRARequest(..., load_inplace=True)`` through ``llm.llm_engine.add_lora``.

Each row also says how the engine installed the pushed version (``installed``: the first
version is built by vLLM, later ones are written where vLLM holds the last one:
``weightsync.loaders.vllm_lora_install``). Every step checks that the engine holds the same adapter as vLLM's own file load of it, byte
for byte (``bytes_equal``: the digests of the two ``LoRAModel``s in the worker, every packed
``lora_a`` / ``lora_b`` after vLLM's packing and scaling), and compares greedy tokens: the
pushed adapter's against the file-loaded one's (``file_equal``) and against the PEFT model's
own (``hf_equal``, adapter on). ``exact`` is ``bytes_equal`` and, in float32, both token
checks. In bf16 the token checks are reported only: ``file_repeatable`` says whether the file-
loaded adapter gives the same tokens twice in a row (vLLM's LoRA kernels on a GPU may sum
split-K parts in any order, so a near-tie of random weights can go either way between two
identical requests). Exits 1 if a step is not exact.
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
PROMPTS = [[5, 17, 42, 8, 99], [7, 3, 250, 31]]  # token ids (the engine has no tokenizer)


@dataclass
class LoRABenchConfig:
    hidden_size: int = 256
    layers: int = 4
    vocab_size: int = 4096
    shape: str = ""  # a named shape (weightsync.bench.shapes, qwen2-*) instead of the sizes above
    rank: int = 16
    steps: int = 5
    lr: float = 1e-3
    strategy: str = "broadcast"
    trainer_device: str = ""  # "" : cuda:0 when there is a GPU, else cpu
    engine_device: str = ""  # "" : cuda:1 when there are two GPUs, else the trainer's
    gpu_memory_utilization: float = 0.3
    seed: int = 0


def run(cfg: LoRABenchConfig) -> dict[str, Any]:
    """The engine starts with dummy weights; the trainer's base weights are pushed to it first
    (not timed), so both sides serve the same base before the adapter steps."""
    import torch

    from weightsync.bench.vllm_engine import EngineSpec, start_engine, stop_engine, write_model_dir
    from weightsync.loaders.vllm_worker import WORKER_EXTENSION
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    gpus = torch.cuda.device_count()
    trainer = cfg.trainer_device or ("cuda:0" if gpus else "cpu")
    engine = cfg.engine_device or ("cuda:1" if gpus > 1 else trainer)
    dtype = torch.bfloat16 if trainer.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory(prefix="ws-lora-bench-") as root:
        if cfg.shape:
            path = write_model_dir(cfg.shape, f"{root}/base", str(dtype).removeprefix("torch."))
        else:
            path = build_tiny_causal_lm(
                f"{root}/base", hidden_size=cfg.hidden_size, num_layers=cfg.layers,
                num_heads=max(2, cfg.hidden_size // 64), num_kv_heads=1,
                vocab_size=cfg.vocab_size, seed=cfg.seed)
        llm = start_engine(EngineSpec(
            model_dir=path, device=engine, dtype=str(dtype).removeprefix("torch."),
            extension=WORKER_EXTENSION, gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=256, engine_args={"enable_lora": True,
                                            "max_lora_rank": max(16, cfg.rank),
                                            "max_loras": 2, "max_cpu_loras": 4}))
        try:
            rows, model_bytes = asyncio.run(_steps(cfg, llm, path, root, dtype, trainer))
        finally:
            stop_engine(llm)
    return {
        "date": datetime.date.today().isoformat(), "machine": platform.machine(),
        "device": torch.cuda.get_device_name(0) if gpus else "cpu",
        "trainer_device": trainer, "engine_device": engine,
        "python": sys.version.split()[0], "torch": torch.__version__,
        "config": asdict(cfg), "dtype": str(dtype), "model_bytes": model_bytes, "rows": rows,
        "summary": _summary(rows),
    }


async def _steps(cfg: LoRABenchConfig, llm: Any, path: str, root: str, dtype: Any,
                 device: str) -> tuple[list[dict], int]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.lora.request import LoRARequest

    import weightsync as ws

    torch.manual_seed(cfg.seed)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=cfg.rank, lora_alpha=2 * cfg.rank,
                                            target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    # the full push sends the base weights under their plain names (views, no copy), through
    # the same session: one engine takes one sender at a time
    plain = _base_state(model)
    model_bytes = sum(t.numel() * t.element_size() for t in plain.values())
    strategy = {"type": cfg.strategy} if cfg.strategy != "broadcast" else "broadcast"
    rows: list[dict] = []
    async with ws.connect([llm], strategy, extractor="lora_adapter") as sync:
        await sync.push(plain)  # not counted: the engine now serves the trainer's base
        await sync.push(model)
        for step in range(1, cfg.steps + 1):
            loss = _train_step(model, opt, min(base.config.vocab_size, 1000), step)
            replayed = getattr(sync.sender, "replayed", 0)
            a = await sync.push(model)
            # sent as a replay of the last update (cuda_ipc: the same held chunks, one call)
            replayed = getattr(sync.sender, "replayed", 0) > replayed
            engine_ms = llm.collective_rpc("weightsync_state")[0].get("last_update_ms")
            installed = llm.collective_rpc("weightsync_lora_slot", args=(
                ws.lora_request("policy").lora_int_id,))[0]["installed"]
            pushed = _greedy(llm, ws.lora_request("policy"))
            t0 = time.perf_counter()
            out = f"{root}/adapter-{step}"
            model.save_pretrained(out)
            llm.llm_engine.add_lora(LoRARequest("file", 99, out, load_inplace=True))
            file_s = time.perf_counter() - t0
            from_file = _greedy(llm, LoRARequest("file", 99, out))
            file_equal = pushed == from_file
            file_repeatable = from_file == _greedy(llm, LoRARequest("file", 99, out))
            hf_equal = pushed == _hf_greedy(model)
            bytes_equal, held = _same_adapter(llm, ws.lora_request("policy").lora_int_id, 99)
            rows.append({"step": step, "loss": loss, "adapter_bytes": a.total_bytes,
                         "adapter_s": a.seconds, "vllm_file_s": file_s,
                         "bytes_equal": bytes_equal, "file_equal": file_equal,
                         "file_repeatable": file_repeatable, "hf_equal": hf_equal,
                         "adapter_digest": held,
                         # where the adapter push's time went: the trainer's front door
                         # (SyncStats.front_ms) and the engine's endpoint (worker 0)
                         "front_ms": a.front_ms, "engine_ms": engine_ms,
                         # how worker 0 installed it: "built" by vLLM, or "rewritten[ from
                         # lent views], slot recorded / replayed / set_lora / inactive"
                         # (loaders.vllm_lora_install)
                         "installed": installed, "replayed": replayed,
                         # bf16: the kernels may break a near-tie either way (see the docstring)
                         "exact": bytes_equal and (dtype == torch.bfloat16
                                                   or (file_equal and hf_equal))})
        # the full pushes after the adapter steps, not between them: a full push grows the
        # transfer buffers to the model's size, and the next adapter push would pay for
        # shrinking them (an artefact of alternating, not what a LoRA run does)
        for row in rows:
            f = await sync.push(plain)
            row.update(full_bytes=f.total_bytes, full_s=f.seconds,
                       bytes_ratio=row["adapter_bytes"] / f.total_bytes)
    floor = await rpc_floor_ms(llm)
    for row in rows:
        row["rpc_floor_ms"] = floor
    return rows, model_bytes


async def rpc_floor_ms(llm: Any, calls: int = 30) -> float:
    """The median round trip of one call into the workers that does nothing
    (``weightsync_version``), sent the way a push sends its update (``VLLMWorkers``: through
    vLLM's engine core, from this loop): the floor under any push's time, measured in the same
    run."""
    from weightsync.loaders.vllm_driver import VLLMWorkers

    workers = VLLMWorkers(llm)
    times = []
    for _ in range(calls + 3):
        t0 = time.perf_counter()
        await workers.rpc("weightsync_version", timeout_s=60.0)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def _same_adapter(llm: Any, pushed_id: int, file_id: int) -> tuple[bool, str]:
    """Whether every worker holds the two adapters byte for byte alike
    (``weightsync_lora_digest``), and one hash of what the workers hold of the pushed one."""
    import hashlib

    pushed = llm.collective_rpc("weightsync_lora_digest", args=(pushed_id,))
    loaded = llm.collective_rpc("weightsync_lora_digest", args=(file_id,))
    same = all(p is not None and p == f for p, f in zip(pushed, loaded, strict=True))
    return same, hashlib.blake2b(json.dumps(pushed, sort_keys=True).encode(),
                                 digest_size=8).hexdigest()


def _base_state(model: Any) -> dict[str, Any]:
    """The PEFT model's base weights under the served checkpoint's names."""
    out = {}
    for name, t in model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return out


def _train_step(model: Any, opt: Any, vocab: int, step: int) -> float:
    """One AdamW step of the adapter on a next-token loss over seeded token sequences."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (8, 64), generator=g).to(model.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _greedy(llm: Any, lora_request: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=4, detokenize=False),
                        use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_greedy(model: Any) -> list[list[int]]:
    """The PEFT model itself (adapter on: what the merged policy computes), greedy."""
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            seq = list(p)
            for _ in range(4):
                logits = model(input_ids=torch.tensor([seq], device=model.device)).logits
                seq.append(int(logits[0, -1].argmax()))
            out.append(seq[len(p):])
    return out


def _summary(rows: list[dict]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("adapter_s", "full_s", "vllm_file_s", "bytes_ratio")}
    return {**{f"{k}_median": v for k, v in med.items()},
            "adapter_bytes": rows[0]["adapter_bytes"], "full_bytes": rows[0]["full_bytes"],
            "full_over_adapter": med["full_s"] / med["adapter_s"],
            "rpc_floor_ms": rows[0].get("rpc_floor_ms"),
            "file_over_adapter": med["vllm_file_s"] / med["adapter_s"],
            "all_exact": all(r["exact"] for r in rows)}


def format_table(record: dict[str, Any]) -> str:
    s = record["summary"]
    c = record["config"]
    model = c["shape"] or f"hidden {c['hidden_size']} x {c['layers']} layers"
    lines = [f"LoRA rank {c['rank']} on {len(TARGETS)} module kinds, model {model} "
             f"({record['model_bytes'] / 1e6:.1f} MB), {record['dtype']}, {record['device']} "
             f"(trainer {record['trainer_device']}, engine {record['engine_device']}); "
             f"strategy {c['strategy']}",
             f"{'step':>4} {'loss':>6} {'adapter MB':>10} {'adapter ms':>10} {'full MB':>8} "
             f"{'full ms':>8} {'vLLM file ms':>12} {'bytes':>7} exact"]
    for r in record["rows"]:
        lines.append(
            f"{r['step']:>4} {r['loss']:>6.3f} {r['adapter_bytes'] / 1e6:>10.3f} "
            f"{r['adapter_s'] * 1e3:>10.1f} {r['full_bytes'] / 1e6:>8.2f} {r['full_s'] * 1e3:>8.1f} "
            f"{r['vllm_file_s'] * 1e3:>12.1f} {r['bytes_ratio']:>6.2%} {r['exact']} "
            f"(bytes = file {r['bytes_equal']}; tokens = file {r['file_equal']}, file = "
            f"itself {r['file_repeatable']}, = transformers {r['hf_equal']}; "
            f"{r.get('installed', '')}{'; replayed' if r.get('replayed') else ''})")
    for side in ("front_ms", "engine_ms"):
        parts = [r[side] for r in record["rows"] if r.get(side)]
        if parts:
            lines.append(f"adapter push, {side.removesuffix('_ms')} (ms, median): " + ", ".join(
                f"{k} {statistics.median(p[k] for p in parts):.2f}" for k in parts[0]))
    lines.append(
        f"medians: adapter {s['adapter_s_median'] * 1e3:.1f} ms ({s['bytes_ratio_median']:.2%} of "
        f"the full bytes); full push {s['full_s_median'] * 1e3:.1f} ms = "
        f"{s['full_over_adapter']:.1f}x; vLLM file load {s['vllm_file_s_median'] * 1e3:.1f} ms = "
        f"{s['file_over_adapter']:.1f}x; exact: {s['all_exact']}")
    if s.get("rpc_floor_ms") is not None:
        lines.append(f"floor: one call into the workers that does nothing, through vLLM's "
                     f"engine core as a push sends it: {s['rpc_floor_ms']:.2f} ms (median)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--shape", default="", help="a named shape (qwen2-0.5b, qwen2-7b, ...) "
                   "instead of --hidden-size / --layers / --vocab-size")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--strategy", choices=["broadcast", "cuda_ipc", "packed_cuda_ipc"],
                   default="broadcast")
    p.add_argument("--trainer-device", default="",
                   help="default: cuda:0 when there is a GPU, else cpu")
    p.add_argument("--engine-device", default="",
                   help="default: cuda:1 when there are two GPUs, else the trainer's (the same "
                        "device: the colocated case, for the IPC strategies)")
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args(argv)
    cfg = LoRABenchConfig(hidden_size=a.hidden_size, layers=a.layers, vocab_size=a.vocab_size,
                          shape=a.shape, rank=a.rank, steps=a.steps, lr=a.lr,
                          strategy=a.strategy, trainer_device=a.trainer_device,
                          engine_device=a.engine_device)
    t0 = time.perf_counter()
    record = run(cfg)
    record["wall_s"] = time.perf_counter() - t0
    print(format_table(record))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if record["summary"]["all_exact"] else 1
