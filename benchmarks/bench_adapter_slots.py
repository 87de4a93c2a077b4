"""An adapter update while a request of that adapter runs: one version slot vs two
(``serve-policy --adapter-slots``), one run.

    python benchmarks/bench_adapter_slots.py [--rounds 5] [--stream-tokens 200] [--json PATH]

Two policy servers (``weightsync serve-policy --enable-lora --max-loras 2``) of one tiny causal
LM built in code, alive together: one with ``--adapter-slots 1`` (the default: an adapter
update rewrites the adapter, so it waits for the adapter's requests in flight and holds new
ones back), one with ``--adapter-slots 2`` (each version in the next of two slots). The trainer
is a PEFT model on the same weights pushing only its adapter through the front door
(``ws.connect(url, "broadcast", extractor="lora_adapter")``, one session per server, kept open).

Each round, on each server in turn (rows alternate, so load on a shared machine shifts both
alike): a greedy stream of ``--stream-tokens`` tokens of the adapter starts; once its first
tokens arrived, the next adapter version is pushed and, right after the push began, a new
one-token request of the adapter is sent. Timed: the push (``push`` to its return), the new
request (sent to answered), and how long the stream still ran after the push returned (< 0:
the push returned after the stream ended, i.e. it waited for it). A row's time is the median
of its rounds after one warm-up round. Checked every round: the push's version is the server's,
the stream's tokens all carry the one version it started on, and the new request reports the
version it ran on: with one slot the new one (it was held back until the update landed), with
two the one serving when it came (the old one until the update landed).
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
import threading
import time
from typing import Any

API_KEY = "bench-token"
PROMPT = "Weights move from the trainer to"
SLOTS = (1, 2)


def start(model_dir: str, scratch: str, slots: int) -> Any:
    import torch

    from weightsync._runtime.cpu_binding import ENGINE_CORE_CPUS_ENV, FOLLOW_WORKERS
    from weightsync.testing.servers import PolicyServerProcess, cpu_core_slots

    # on a GPU both servers share it: each takes a small share (its KV cache is 64 MiB anyway);
    # on CPU each gets cores of its own (vLLM would bind both workers to the same ones)
    gpu = ["--gpu-memory-utilization", "0.15"] if torch.cuda.is_available() else []
    cores = None if gpu else cpu_core_slots(len(SLOTS))[SLOTS.index(slots)]
    # on CPU its engine core on its worker's cores: left free it busy-waits on the core this
    # process needs (weightsync/_runtime/cpu_binding.py)
    env = None if gpu else {ENGINE_CORE_CPUS_ENV: FOLLOW_WORKERS}
    server = PolicyServerProcess(
        model_dir, scratch_dir=scratch, cpu_cores=cores, env=env, extra_args=[
            "--api-key", API_KEY, "--max-model-len", "512", "--log-level", "warning",
            "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "base",
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "2",
            "--adapter-slots", str(slots), *gpu])
    server.start()
    server.wait_healthy(timeout_s=600, progress=lambda m: print(f"  [slots {slots}] {m}",
                                                                   file=sys.stderr))
    return server


def peft_policy(model_dir: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "up_proj"]))


def next_version(model: Any, step: int) -> None:
    """A training step's worth of change: new values in every ``lora_B``."""
    import torch

    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


