"""A push to the policy server vs a push of the same bytes to the reward server, one run.

    python benchmarks/bench_servers.py [--shape qwen2-0.5b] [--dtype bfloat16] [--repeats 5]
        [--bucket-mb 256] [--no-ludic] [--json PATH]

Both servers serve the same backbone (a Qwen2 of the named shape, ``weightsync.bench.shapes``):
the policy server (``weightsync serve-policy``) as ``Qwen2ForCausalLM`` (tied embeddings, so
its whole state is the backbone), the reward server (``weightsync serve-reward``) as
``Qwen2ForSequenceClassification``. Neither loads a checkpoint (vLLM ``load_format=dummy``,
``config.json`` and a tiny tokenizer only); the servers check every push against the names and
shapes the config implies. The trainer pushes the backbone's tensors (``model.*``, random, in
``--dtype``) through the front door (``ws.connect(url, strategy=broadcast over gloo).push``) to
both servers (alive together), in rounds that alternate the rows, so load on a shared machine
shifts every row alike: one warm-up round, then ``--repeats`` timed rounds; a row's time is the
median of its pushes. The reward row is the reference: the policy row's ratio is against it
(target: <= 1.5). With ``--ludic`` (default) a third row pushes the same tensors into the policy
server the way a Ludic/TRL trainer does (plain HTTP, a gloo group, one broadcast per tensor; see
``docs/policy_server.md``), in rounds of its own that alternate with more reward pushes (a
server serves one sender at a time).

Every push is checked: the server reports the pushed version afterwards. Timings include the
whole update as the trainer sees it (validation, transfer, loading, prefix-cache reset).
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
from typing import Any

API_KEY = "bench-token"


# --------------------------------------------------------------------------------------------
# model directories (config + tokenizer, no weights)
# --------------------------------------------------------------------------------------------


def write_dirs(shape: str, root: str, dtype: str) -> tuple[str, str]:
    """-> (policy dir, reward dir) of the same backbone."""
    from weightsync.bench.vllm_engine import write_model_dir
    from weightsync.testing.tiny_models import build_tokenizer

    tok = build_tokenizer()
    policy = write_model_dir(shape, os.path.join(root, "policy"), dtype=dtype, max_positions=512)
    reward = os.path.join(root, "reward")
    os.makedirs(reward, exist_ok=True)
    with open(os.path.join(policy, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=["Qwen2ForSequenceClassification"], num_labels=1,
               pad_token_id=tok.pad_token_id)
    with open(os.path.join(reward, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for d in (policy, reward):
        tok.save_pretrained(d)
    return policy, reward


def backbone_state(shape: str, dtype: str) -> dict[str, Any]:
    """The backbone tensors (``model.*``) with random values: what both servers take."""
    from weightsync.bench.shapes import build_module

    module = build_module(shape=shape, dtype=dtype, seed=0)
    return {n: t for n, t in module.state_dict().items() if n.startswith("model.")}


# --------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------


def start(kind: str, model_dir: str, scratch: str, dtype: str) -> Any:
    from weightsync.testing.servers import RewardServerProcess

    common = ["--api-key", API_KEY, "--max-model-len", "256", "--log-level", "warning"]
    if kind == "policy":
        module = "weightsync.servers.policy"
        extra = [*common, "--dtype", dtype, "--load-format", "dummy",
                 "--kv-cache-memory-bytes", str(64 << 20)]
    else:
        module = "weightsync.servers.reward"
        preset = os.path.join(scratch, "reward.yaml")
        with open(preset, "w") as f:
            f.write("extra_engine_args:\n  load_format: dummy\n")
        extra = [*common, "--dtype", dtype, "--config", preset,
                 "--kv-cache-memory-bytes", str(64 << 20)]
    server = RewardServerProcess(model_dir, scratch_dir=scratch, module=module, extra_args=extra)
    server.start()
    server.wait_healthy(timeout_s=600, progress=lambda m: print(f"  [{kind}] {m}",
                                                                   file=sys.stderr))
    return server


def runtime_version(url: str) -> int:
    import httpx

    return int(httpx.get(url + "/runtime_version", timeout=30).json()["version"])


# --------------------------------------------------------------------------------------------
# pushes
# --------------------------------------------------------------------------------------------


class FrontDoorPusher:
    """One ``ws.connect`` session to one server; ``push()`` -> seconds of one checked push."""

    def __init__(self, url: str, state: dict, bucket_mb: float) -> None:
        import weightsync as ws

        self.url, self.state = url, state
        strategy = {"type": "broadcast", "backend": "gloo", "bucket_size_mb": bucket_mb,
                    "timeout_s": 600}
        self.loop = asyncio.new_event_loop()  # the session lives on this one loop
        self.sync = self.loop.run_until_complete(_opened(ws.connect(
            [url], strategy=strategy, api_key=API_KEY, timeout_s=600)))

    def push(self) -> float:
        version = runtime_version(self.url) + 1
        t0 = time.perf_counter()
        stats = self.loop.run_until_complete(self.sync.push(self.state, version=version))
        dt = time.perf_counter() - t0
        if stats.versions != [version] or runtime_version(self.url) != version:
            raise RuntimeError(f"{self.url}: pushed version {version}, server reports "
                               f"{stats.versions} / {runtime_version(self.url)}")
        return dt

    def close(self) -> None:
        self.loop.run_until_complete(self.sync.close())
        self.loop.close()


async def _opened(connecting: Any) -> Any:
    return await connecting


class LudicPusher:
    """What a Ludic/TRL trainer does (CPU: a gloo group); ``push()`` -> seconds."""

    def __init__(self, url: str, state: dict) -> None:
        import httpx
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        from weightsync.testing.servers import free_port

        self.url, self.state = url, state
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=600)
        workers = self.http.get("/get_world_size").raise_for_status().json()["world_size"]
        self.rank, world = workers, workers + 1
        port = free_port()
        self.http.post("/init_communicator", json={"host": "127.0.0.1", "port": port,
                                                   "world_size": world}).raise_for_status()
        self.pg = stateless_init_torch_distributed_process_group("127.0.0.1", port, self.rank,
                                                                 world, backend="gloo")
        self.names = sorted(state)
        self.metadata = [{"name": n, "dtype": str(state[n].dtype), "shape": list(state[n].shape)}
                         for n in self.names]

    def push(self) -> float:
        version = runtime_version(self.url) + 1
        t0 = time.perf_counter()
        self.http.post("/update_param_batch", json={"metadata": self.metadata, "version": version}
                       ).raise_for_status()
        for n in self.names:
            self.pg.broadcast(self.state[n].contiguous(), root=self.rank).wait()
        self.pg.barrier().wait()
        while self.http.post("/get_num_background_tasks").json()["num_background_tasks"]:
            time.sleep(0.01)
        dt = time.perf_counter() - t0
        if runtime_version(self.url) != version:
            raise RuntimeError(f"{self.url}: Ludic push of version {version} did not land")
        return dt

    def close(self) -> None:
        self.http.post("/close_communicator", json={})
        self.http.close()


# --------------------------------------------------------------------------------------------
# run + report
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # the other core is the servers'
    state = backbone_state(args.shape, args.dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        policy_dir, reward_dir = write_dirs(args.shape, tmp, args.dtype)
        servers: dict[str, Any] = {}
        pushers: dict[tuple[str, str], Any] = {}

        def rounds(keys: list[tuple[str, str]]) -> None:
            for rnd in range(args.repeats + 1):  # round 0 warms up; rows alternate every round
                for key in keys:
                    dt = pushers[key].push()
                    print(f"  round {rnd} {key[0]:6s} {key[1]:13s} {dt:.2f} s", file=sys.stderr)
                    if rnd:
                        times.setdefault(key, []).append(dt)

        try:
            for kind, model_dir in (("reward", reward_dir), ("policy", policy_dir)):
                print(f"[{kind}] starting the server ...", file=sys.stderr)
                servers[kind] = start(kind, model_dir, tmp, args.dtype)
                pushers[(kind, "front door")] = FrontDoorPusher(servers[kind].url, state,
                                                                args.bucket_mb)
            rounds([("reward", "front door"), ("policy", "front door")])
            if args.ludic:  # a server has one sender at a time: the session leaves first
                pushers.pop(("policy", "front door")).close()
                pushers[("policy", "ludic trainer")] = LudicPusher(servers["policy"].url, state)
                rounds([("reward", "front door"), ("policy", "ludic trainer")])
        finally:
            for pusher in pushers.values():
                try:
                    pusher.close()
                except Exception as e:  # noqa: BLE001 - the servers go down next anyway
                    print(f"closing a pusher: {e}", file=sys.stderr)
            for server in servers.values():
                server.stop()
    rows = [_row(kind, how, t, nbytes) for (kind, how), t in times.items()]
    ref = next(r for r in rows if r["server"] == "reward")["median_s"]
    for r in rows:
        r["ratio_vs_reward"] = r["median_s"] / ref
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "command": "python benchmarks/bench_servers.py " + " ".join(sys.argv[1:]),
        "shape": args.shape, "dtype": args.dtype, "bucket_mb": args.bucket_mb,
        "tensors": len(state), "bytes": nbytes, "repeats": args.repeats, "rows": rows,
    }


def _row(server: str, how: str, times: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {"server": server, "push": how, "median_s": med, "times_s": times,
            "gb_per_s": nbytes / med / 1e9}


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['shape']} ({result['tensors']} tensors, {result['bytes'] / 1e9:.2f} GB "
        f"{result['dtype']}), median of {result['repeats']} alternating rounds after a warm-up",
        "",
        "| server | push | median s | GB/s | ratio vs reward |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['server']} | {r['push']} | {r['median_s']:.2f} | {r['gb_per_s']:.2f} "
                     f"| {r['ratio_vs_reward']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-0.5b", help="a qwen2-* shape (default qwen2-0.5b)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (5)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="chunk size of a push (256)")
    p.add_argument("--ludic", action=argparse.BooleanOptionalAction, default=True,
                   help="also time a Ludic-style trainer's push into the policy server")
    p.add_argument("--json", dest="json_path", help="write the result here")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    result = run(args)
    print(table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
