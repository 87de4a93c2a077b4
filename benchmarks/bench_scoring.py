"""Reward-scoring throughput: reward server + client vs vLLM offline vs transformers, one run.

    python benchmarks/bench_scoring.py [--size tiny|small] [--num-texts 256]
        [--batch-sizes 1,16,64] [--repeats 3] [--json PATH] [--markdown]

On the same tiny reward model (built in a temp dir, nothing downloaded), same texts, same
machine, in this order:

1. ``transformers``: the HF forward, batched, ``no_grad``, fp32 (the reference: ratio 1.0);
2. ``server+client``: ``python -m weightsync.reward.server`` as a subprocess and
   ``VLLMRewardClient.score_batch`` over HTTP on 127.0.0.1, batches of N sent one after
   another, and the same batches sent concurrently (``asyncio.gather``), which is how a
   batched scorer drives it;
3. ``vllm-offline``: ``LLM.classify(texts, PoolingParams(use_activation=False))`` in this
   process (vLLM schedules the whole list itself, so batch size is n/a).

Every method's scores are checked against transformers (max abs error in the table), so a fast
but wrong path shows. Seconds are the median of ``--repeats`` timed runs after one warm-up.
``--size small`` (hidden 256, 4 layers) gives the engine enough work per token for the ratio to
mean something; ``tiny`` (hidden 64, 2 layers) is the demo's model, where fixed per-request cost
dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
}


def make_texts(n: int, seed: int = 0) -> list[str]:
    from weightsync.demo_data import make_pairs, pair_texts

    chosen, rejected = pair_texts(make_pairs((n + 1) // 2, seed=seed))
    return (chosen + rejected)[:n]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """One warm-up call, then the median of ``repeats`` timed calls -> (seconds, last result)."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def max_err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def record(method: str, batch: int | str, n: int, seconds: float, scores: list[float],
           ref: list[float] | None) -> dict[str, Any]:
    return {
        "method": method, "batch_size": batch, "num_texts": n, "seconds": seconds,
        "texts_per_s": n / seconds, "max_abs_err_vs_hf": max_err(scores, ref) if ref else 0.0,
    }


# --------------------------------------------------------------------------------------------


def bench_transformers(model_dir: str, texts: list[str], batch_sizes: list[int], repeats: int,
                       progress: Callable[[str], None]) -> tuple[list[dict], list[float]]:
    from weightsync.demo_train import hf_scores, load_reward_model

    model, tok = load_reward_model(model_dir)
    ref = hf_scores(model, tok, texts, batch_size=max(batch_sizes))
    recs = []
    for bs in batch_sizes:
        sec, scores = timed(lambda bs=bs: hf_scores(model, tok, texts, batch_size=bs), repeats)
        recs.append(record("transformers", bs, len(texts), sec, scores, ref))
        progress(f"transformers  batch {bs:>4}: {len(texts) / sec:9.1f} texts/s")
    return recs, ref


def bench_server(model_dir: str, texts: list[str], batch_sizes: list[int], repeats: int,
                 ref: list[float], scratch: str, progress: Callable[[str], None]) -> list[dict]:
    from weightsync.demo_server import RewardServerProcess
    from weightsync.reward.client import VLLMRewardClient

    recs = []
    with RewardServerProcess(
        model_dir, scratch_dir=scratch, extra_args=["--max-model-len", "256"]
    ) as server:
        waited = server.wait_healthy(progress=progress)
        progress(f"reward server healthy after {waited:.1f}s")

        async def run_all() -> None:
            client = VLLMRewardClient(server.host, server.port, enable_weight_updates=False)

            def scores_of(res: list[float]) -> list[float]:
                return [float(s) for s in res]

            async def sequential(bs: int) -> list[float]:
                out: list[float] = []
                for i in range(0, len(texts), bs):
                    out += scores_of(await client.score_batch(texts[i : i + bs]))
                return out

            async def concurrent(bs: int) -> list[float]:
                parts = await asyncio.gather(
                    *(client.score_batch(texts[i : i + bs]) for i in range(0, len(texts), bs))
                )
                return [s for p in parts for s in scores_of(p)]

            try:
                for name, fn in (("server+client", sequential), ("server+client concurrent", concurrent)):
                    for bs in batch_sizes:
                        if name.endswith("concurrent") and bs >= len(texts):
                            continue  # one batch: same as sequential
                        await fn(bs)  # warm-up
                        times, scores = [], []
                        for _ in range(repeats):
                            t0 = time.perf_counter()
                            scores = await fn(bs)
                            times.append(time.perf_counter() - t0)
                        sec = statistics.median(times)
                        recs.append(record(name, bs, len(texts), sec, scores, ref))
                        progress(f"{name:<24} batch {bs:>4}: {len(texts) / sec:9.1f} texts/s")
            finally:
                await client.close()

        asyncio.run(run_all())
    return recs


