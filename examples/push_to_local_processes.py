"""Push a trainer's model into two engines running as local processes, in one push.

    python examples/push_to_local_processes.py [--steps 3] [--strategy broadcast]

Each engine is a ``LocalEngineProcess``: a child process holding a tiny Qwen2-shaped module
behind a ``WeightUpdateEndpoint`` (no Ray, no vLLM). ``ws.connect([engine_a, engine_b])`` fans
every push out to both; with ``broadcast`` the bytes travel once per chunk over a private gloo
group (the trainer is rank 0, the engines ranks 1 and 2). After every push both engines hold
exactly the trainer's weights (compared by digest) and serve the training step as their version.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

import weightsync as ws
from weightsync.digest import module_digest
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module

FACTORY = "weightsync.local.modules:qwen2_module"
SHAPE = {"size": "tiny", "dtype": "float32"}


def train_step(model: torch.nn.Module) -> None:
    """Stands in for an optimizer step: every weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-2)


async def main(steps: int, strategy: str) -> None:
    engines = [LocalEngineProcess.spawn(FACTORY, {**SHAPE, "fill": "zeros"}, name=f"engine{i}")
               for i in range(2)]
    try:
        trainer = qwen2_module(**SHAPE, seed=1)
        async with ws.connect(engines, strategy=strategy) as sync:
            for step in range(1, steps + 1):
                train_step(trainer)
                stats = await sync.push(trainer, version=step)
                want = module_digest(trainer)
                same = [await e.call("state_digest") == want for e in engines]
                served = dict(zip(stats.engines, stats.versions, strict=True))
                print(f"step {step}: {stats.num_tensors} tensors, {stats.total_bytes} bytes, "
                      f"{stats.seconds * 1e3:.1f} ms -> versions {served}; weights equal: {same}")
                if not all(same) or stats.versions != [step, step]:
                    raise SystemExit("an engine does not hold the pushed weights")
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--strategy", default="broadcast")
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.strategy))
