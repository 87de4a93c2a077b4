"""Delta pushes through the front door (``connect(..., delta=True)``, ``weightsync.delta.tracker``)
into real ``WeightUpdateEndpoint`` s with ``torch_module`` loaders, over real transports (gloo
broadcast between threads of this process, shared memory for the IPC strategies).

What is checked after every push: the engine's bf16 weights are bit for bit the trainer's bf16
cast; a delta moves fewer bytes than the full update; an engine that missed a version is sent
a full update; a base that diverged behind the engine's back is caught by the checksums and
repaired by the next push."""

from __future__ import annotations

import asyncio

import pytest
import torch

import weightsync as ws
from weightsync.errors import ChecksumMismatchError
from weightsync.loaders.torch_module import TorchModuleWeightLoader


class Mlp(torch.nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.norm(h + self.down(torch.relu(self.up(h))))
        return self.head(h)


def _trainer(tied: bool = False) -> tuple[Mlp, torch.optim.Optimizer]:
    model = Mlp(tied)
    with torch.no_grad():  # a bf16 checkpoint loaded into float32 masters
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)


def _step(model: Mlp, opt: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on a real next-token loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _engine(name: str = "eng", tied: bool = False) -> tuple[Mlp, ws.WeightUpdateEndpoint]:
    module = Mlp(tied).to(torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    return module, ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=module), name=name)


def _exact(trainer: Mlp, engine: Mlp) -> bool:
    want = {n: p.detach().to(torch.bfloat16) for n, p in trainer.state_dict().items()}
    return all(torch.equal(want[n].view(torch.int16), p.view(torch.int16))
               for n, p in engine.state_dict().items())


@pytest.mark.parametrize("strategy", [
    {"type": "broadcast", "backend": "gloo"},
    {"type": "packed_cuda_ipc"},
    {"type": "cuda_ipc", "staged": True},
    {"type": "broadcast", "backend": "gloo", "stream": False},
])
def test_delta_pushes_are_exact_and_small(strategy):
    async def main() -> None:
        trainer, opt = _trainer()
        engine, ep = _engine()
        async with ws.connect([ep], strategy=strategy, delta=True) as sync:
            first = await sync.push(trainer, version=1, dtype=torch.bfloat16)
            assert first.delta["base_version"] is None and first.delta["encodings"] == {"dense": 8}
            assert _exact(trainer, engine) and ep.status().delta == {"version": 1, "shadow_bytes": 0}
            full = first.total_bytes
            for step in range(2, 5):
                _step(trainer, opt, step)
                stats = await sync.push(trainer, version=step, dtype=torch.bfloat16)
                assert stats.versions == [step] and _exact(trainer, engine)
                assert stats.delta["base_version"] == step - 1 and not stats.delta["fallback"]
                assert stats.delta["full_bytes"] == full
                assert stats.total_bytes == stats.delta["wire_bytes"] < 0.5 * full
                assert 0 < stats.delta["changed_fraction"] < 0.5
                assert "unchanged" in stats.delta["encodings"]  # the LayerNorm's ones and zeros

    asyncio.run(main())


def test_an_engine_that_missed_a_version_gets_a_full_update():
    async def main() -> None:
        trainer, opt = _trainer()
        (a, ep_a), (b, ep_b) = _engine("a"), _engine("b")
        async with ws.connect([ep_a, ep_b], strategy="packed_cuda_ipc", delta=True) as sync:
            await sync.push(trainer, version=1, dtype=torch.bfloat16)
            _step(trainer, opt, 1)
            # another trainer pushes its own weights into engine b only
            other, _ = _trainer()
            intruder = await ws.connect([ep_b], strategy="packed_cuda_ipc")
            await intruder.push(other, version=5, dtype=torch.bfloat16)
            assert ep_b.status().delta is None  # what b kept for deltas is stale: dropped
            stats = await sync.push(trainer, version=6, dtype=torch.bfloat16)
            assert stats.delta["fallback"] and stats.delta["base_version"] == 1
            assert stats.total_bytes == stats.delta["full_bytes"] and stats.versions == [6, 6]
            assert _exact(trainer, a) and _exact(trainer, b)
            _step(trainer, opt, 2)
            again = await sync.push(trainer, version=7, dtype=torch.bfloat16)
            assert not again.delta["fallback"] and again.delta["base_version"] == 6
            assert again.total_bytes < stats.total_bytes / 2
            assert _exact(trainer, a) and _exact(trainer, b)

    asyncio.run(main())


def test_tied_weights_are_rebuilt_from_the_engines_copy():
    """A tied tensor has no ``direct_target`` in a torch module: the engine keeps a copy of it
    (a shadow), rebuilds it there and loads it."""
    async def main() -> None:
        trainer, opt = _trainer(tied=True)
        engine, ep = _engine(tied=True)
        async with ws.connect([ep], strategy="packed_cuda_ipc", delta=True) as sync:
            await sync.push(trainer.state_dict(), version=1, dtype=torch.bfloat16)
            kept = ep.status().delta["shadow_bytes"]
            assert kept == 2 * 64 * 32 * 2  # embed.weight and head.weight, bf16
            for step in range(2, 4):
                _step(trainer, opt, step)
                stats = await sync.push(trainer.state_dict(), version=step, dtype=torch.bfloat16)
                assert not stats.delta["fallback"] and _exact(trainer, engine)
                assert stats.total_bytes < stats.delta["full_bytes"] / 2

    asyncio.run(main())


def test_a_push_without_delta_makes_the_next_one_full():
    async def main() -> None:
        trainer, opt = _trainer()
        engine, ep = _engine()
        async with ws.connect([ep], strategy="packed_cuda_ipc", delta=True) as sync:
            await sync.push(trainer, version=1, dtype=torch.bfloat16)
            _step(trainer, opt, 1)
            plain = await sync.push(trainer, version=2, dtype=torch.bfloat16, delta=False)
            assert plain.delta is None and ep.status().delta is None
            _step(trainer, opt, 2)
            stats = await sync.push(trainer, version=3, dtype=torch.bfloat16)
            assert stats.delta["base_version"] is None and not stats.delta["fallback"]
            assert _exact(trainer, engine)

    asyncio.run(main())


def test_a_base_changed_behind_the_engines_back_is_caught_by_checksums():
    """With ``checksum: true`` every rebuilt tensor is checked against the trainer's: an engine
    whose weights were changed outside an update fails the delta (torn, refusing to serve) and
    the next push, a full one, repairs it."""
    async def main() -> None:
        trainer, opt = _trainer()
        engine, ep = _engine()
        strategy = {"type": "packed_cuda_ipc", "checksum": True}
        async with ws.connect([ep], strategy=strategy, delta=True) as sync:
            await sync.push(trainer, version=1, dtype=torch.bfloat16)
            with torch.no_grad():
                engine.up.weight[0, 0] += 1.0  # not through an update
            _step(trainer, opt, 1)
            with pytest.raises(ChecksumMismatchError, match="up.weight"):
                await sync.push(trainer, version=2, dtype=torch.bfloat16)
            assert ep.status().state == ws.EndpointState.TORN and ep.status().delta is None
            _step(trainer, opt, 2)
            stats = await sync.push(trainer, version=3, dtype=torch.bfloat16)
            assert stats.delta["base_version"] is None and _exact(trainer, engine)
            assert ep.status().state == ws.EndpointState.IDLE

    asyncio.run(main())