def bench_offline(model_dir: str, texts: list[str], repeats: int, ref: list[float],
                  progress: Callable[[str], None]) -> list[dict]:
    from vllm import LLM, PoolingParams

    progress("starting vLLM offline engine (LLM, runner=pooling)")
    llm = LLM(
        model=model_dir, runner="pooling", dtype="float32", max_model_len=256,
        kv_cache_memory_bytes=256 << 20, enforce_eager=True, seed=0,
    )
    params = PoolingParams(use_activation=False)

    def run() -> list[float]:
        outs = llm.classify(texts, pooling_params=params, use_tqdm=False)
        return [float(o.outputs.probs[0]) for o in outs]

    sec, scores = timed(run, repeats)
    progress(f"vllm-offline  classify  : {len(texts) / sec:9.1f} texts/s")
    return [record("vllm-offline LLM.classify", "all", len(texts), sec, scores, ref)]


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="transformers,server,offline",
                   help="comma-separated subset of transformers,server,offline")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the transformers forward")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = p.parse_args(argv)

    import torch

    from weightsync.demo_report import Progress, format_markdown_table, format_table
    from weightsync.tiny_models import build_tiny_reward_model

    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    methods = set(args.methods.split(","))
    progress = Progress(stream=sys.stderr)
    load_start = list(os.getloadavg())  # other work on the machine skews every figure
    texts = make_texts(args.num_texts)
    recs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-scoring-") as scratch:
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(scratch, "vllm-cache"))
        os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(scratch, "vllm-rpc"))
        os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
        model_dir = build_tiny_reward_model(os.path.join(scratch, "model"), **SIZES[args.size])
        progress(f"model {args.size} {SIZES[args.size]}, {len(texts)} texts")
        hf_recs, ref = bench_transformers(model_dir, texts, batch_sizes, args.repeats, progress)
        if "transformers" in methods:
            recs += hf_recs
        if "server" in methods:
            recs += bench_server(model_dir, texts, batch_sizes, args.repeats, ref, scratch, progress)
        if "offline" in methods:
            recs += bench_offline(model_dir, texts, args.repeats, ref, progress)

    best_hf = max(r["texts_per_s"] for r in hf_recs)
    for r in recs:
        r["ratio_vs_transformers"] = r["texts_per_s"] / best_hf
        r["size"] = args.size
    headers = ("method", "batch", "texts/s", "ms/text", "ratio vs HF", "max|err| vs HF")
    rows = [
        (r["method"], str(r["batch_size"]), round(r["texts_per_s"], 1),
         round(1e3 / r["texts_per_s"], 3), round(r["ratio_vs_transformers"], 2),
         r["max_abs_err_vs_hf"])
        for r in recs
    ]
    meta = {
        "date": datetime.date.today().isoformat(), "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "command": "python benchmarks/bench_scoring.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "size": args.size, "model": SIZES[args.size], "num_texts": len(texts),
        "reference": "transformers forward, best batch size",
        "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
        "torch_threads": args.threads,
    }
    print(f"scoring throughput, {args.size} model {SIZES[args.size]}, {len(texts)} texts; "
          f"ratio vs the best transformers batch ({best_hf:.1f} texts/s); load average "
          f"{load_start[0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end")
    print(format_table(headers, rows))
    if args.markdown:
        print()
        print(format_markdown_table(headers, rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=2)
        progress(f"wrote {args.json_path}")
    bad = [r for r in recs if r["max_abs_err_vs_hf"] > 1e-4]
    if bad:
        print(f"WARNING: {len(bad)} method(s) disagree with transformers by > 1e-4", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
