"""``remote`` loader as a relay between real endpoints in this process: the trainer pushes into a
relay endpoint (its loader a ``RemoteWeightLoader``), which pushes on into the "remote" engine
(a ``WeightUpdateEndpoint`` with a ``torch_module`` loader, reached through ``ws.connect`` like
any engine). Both hops are real ``cuda_ipc`` transfers (shared memory on CPU), whose receive
buffers are reused between chunks, so the relay must copy what it forwards. The HTTP case (a
real policy server) is tests/integration/loaders/test_remote_loader.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

import weightsync as ws
from weightsync.errors import UpdateRefusedError, WeightMismatchError
from weightsync.loaders.remote import RemoteLoaderConfig, RemoteWeightLoader
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.types import TensorMeta, WeightUpdateStart

SMALL = {"type": "cuda_ipc", "bucket_size_mb": 0.002}  # ~2 KB: several chunks


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16),
                               torch.nn.Linear(16, 4))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                 strict=True))


def _relay(seed: int = 0):
    far = _net(seed)
    remote = ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=far), name="remote")
    loader = RemoteWeightLoader(RemoteLoaderConfig(strategy=SMALL), engine=remote)
    return far, remote, loader, ws.WeightUpdateEndpoint(loader, name="relay")


def test_relay_forwards_each_update_to_the_remote_engine() -> None:
    far, remote, loader, relay = _relay()

    async def run():
        async with ws.connect([relay], SMALL) as sync:
            for version in (3, 4):
                trained = _net(version)
                stats = await sync.push(trained.state_dict(), version=version)
                assert stats.versions == [version]
                assert stats.num_chunks >= 3
                assert _same(far, trained)
                assert remote.status().version == version
                assert loader.last_stats.versions == [version]
                assert loader.last_stats.num_chunks == stats.num_chunks
        await loader.aclose()

    asyncio.run(run())


def test_remote_refusal_fails_the_local_push_and_changes_nothing_remote() -> None:
    far, remote, loader, relay = _relay()
    before = {k: v.clone() for k, v in far.state_dict().items()}
    bad = _net(7).state_dict()
    bad["1.weight"] = torch.zeros(5, 5)

    async def run():
        async with ws.connect([relay], SMALL) as sync:
            with pytest.raises(WeightMismatchError, match=r"1\.weight"):
                await sync.push(bad, version=1)
            assert all(torch.equal(before[k], v) for k, v in far.state_dict().items())
            assert remote.status().version == 0
            good = _net(8)  # the relay and the session go on
            assert (await sync.push(good.state_dict(), version=2)).versions == [2]
            assert _same(far, good)
        await loader.aclose()

    asyncio.run(run())


def test_an_update_left_half_way_is_cancelled_by_the_next_start() -> None:
    far, remote, loader, relay = _relay()
    before = {k: v.clone() for k, v in far.state_dict().items()}
    manifest = [TensorMeta(k, "float32", list(v.shape)) for k, v in far.state_dict().items()]

    async def run():
        await relay.start_weight_update(
            WeightUpdateStart(update_id="left", version=5, manifest=manifest).to_dict())
        await loader.load_weights({"0.weight": torch.ones(32, 16)})  # then the trainer dies
        async with ws.connect([relay], SMALL) as sync:
            good = _net(9)
            assert (await sync.push(good.state_dict(), version=6)).versions == [6]
        assert _same(far, good)
        assert not torch.equal(before["0.weight"], far.state_dict()["0.weight"])
        assert remote.status().version == 6  # 5 was never published
        await loader.aclose()

    asyncio.run(run())


def test_needs_an_engine_and_a_manifest() -> None:
    with pytest.raises(ValueError, match="url"):
        ws.build_loader({"type": "remote"})
    loader = ws.build_loader({"type": "remote", "url": "http://127.0.0.1:9",
                              "strategy": {"type": "cuda_ipc"}})
    assert isinstance(loader, RemoteWeightLoader) and loader.expected_metadata() is None
    with pytest.raises(UpdateRefusedError, match="manifest"):
        asyncio.run(loader.start_update(WeightUpdateStart(update_id="u")))
