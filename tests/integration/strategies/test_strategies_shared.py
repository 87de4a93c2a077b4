"""IPC strategies from shared weights (``share_cpu_weights``) between real processes: a trainer
(this process, a real module trained with a real optimizer between syncs) and two
LocalEngineProcess engines over real POSIX shared memory. Checks: bit-exact after every sync,
no sender copy for shared tensors (the senders' counters), engines keep their mappings across
syncs, tensors that left the shared memory (replaced ``.data``) or a cast still arrive through
the copy path in the same chunk, and closing the shared weights falls back to copies.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync import build_extractor, build_strategy
from weightsync.clients import FanOutClient
from weightsync.digest import tensor_digest
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module
from weightsync.strategies import locate_shared, share_cpu_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FACTORY = "weightsync.local.modules:qwen2_module"
SMALL = {"size": "small", "dtype": "float32"}


@pytest.fixture(scope="module")
def engines():
    engs = [
        LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name=f"engine{i}")
        for i in range(2)
    ]
    yield engs
    for e in engs:
        e.stop()


async def _digests(engine: LocalEngineProcess) -> dict[str, str]:
    return {n: d["digest"] for n, d in (await engine.call("state_digest")).items()}


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A real (tiny) training step: the optimizer updates the shared tensors in place."""
    loss = sum(((p - torch.randn_like(p)) ** 2).mean() for p in model.parameters())
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("strategy", ["cuda_ipc", "packed_cuda_ipc"])
def test_shared_weights_sync_zero_copy_bit_exact_across_training_steps(engines, strategy):
    torch.manual_seed(0)
    model = qwen2_module(**SMALL, seed=5)
    for p in model.parameters():
        p.requires_grad_(True)
    shared = share_cpu_weights(model, segment_mb=0.25)  # a few segments
    assert all(p.requires_grad for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n_tensors = len(model.state_dict())

    async def run():
        client = FanOutClient(engines, timeout_s=60)
        s = build_strategy({"type": strategy, "timeout_s": 30, "bucket_size_mb": 0.1})
        sender = await s.create_sender(None, client, await s.create_sync_info(None, client))
        extractor = build_extractor({"type": "hf", "bucket_size_mb": 0.1})
        base = await engines[0].call("get_version")
        try:
            for step in range(1, 4):
                _train_step(model, opt)
                stats = await sender.send_chunks(
                    extractor.extract_weights(model), client, version=base + step,
                    manifest=extractor.metadata(model),
                )
                # cuda_ipc sends handles to the trainer's own memory: the extractor's borrowed
                # chunks go as one request; packed_cuda_ipc keeps the buckets
                assert stats.num_chunks == 1 if strategy == "cuda_ipc" else stats.num_chunks > 3
                want = {n: tensor_digest(t) for n, t in model.state_dict().items()}
                for e in engines:
                    assert await _digests(e) == want, f"sync {step}"
            assert sender.shared_tensors == 3 * stats.num_tensors  # no sender copy at all
            assert getattr(sender, "copied_tensors", 0) == getattr(sender, "packed_tensors", 0) == 0

            # one tensor leaves the shared memory (the user replaced .data): it is copied, in
            # the same chunks as shared ones, and everything still arrives bit-exact
            w = model.get_parameter("model.layers.0.mlp.up_proj.weight")
            w.data = w.data.clone() * 3
            assert locate_shared(w) is None
            before = sender.shared_tensors
            mixed = await sender.send_chunks(extractor.extract_weights(model), client,
                                             version=base + 4)
            assert sender.shared_tensors - before == stats.num_tensors - 1
            if strategy == "cuda_ipc":  # the bucket with the copied tensor is sent on its own
                assert 1 < mixed.num_chunks <= 3
            want = {n: tensor_digest(t) for n, t in model.state_dict().items()}
            for e in engines:
                assert await _digests(e) == want

            # closed: every tensor takes the copy path again, still exact
            shared.close()
            _train_step(model, opt)
            before = sender.shared_tensors
            await sender.send_chunks(extractor.extract_weights(model), client, version=base + 5)
            assert sender.shared_tensors == before
            want = {n: tensor_digest(t) for n, t in model.state_dict().items()}
            for e in engines:
                assert await _digests(e) == want
        finally:
            await sender.close()
            shared.close()
        assert len(want) == n_tensors

    asyncio.run(run())


def test_shared_weights_with_a_cast_take_the_copy_path(engines):
    """A generator dtype other than the model's makes new tensors: nothing to share, exact."""
    model = qwen2_module(size="small", dtype="float64", seed=6)
    shared = share_cpu_weights(model)

    async def run():
        client = FanOutClient(engines, timeout_s=60)
        s = build_strategy({"type": "packed_cuda_ipc", "timeout_s": 30, "bucket_size_mb": 0.5})
        sender = await s.create_sender(None, client, await s.create_sync_info(None, client))
        extractor = build_extractor({"type": "hf", "bucket_size_mb": 0.5})
        base = await engines[0].call("get_version")
        try:
            await sender.send_chunks(
                extractor.extract_weights(model, torch.float32), client, version=base + 1
            )
            assert sender.shared_tensors == 0 and sender.packed_tensors > 0
            want = {n: tensor_digest(t.float()) for n, t in model.state_dict().items()}
            for e in engines:
                assert await _digests(e) == want
        finally:
            await sender.close()
            shared.close()

    asyncio.run(run())
