"""Push a trainer's model into engines that are Ray actors.

    python examples/push_to_ray_actors.py [--steps 3] [--strategy broadcast]

The engines are ``TorchModuleEngineActor``s (``weightsync.ray``): Ray actors holding a tiny
Qwen2-shaped module, with ``WeightSyncEngineMixin`` exposing the endpoint. Mix that mixin into
your own inference actor (implement ``_weightsync_loader``) and the same three lines push into
it. The driver here plays the trainer; in a real job the trainer actor calls ``ws.connect`` with
the engine handles it was given (``weightsync.ray.wire_sync_group`` does that for you).
"""

from __future__ import annotations

import argparse
import asyncio

import torch

import weightsync as ws
from weightsync.digest import module_digest
from weightsync.local.modules import qwen2_module

FACTORY = "weightsync.local.modules:qwen2_module"
SHAPE = {"size": "tiny", "dtype": "float32"}


def train_step(model: torch.nn.Module) -> None:
    """Stands in for an optimizer step: every weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-2)


async def main(steps: int, strategy: str) -> None:
    import ray

    from weightsync.ray import spawn_engine_actors

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engines = spawn_engine_actors(2, FACTORY, {**SHAPE, "fill": "zeros"})
        trainer = qwen2_module(**SHAPE, seed=1)
        async with ws.connect(engines, strategy=strategy) as sync:
            for step in range(1, steps + 1):
                train_step(trainer)
                stats = await sync.push(trainer, version=step)
                want = module_digest(trainer)
                got = await asyncio.gather(*(e.state_digest.remote() for e in engines))
                same = [g == want for g in got]
                print(f"step {step}: {stats.num_tensors} tensors in {stats.seconds * 1e3:.1f} ms "
                      f"-> versions {stats.versions}; weights equal: {same}")
                if not all(same) or stats.versions != [step, step]:
                    raise SystemExit("an actor does not hold the pushed weights")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--strategy", default="broadcast")
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.strategy))
