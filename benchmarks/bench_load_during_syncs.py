"""Model-request latency with and without weight syncs (or a dead join), one run, both servers.

    python benchmarks/bench_load_during_syncs.py [--hidden-size 256] [--layers 4]
        [--scorers 4] [--generators 4] [--max-tokens 8] [--window-s 15] [--rounds 3]
        [--sync-gap-s 0.5] [--strategy broadcast|cuda_ipc|packed_cuda_ipc] [--together]
        [--disturb syncs|killed-join|silent-join] [--scratch DIR] [--json PATH]

A reward server (``weightsync serve-reward``) and a policy server (``weightsync serve-policy``)
on two small random models built here (Qwen2 reward model, tied Llama causal LM; fp32, nothing
downloaded; ``--hidden-size`` / ``--layers`` set their size). ``--scorers`` threads send
``POST /score`` to the reward server and ``--generators`` threads send greedy
``/v1/completions`` (``--max-tokens`` tokens) to the policy server, each request right after the
previous one (``weightsync.bench.serving_load.LoadRunner``). Time is cut into windows of
``--window-s`` seconds that alternate, ``--rounds`` times each: *no syncs* (the reference) and
*syncs* (a trainer session pushes complete updates to the server, ``--sync-gap-s`` apart, until
the window ends). The reward server's windows run first (its clients and its trainer only), then
the policy server's; ``--together`` runs both servers' clients and trainers in the same windows
instead (what ``tests/integration/servers/test_servers_load_during_syncs.py`` does). Each server
gets a warm-up window and one push first, not counted. A request belongs to the window it
started in.

Per server and window kind: requests answered, failed requests (anything but a 200), p50 / p99 /
max latency, requests per second, and the *syncs* rows' p50 and p99 ratio against the *no syncs*
rows of the same run (alternating windows: load on a shared machine shifts both alike). Every
answer is checked: it names a version this run's trainer installed (no syncs: the one version in
place).

``--disturb`` picks what the disturbed windows hold instead of syncs (``syncs``, the default):
``killed-join``: at the window's start a Ludic/TRL trainer process asks the server for a group
(``POST /init_communicator {host, port, world_size}``) and is SIGKILLed before it joins, so the
server's workers wait in the group's rendezvous for the whole window
(``weightsync.bench.dead_join.KilledLudicTrainer``); ``silent-join``: a sender of our dialect
hosts its store and asks for a ``broadcast`` communicator it never joins
(``SilentSender``, ``join_timeout_s`` longer than the window). After each such window a
``/close_communicator`` abandons the join; its answer time is reported (``close_s``). What the ratio contains on a CPU box: the pause policy (a request arriving during an
update waits at the gate until it is complete, see ``docs/policy_server.md``) and the trainer
competing with the server for the same cores. The two servers' engines get cores of their own
(``weightsync.testing.servers.cpu_core_slots``, through ``started_or_attached``); left to
itself vLLM would bind both workers to the same cores, and with ``--together`` one busy engine
would then starve the other's weight transfers.
"""

from __future__ import annotations

import argparse
import contextlib
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
STRATEGIES = {
    "broadcast": {"type": "broadcast", "backend": "gloo"},
    "cuda_ipc": {"type": "cuda_ipc"},
    "packed_cuda_ipc": {"type": "packed_cuda_ipc"},
}


