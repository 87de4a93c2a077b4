"""Reward-scoring throughput: reward server + client vs vLLM offline vs transformers, one run.

    python benchmarks/bench_scoring.py [--size tiny|small] [--num-texts 256]
        [--batch-sizes 1,16,64] [--repeats 3] [--json PATH] [--markdown]

On the same tiny reward model (built in a temp dir, nothing downloaded), same texts, same
machine, in this order:

1. ``transformers``: the HF forward, batched, ``no_grad``, fp32, swept over batch sizes and
   torch thread counts (1 and all cores); its best configuration is the reference;
2. ``server+client``: ``python -m weightsync.servers.reward`` as a subprocess and
   ``VLLMRewardClient.score_batch`` over HTTP on 127.0.0.1, batches of N sent one after
   another, and the same batches in flight together (``asyncio.gather``), which is how a
   batched scorer (``RewardModelScorer``) drives it;
3. ``vllm-offline``: ``LLM.classify(texts, PoolingParams(use_activation=False))`` in this
   process (vLLM schedules the whole list itself, so batch size is n/a).

The reference is re-measured right before every other row (same load, same moment) and each
row's ratio is against that adjacent measurement, so other work on a shared machine shifts both
sides alike. Every method's scores are checked against transformers (max abs error column): a
fast but wrong path shows. Seconds are the median of ``--repeats`` timed runs after a warm-up.
``--size small`` (hidden 256, 4 layers) gives the engine more work per token; ``tiny`` (hidden
64, 2 layers) is the demo's model, where fixed per-request costs dominate.
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
from collections.abc import Awaitable, Callable
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
}
SERVER_ARGS = ["--max-model-len", "256"]


def make_texts(n: int, seed: int = 0) -> list[str]:
    from weightsync.demo.data import make_pairs, pair_texts

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


async def atimed(fn: Callable[[], Awaitable[Any]], repeats: int) -> tuple[float, Any]:
    out = await fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def max_err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


class TransformersReference:
    """The HF forward on ``texts``: swept once, then re-measured at its best configuration."""

    def __init__(self, model_dir: str, texts: list[str], repeats: int) -> None:
        from weightsync.demo.train import load_reward_model

        self.model, self.tok = load_reward_model(model_dir)
        self.texts, self.repeats = texts, repeats
        self.best: tuple[int, int] = (1, 16)  # (threads, batch size)
        self.best_batch: dict[int, int] = {}  # threads -> best batch size
        self.scores: list[float] = []

    def run(self, threads: int, batch_size: int) -> tuple[float, list[float]]:
        import torch

        from weightsync.demo.train import hf_scores

        torch.set_num_threads(threads)
        return timed(lambda: hf_scores(self.model, self.tok, self.texts, batch_size=batch_size),
                     self.repeats)

    def sweep(self, batch_sizes: list[int], progress: Callable[[str], None]) -> list[dict]:
        recs = []
        for threads in sorted({1, os.cpu_count() or 1}):
            for bs in batch_sizes:
                sec, scores = self.run(threads, bs)
                self.scores = self.scores or scores
                recs.append({
                    "method": f"transformers ({threads} thr)", "batch_size": bs,
                    "threads": threads, "seconds": sec, "texts_per_s": len(self.texts) / sec,
                    "max_abs_err_vs_hf": max_err(scores, self.scores),
                })
                progress(f"transformers threads {threads} batch {bs:>4}: "
                         f"{len(self.texts) / sec:9.1f} texts/s")
        best = max(recs, key=lambda r: r["texts_per_s"])
        self.best = (best["threads"], best["batch_size"])
        for r in sorted(recs, key=lambda r: r["texts_per_s"]):
            self.best_batch[r["threads"]] = r["batch_size"]
        for r in recs:
            r["reference_texts_per_s"] = best["texts_per_s"]
        return recs

    def measure(self) -> float:
        """texts/s of the best thread count (each at its best batch size), now.

        Both thread counts are tried again because the best one depends on what else runs: an
        idle vLLM engine next door makes a 2-thread OpenMP forward many times slower, a quiet
        machine favours it."""
        return max(len(self.texts) / self.run(t, bs)[0] for t, bs in self.best_batch.items())


def row(method: str, batch: int | str, texts: list[str], seconds: float, scores: list[float],
        ref: TransformersReference) -> dict[str, Any]:
    return {
        "method": method, "batch_size": batch, "seconds": seconds,
        "texts_per_s": len(texts) / seconds, "max_abs_err_vs_hf": max_err(scores, ref.scores),
    }


# --------------------------------------------------------------------------------------------


def bench_server(model_dir: str, texts: list[str], batch_sizes: list[int], repeats: int,
                 ref: TransformersReference, scratch: str,
                 progress: Callable[[str], None]) -> list[dict]:
    from weightsync.reward.client import VLLMRewardClient
    from weightsync.testing.servers import RewardServerProcess

    recs = []
    with RewardServerProcess(model_dir, scratch_dir=scratch, extra_args=SERVER_ARGS) as server:
        waited = server.wait_healthy(progress=progress)
        progress(f"reward server healthy after {waited:.1f}s")

        async def run_all() -> None:
            async with VLLMRewardClient(
                server.host, server.port, enable_weight_updates=False
            ) as client:

                async def sequential(bs: int) -> list[float]:
                    out: list[float] = []
                    for i in range(0, len(texts), bs):
                        out += await client.score_batch(texts[i : i + bs], normalize=False)
                    return out

                async def concurrent(bs: int) -> list[float]:
                    parts = await asyncio.gather(
                        *(client.score_batch(texts[i : i + bs], normalize=False) for i in range(0, len(texts), bs))
                    )
                    return [s for p in parts for s in p]

                for name, fn in (("server+client", sequential),
                                 ("server+client concurrent", concurrent)):
                    for bs in batch_sizes:
                        if name.endswith("concurrent") and bs >= len(texts):
                            continue  # a single batch: the same as sequential
                        reference = ref.measure()
                        sec, scores = await atimed(lambda fn=fn, bs=bs: fn(bs), repeats)
                        r = row(name, bs, texts, sec, scores, ref)
                        r["reference_texts_per_s"] = reference
                        recs.append(r)
                        progress(f"{name:<24} batch {bs:>4}: {r['texts_per_s']:9.1f} texts/s "
                                 f"(reference {reference:.1f})")

        asyncio.run(run_all())
    return recs


def bench_offline(model_dir: str, texts: list[str], repeats: int, ref: TransformersReference,
                  progress: Callable[[str], None]) -> list[dict]:
    # this process has run multi-threaded torch (the reference): a forked engine process would
    # inherit a dead OpenMP pool and hang, so vLLM must spawn
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
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

    try:
        reference = ref.measure()
        sec, scores = timed(run, repeats)
    finally:  # a live engine core keeps the interpreter from exiting
        llm.llm_engine.engine_core.shutdown()
    r = row("vllm-offline LLM.classify", "all", texts, sec, scores, ref)
    r["reference_texts_per_s"] = reference
    progress(f"vllm-offline classify: {r['texts_per_s']:9.1f} texts/s (reference {reference:.1f})")
    return [r]


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="server,offline",
                   help="comma-separated subset of server,offline (transformers always runs)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = p.parse_args(argv)

    from weightsync.demo.report import Progress, format_markdown_table, format_table
    from weightsync.testing.tiny_models import build_tiny_reward_model

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    methods = set(args.methods.split(","))
    progress = Progress(stream=sys.stderr)
    load_start = list(os.getloadavg())  # other work on the machine skews absolute figures
    texts = make_texts(args.num_texts)
    recs: list[dict] = []
    from weightsync.testing.servers import signals_raise_system_exit

    with signals_raise_system_exit(), tempfile.TemporaryDirectory(prefix="bench-scoring-") as scratch:
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(scratch, "vllm-cache"))
        os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(scratch, "vllm-rpc"))
        os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
        model_dir = build_tiny_reward_model(os.path.join(scratch, "model"), **SIZES[args.size])
        progress(f"model {args.size} {SIZES[args.size]}, {len(texts)} texts")
        ref = TransformersReference(model_dir, texts, args.repeats)
        recs += ref.sweep(batch_sizes, progress)
        if "server" in methods:
            recs += bench_server(model_dir, texts, batch_sizes, args.repeats, ref, scratch,
                                 progress)
        if "offline" in methods:
            recs += bench_offline(model_dir, texts, args.repeats, ref, progress)

    for r in recs:
        r["ratio_vs_transformers"] = r["texts_per_s"] / r["reference_texts_per_s"]
        r["num_texts"], r["size"] = len(texts), args.size
    headers = ("method", "batch", "texts/s", "ms/text", "reference texts/s", "ratio",
               "max abs err vs HF")
    rows = [
        (r["method"], str(r["batch_size"]), round(r["texts_per_s"], 1),
         round(1e3 / r["texts_per_s"], 3), round(r["reference_texts_per_s"], 1),
         round(r["ratio_vs_transformers"], 2), r["max_abs_err_vs_hf"])
        for r in recs
    ]
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "command": "python benchmarks/bench_scoring.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "size": args.size, "model": SIZES[args.size], "num_texts": len(texts),
        "reference": "transformers forward at its best (threads, batch size), re-measured "
                     "(both thread counts) right before each row",
        "best_transformers_config": {"threads": ref.best[0], "batch_size": ref.best[1]},
        "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
    }
    print(f"scoring throughput, {args.size} model {SIZES[args.size]}, {len(texts)} texts; "
          f"reference: transformers, {ref.best[0]} thread(s), batch {ref.best[1]}; load average "
          f"{load_start[0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end")
    print(format_table(headers, rows))
    if args.markdown:
        print()
        print(format_markdown_table(headers, rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=2)
        progress(f"wrote {args.json_path}")
    bad = [r["method"] for r in recs if r["max_abs_err_vs_hf"] > 1e-4]
    if bad:
        print(f"WARNING: {bad} disagree with transformers by > 1e-4", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
