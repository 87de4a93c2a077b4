"""Push a trainer's model into an engine that lives in the same process.

    python examples/push_in_process.py [--steps 3] [--strategy packed_cuda_ipc]

The engine is a ``WeightUpdateEndpoint`` holding a ``torch_module`` loader over its own copy of
the model (what a trainer keeps for evaluation, or a test). ``ws.connect`` reaches it through an
in-process channel; the bytes still go through a real transport (shared memory for the IPC
strategies, gloo for ``broadcast``). After every push the engine's weights equal the trainer's
and its version is the training step.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

import weightsync as ws
from weightsync.loaders.torch_module import TorchModuleWeightLoader


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def train_step(model: torch.nn.Module) -> None:
    """Stands in for an optimizer step: every weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-2)


async def main(steps: int, strategy: str) -> None:
    served = make_model(seed=0)  # the engine's copy
    engine = ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=served), name="engine")
    trainer = make_model(seed=1)

    async with ws.connect(engine, strategy=strategy) as sync:
        for step in range(1, steps + 1):
            train_step(trainer)
            stats = await sync.push(trainer, version=step)
            same = all(torch.equal(a, b) for a, b in zip(
                served.state_dict().values(), trainer.state_dict().values(), strict=True))
            print(f"step {step}: {stats.total_bytes} bytes in {stats.num_chunks} chunk(s), "
                  f"{stats.seconds * 1e3:.1f} ms; engine serves version {stats.versions[0]}; "
                  f"weights equal: {same}")
            if not same or stats.versions != [step]:
                raise SystemExit("the engine does not hold the pushed weights")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--strategy", default="packed_cuda_ipc")
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.strategy))