def build_models(root: str, hidden_size: int, layers: int) -> tuple[str, str]:
    """-> (reward model dir, policy model dir), random weights, fp32."""
    from weightsync.testing.tiny_models import build_tiny_causal_lm, build_tiny_reward_model

    size = {"hidden_size": hidden_size, "num_layers": layers, "num_heads": max(2, hidden_size // 64),
            "num_kv_heads": 1, "seed": 0}
    reward = build_tiny_reward_model(os.path.join(root, "reward"), **size)
    policy = build_tiny_causal_lm(os.path.join(root, "policy"), family="llama",
                                  tie_word_embeddings=True, **size)
    return str(reward), str(policy)


def weight_sets(model_dir: str) -> list[dict[str, Any]]:
    """The checkpoint's tensors and a perturbed copy: the pushes alternate between them."""
    import torch
    from safetensors.torch import load_file

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    other = {n: t + torch.randn(t.shape, generator=g) * 0.02 for n, t in base.items()}
    return [base, other]


def runtime_version(url: str) -> int:
    import httpx

    return int(httpx.get(url + "/runtime_version", timeout=30).json()["version"])


class Trainer:
    """One open trainer session to one server; ``run_until(deadline)`` pushes complete updates
    back to back (``gap_s`` apart) in a thread; ``installed`` holds every version it published."""

    def __init__(self, url: str, strategy: dict, sets: list[dict], bucket_mb: float) -> None:
        import weightsync as ws

        self.url, self.sets, self.gap_s = url, sets, 0.0
        self.sync = ws.connect_sync([url], {**strategy, "bucket_size_mb": bucket_mb},
                                    api_key=API_KEY)
        self.version = runtime_version(url)
        self.installed = {self.version}
        self.push_seconds: list[float] = []
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def push(self) -> float:
        self.version += 1
        t0 = time.perf_counter()
        stats = self.sync.push(self.sets[self.version % len(self.sets)], version=self.version)
        dt = time.perf_counter() - t0
        if stats.versions != [self.version]:
            raise RuntimeError(f"{self.url}: pushed version {self.version}, the server reports "
                               f"{stats.versions}")
        self.installed.add(self.version)
        return dt

    def run_until(self, deadline: float, gap_s: float) -> None:
        def loop() -> None:
            try:
                while time.monotonic() < deadline:
                    self.push_seconds.append(self.push())
                    time.sleep(gap_s)
            except BaseException as e:  # noqa: BLE001 - reported by join()
                self.error = e

        self._thread = threading.Thread(target=loop, name=f"trainer {self.url}", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            raise RuntimeError(f"{self.url}: a push failed: {self.error!r}") from self.error

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None


DEAD_JOINS = ("killed-join", "silent-join")


def dead_join(kind: str, url: str, window_s: float) -> Any:
    """Leave ``url``'s workers in a join that never completes (``--disturb``); -> the sender
    (``SilentSender``) whose answer comes once the join is abandoned, or None."""
    from weightsync.bench.dead_join import KilledLudicTrainer, SilentSender
    from weightsync.testing.servers import free_port

    if kind == "killed-join":
        KilledLudicTrainer(url, API_KEY, port=free_port()).start()
        return None
    return SilentSender(url, API_KEY, join_timeout_s=window_s + 60).start()


def abandon_join(url: str, sender: Any) -> float:
    """``POST /close_communicator`` (it abandons the join); -> the seconds it took to answer."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/close_communicator", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={}, timeout=120)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: /close_communicator answered {r.status_code}: {r.text}")
    if sender is not None:
        answer = sender.join(60)
        if answer is None or answer.status_code != 409:
            raise RuntimeError(f"{url}: the abandoned join answered {answer!r}, not 409")
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from weightsync.bench.serving_load import LoadRunner
    from weightsync.testing.servers import (
        PolicyServerProcess,
        RewardServerProcess,
        started_or_attached,
    )

    torch.set_num_threads(1)
    strategy = STRATEGIES[args.strategy]
    disturbed = args.disturb
    outcomes: dict[str, list[Any]] = {"no syncs": [], disturbed: []}
    closes: dict[str, list[float]] = {"score": [], "generate": []}
    scratch = (contextlib.nullcontext(tempfile.mkdtemp(prefix="load-", dir=args.scratch))
               if args.scratch else tempfile.TemporaryDirectory())
    with scratch as tmp:
        reward_dir, policy_dir = build_models(tmp, args.hidden_size, args.layers)
        nbytes = {d: sum(t.numel() * t.element_size() for t in weight_sets(d)[0].values())
                  for d in (reward_dir, policy_dir)}
        servers = [(RewardServerProcess, reward_dir, None), (PolicyServerProcess, policy_dir, None)]
        progress = lambda m: print(f"  {m}", file=sys.stderr)  # noqa: E731
        with started_or_attached(servers, scratch_dir=tmp, progress=progress,
                                 extra_args=["--api-key", API_KEY, "--max-model-len", "256",
                                             "--log-level", "warning",
                                             "--kv-cache-memory-bytes", str(64 << 20)]
                                 ) as (reward_url, policy_url):
            urls = {"score": reward_url, "generate": policy_url}
            trainers = {"score": Trainer(reward_url, strategy, weight_sets(reward_dir),
                                         args.bucket_mb),
                        "generate": Trainer(policy_url, strategy, weight_sets(policy_dir),
                                            args.bucket_mb)}
            try:
                for t in trainers.values():
                    t.push()  # warm the sync path; not counted
                if disturbed in DEAD_JOINS:
                    for t in trainers.values():
                        t.close()  # the dead joins take the communicator from now on

                def window(kind: str, seconds: float, group: tuple[str, ...]) -> list[Any]:
                    runner = LoadRunner(
                        reward_url=reward_url if "score" in group else None,
                        policy_url=policy_url if "generate" in group else None,
                        scorers=args.scorers, generators=args.generators,
                        max_tokens=args.max_tokens, model=policy_dir)
                    mine = {k: trainers[k] for k in group}
                    before = {k: runtime_version(urls[k]) for k in group}
                    joins = ({k: dead_join(kind, urls[k], seconds) for k in group}
                             if kind in DEAD_JOINS else {})
                    runner.start()
                    if kind == "syncs":
                        deadline = time.monotonic() + seconds
                        for t in mine.values():
                            t.run_until(deadline, args.sync_gap_s)
                        for t in mine.values():
                            t.join()
                    else:
                        time.sleep(seconds)
                    got = runner.stop()
                    for k, sender in joins.items():
                        closes[k].append(abandon_join(urls[k], sender))
                    for k, t in mine.items():
                        allowed = ({v for v in t.installed if v >= before[k]} if kind == "syncs"
                                   else {before[k]})
                        wrong = [o.version for o in got if o.kind == k and o.ok
                                 and o.version not in allowed]
                        if wrong:
                            raise RuntimeError(f"{kind} window: {k} answers name versions "
                                               f"{sorted(set(wrong))}, installed {sorted(allowed)}")
                    return got

                groups = [("score", "generate")] if args.together else [("score",), ("generate",)]
                for group in groups:
                    window("no syncs", min(3.0, args.window_s), group)  # warm-up, not counted
                    for rnd in range(args.rounds):
                        for kind in ("no syncs", disturbed):
                            got = window(kind, args.window_s, group)
                            outcomes[kind].extend(got)
                            print(f"  {'+'.join(group)} round {rnd} {kind:8s}: {len(got)} "
                                  f"requests, {sum(not o.ok for o in got)} failed",
                                  file=sys.stderr)
            finally:
                for t in trainers.values():
                    t.close()
    return report(args, outcomes, trainers, closes,
                  nbytes={"score": nbytes[reward_dir], "generate": nbytes[policy_dir]})


def report(args: argparse.Namespace, outcomes: dict[str, list[Any]], trainers: dict[str, Any],
           closes: dict[str, list[float]], nbytes: dict[str, int]) -> dict[str, Any]:
    from weightsync.bench.serving_load import latency_summary

    rows = []
    for kind, server in (("score", "reward"), ("generate", "policy")):
        ref = latency_summary([o for o in outcomes["no syncs"] if o.kind == kind])
        for phase in outcomes:
            s = latency_summary([o for o in outcomes[phase] if o.kind == kind])
            rows.append({
                "server": server, "client": kind, "window": phase, **s,
                "p50_ratio": s["p50_ms"] / ref["p50_ms"] if ref["p50_ms"] else None,
                "p99_ratio": s["p99_ms"] / ref["p99_ms"] if ref["p99_ms"] else None,
            })
    syncs, abandons = {}, {}
    for kind, server in (("score", "reward"), ("generate", "policy")):
        secs = trainers[kind].push_seconds
        if args.disturb == "syncs":
            syncs[server] = {"pushes": len(secs),
                             "median_s": statistics.median(secs) if secs else 0,
                             "max_s": max(secs, default=0.0), "seconds_all": secs,
                             "bytes": nbytes[kind],
                             "busy_fraction": sum(secs) / (args.rounds * args.window_s)}
        else:
            abandons[server] = {"close_s": closes[kind]}
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "command": "python benchmarks/bench_load_during_syncs.py " + " ".join(sys.argv[1:]),
        "strategy": args.strategy, "bucket_mb": args.bucket_mb, "disturb": args.disturb,
        "hidden_size": args.hidden_size, "layers": args.layers,
        "scorers": args.scorers, "generators": args.generators, "max_tokens": args.max_tokens,
        "window_s": args.window_s, "rounds": args.rounds, "sync_gap_s": args.sync_gap_s,
        "together": args.together,
        "rows": rows, "syncs": syncs, "abandoned_joins": abandons,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['scorers']} scorers + {result['generators']} generators "
        f"({result['max_tokens']} tokens), {result['rounds']} x {result['window_s']:g} s windows "
        f"of each kind, disturbed by {result.get('disturb', 'syncs')}, strategy "
        f"{result['strategy']}, "
        f"{'both servers at once' if result['together'] else 'one server at a time'}",
        "",
        "| server | client | window | requests | failed | p50 ms | p99 ms | max ms | req/s "
        "| p50 ratio | p99 ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['server']} | {r['client']} | {r['window']} | {r['n']} | {r['failed']} "
            f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | {r['rps']:.1f} "
            f"| {r['p50_ratio']:.2f} | {r['p99_ratio']:.2f} |")
    if result["syncs"]:
        lines += ["", "| server | pushes | median push s | max push s | MB | busy fraction |",
                  "|---|---|---|---|---|---|"]
        for server, s in result["syncs"].items():
            lines.append(f"| {server} | {s['pushes']} | {s['median_s']:.3f} | {s['max_s']:.3f} "
                         f"| {s['bytes'] / 1e6:.1f} | {s['busy_fraction']:.2f} |")
    for server, a in result.get("abandoned_joins", {}).items():
        lines.append(f"\n{server}: /close_communicator abandoned each dead join in "
                     f"{', '.join(f'{x:.3f}' for x in a['close_s'])} s")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256, help="both models' width (256)")
    p.add_argument("--layers", type=int, default=4, help="both models' depth (4)")
    p.add_argument("--scorers", type=int, default=4, help="scoring clients (4)")
    p.add_argument("--generators", type=int, default=4, help="generation clients (4)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per generation (8)")
    p.add_argument("--window-s", type=float, default=15.0, help="seconds per window (15)")
    p.add_argument("--rounds", type=int, default=3, help="windows of each kind (3)")
    p.add_argument("--sync-gap-s", type=float, default=0.5,
                   help="pause between two pushes in a syncs window (0.5)")
    p.add_argument("--together", action="store_true",
                   help="run both servers' clients and trainers in the same windows (default: "
                        "the reward server's windows first, then the policy server's)")
    p.add_argument("--disturb", choices=["syncs", *DEAD_JOINS], default="syncs",
                   help="what the disturbed windows hold: complete pushes (syncs), a Ludic "
                        "trainer SIGKILLed before it joins its group (killed-join) or a sender "
                        "that never joins its own (silent-join)")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="broadcast",
                   help="how the trainers push (broadcast over gloo)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="chunk size of a push (4)")
    p.add_argument("--scratch", help="keep the models and server logs in a new folder here "
                                     "(default: a temp dir, removed)")
    p.add_argument("--json", dest="json_path", help="write the result here")
    args = p.parse_args()
    if args.rounds < 1 or args.window_s <= 0:
        p.error("--rounds must be >= 1 and --window-s > 0")
    result = run(args)
    print(table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