class Row:
    """One server, its ``ws.connect`` session (on a loop of its own), its timings."""

    def __init__(self, url: str, slots: int, model: Any) -> None:
        import weightsync as ws

        self.url, self.slots, self.model = url, slots, model
        self.loop = asyncio.new_event_loop()
        self.sync = self.loop.run_until_complete(_opened(ws.connect(
            [url], "broadcast", api_key=API_KEY, timeout_s=600,
            extractor={"type": "lora_adapter", "adapter_name": "policy"})))
        self.times: dict[str, list[float]] = {"push_s": [], "new_request_s": [],
                                              "stream_after_push_s": []}

    def push(self) -> Any:
        return self.loop.run_until_complete(self.sync.push(self.model))

    def round(self, step: int, stream_tokens: int) -> dict[str, float]:
        import httpx

        next_version(self.model, step)
        out: dict[str, Any] = {}
        started = threading.Event()

        def stream() -> None:
            body = {"model": "policy", "prompt": PROMPT, "max_tokens": stream_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            versions = set()
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        versions.add(json.loads(line[6:]).get("weight_version"))
                        started.set()
            out["stream_versions"], out["stream_end"] = versions, time.perf_counter()
            started.set()

        def new_request() -> None:
            t0 = time.perf_counter()
            r = httpx.post(self.url + "/v1/completions", timeout=600, json={
                "model": "policy", "prompt": "hi", "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            out["new_request_s"] = time.perf_counter() - t0
            out["new_request_version"] = r.json().get("weight_version")

        reader = threading.Thread(target=stream)
        reader.start()
        if not started.wait(300) or "stream_end" in out:
            raise RuntimeError(f"slots {self.slots}: the stream did not run")
        asker = threading.Timer(0.005, new_request)  # just after the push began
        t0 = time.perf_counter()
        asker.start()
        stats = self.push()
        pushed = time.perf_counter()
        asker.join(600)
        reader.join(600)
        (version,) = stats.versions
        served = int(httpx.get(self.url + "/runtime_version", timeout=30).json()["version"])
        if served != version or out["stream_versions"] != {version - 1}:
            raise RuntimeError(f"slots {self.slots}: pushed {version}, server at {served}, the "
                               f"stream's versions {out['stream_versions']}")
        # one slot: held back until the update landed; two: the version serving when it came
        allowed = {version} if self.slots == 1 else {version - 1, version}
        if out["new_request_version"] not in allowed:
            raise RuntimeError(f"slots {self.slots}: a request sent during the push got version "
                               f"{out['new_request_version']}, expected one of {allowed}")
        return {"push_s": pushed - t0, "new_request_s": out["new_request_s"],
                "stream_after_push_s": out["stream_end"] - pushed}

    def close(self) -> None:
        self.loop.run_until_complete(self.sync.close())
        self.loop.close()


async def _opened(connecting: Any) -> Any:
    return await connecting


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from weightsync.testing.tiny_models import build_tiny_causal_lm

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_causal_lm(os.path.join(tmp, "model"), seed=0)
        servers: dict[int, Any] = {}
        rows: dict[int, Row] = {}
        try:
            for slots in SLOTS:
                print(f"[slots {slots}] starting the server ...", file=sys.stderr)
                servers[slots] = start(model_dir, tmp, slots)
                rows[slots] = Row(servers[slots].url, slots, peft_policy(model_dir))
                rows[slots].push()  # version 1 serves before the first round
            for rnd in range(args.rounds + 1):  # round 0 warms up; rows alternate every round
                for slots, row in rows.items():
                    got = row.round(rnd, args.stream_tokens)
                    print(f"  round {rnd} slots {slots}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in got.items()), file=sys.stderr)
                    if rnd:
                        for k, v in got.items():
                            row.times[k].append(v)
        finally:
            for row in rows.values():
                try:
                    row.close()
                except Exception as e:  # noqa: BLE001 - the servers go down next anyway
                    print(f"closing a session: {e}", file=sys.stderr)
            for server in servers.values():
                server.stop()
    out_rows = [{"adapter_slots": slots, **{k: statistics.median(v) for k, v in row.times.items()},
                 "times": row.times} for slots, row in rows.items()]
    ref = out_rows[0]
    for r in out_rows:
        r["push_ratio_vs_one_slot"] = r["push_s"] / ref["push_s"]
        r["new_request_ratio_vs_one_slot"] = r["new_request_s"] / ref["new_request_s"]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "command": "python benchmarks/bench_adapter_slots.py " + " ".join(sys.argv[1:]),
        "stream_tokens": args.stream_tokens, "rounds": args.rounds, "rows": out_rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"an adapter push while a {result['stream_tokens']}-token stream of the adapter runs; "
        f"median of {result['rounds']} alternating rounds after a warm-up",
        "",
        "| adapter slots | push s | vs 1 slot | new request s | vs 1 slot | stream ran on after "
        "the push s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['adapter_slots']} | {r['push_s']:.3f} | "
                     f"{r['push_ratio_vs_one_slot']:.2f} | {r['new_request_s']:.3f} | "
                     f"{r['new_request_ratio_vs_one_slot']:.2f} | "
                     f"{r['stream_after_push_s']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    p.add_argument("--stream-tokens", type=int, default=200,
                   help="tokens of the adapter's stream in flight (200)")
    p.add_argument("--json", dest="json_path", help="write the result here")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not 1 <= args.stream_tokens <= 480:
        p.error("--stream-tokens must be in 1..480 (the servers' --max-model-len is 512)")
    result = run(args)
    print(table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
