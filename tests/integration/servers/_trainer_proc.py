"""A trainer process for the fault tests: pushes a safetensors file into a server's control plane
and, on request, kills (SIGKILL) or stops (SIGSTOP) itself for real at a chosen chunk.

    python tests/integration/servers/_trainer_proc.py URL WEIGHTS.safetensors --api-key K
        --strategy broadcast|cuda_ipc|packed_cuda_ipc --version V --bucket-mb MB
        [--die-after K [--signal KILL|STOP]] [--staged] [--checksum] [--timeout-s S]
        [--idle-timeout-s S]

The weights go through the low-level path (``FanOutClient`` + ``build_strategy`` +
``send_chunks``) with a chunk iterator of our own, so the process can die at a real point of a
real push: after the iterator yields chunk ``K``, the send pipeline asks it for the next one
(chunk ``K`` has been prepared; chunk ``K - 1`` may still be on the wire) and it calls
``os.kill(os.getpid(), SIGKILL)`` there; no clean-up runs. Before that it prints ``DYING K`` and
the number of chunks. Without ``--die-after`` it pushes everything and prints ``PUSHED`` and the
stats as JSON. The kill is the fault: nothing in weightsync is told about it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("weights")
    p.add_argument("--api-key", default=None)
    p.add_argument("--strategy", default="broadcast")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--bucket-mb", type=float, default=0.25)
    p.add_argument("--die-after", type=int, default=-1)
    p.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
    p.add_argument("--staged", action="store_true")
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--idle-timeout-s", type=float, default=3.0)
    args = p.parse_args()
    asyncio.run(push(args))


async def push(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    import weightsync as ws
    from weightsync.clients import FanOutClient
    from weightsync.pipeline import make_chunks

    weights = load_file(args.weights)
    chunks = list(make_chunks(weights.items(), bucket_size_mb=args.bucket_mb))
    cfg = {"type": args.strategy, "bucket_size_mb": args.bucket_mb, "timeout_s": args.timeout_s,
           "idle_timeout_s": args.idle_timeout_s, "staged": args.staged,
           "checksum": args.checksum}
    if args.strategy == "broadcast":
        cfg["backend"] = "gloo"
    strategy = ws.build_strategy(cfg)
    client = FanOutClient([args.url], api_key=args.api_key, timeout_s=args.timeout_s)
    info = await strategy.create_sync_info(strategy.cfg, client)
    sender = await strategy.create_sender(strategy.cfg, client, info)
    print(f"CHUNKS {len(chunks)}", flush=True)

    def stream():
        for i, chunk in enumerate(chunks):
            yield chunk
            if i == args.die_after:  # chunk i was prepared; the pipeline asks for the next
                print(f"DYING {i}", flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))

    manifest = [m for c in chunks for m in c.metas()]
    stats = await sender.send_chunks(stream(), client, version=args.version, manifest=manifest)
    print("PUSHED " + json.dumps(stats.to_dict()), flush=True)
    await sender.close()
    await client.close_weight_transfer()
    await client.aclose()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
