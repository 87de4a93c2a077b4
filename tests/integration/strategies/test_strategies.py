"""Every strategy between real processes: a trainer (this process) and LocalEngineProcess
engines, with real gloo groups and real POSIX shared memory. Small Qwen2-shaped models; the
0.5B shape is in test_strategies_qwen05b.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from weightsync import WeightChunk, WeightMismatchError, build_strategy
from weightsync.clients import FanOutClient
from weightsync.digest import tensor_digest
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FACTORY = "weightsync.local.modules:qwen2_module"
SMALL = {"size": "small", "dtype": "float32"}
STRATEGIES = [
    {"type": "broadcast", "backend": "gloo"},
    {"type": "broadcast", "backend": "gloo", "stream": False},
    {"type": "broadcast", "backend": "gloo", "stream": False, "packed": False},
    {"type": "broadcast", "backend": "gloo", "stream": False, "max_inflight_chunks": 2},
    {"type": "cuda_ipc"},
    {"type": "packed_cuda_ipc"},
]
IDS = ["broadcast-stream", "broadcast-packed", "broadcast-unpacked", "broadcast-pipelined",
       "cuda_ipc", "packed_cuda_ipc"]


def chunks_of(sd: dict[str, torch.Tensor], per_chunk: int) -> list[WeightChunk]:
    names = list(sd)
    return [
        WeightChunk(names[i : i + per_chunk], [sd[n] for n in names[i : i + per_chunk]])
        for i in range(0, len(names), per_chunk)
    ]


def digests_of(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in sd.items()}


async def engine_digests(engine: LocalEngineProcess) -> dict[str, str]:
    return {n: d["digest"] for n, d in (await engine.call("state_digest")).items()}


async def wire(cfg: dict, client: FanOutClient):
    strategy = build_strategy({"timeout_s": 30, **cfg})
    info = await strategy.create_sync_info(None, client)
    return strategy, await strategy.create_sender(None, client, info)


@pytest.fixture(scope="module")
def engines():
    """Two engines shared by the module (re-initialised per test: each test wires anew)."""
    engs = [
        LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name=f"engine{i}")
        for i in range(2)
    ]
    yield engs
    for e in engs:
        e.stop()


@pytest.fixture(scope="module")
def models():
    """Two different weight sets of the engines' shape (v1, v2)."""
    return [qwen2_module(**SMALL, seed=s).state_dict() for s in (1, 2)]


def _next_version(engines) -> int:
    return asyncio.run(engines[0].call("get_version"))


@pytest.mark.parametrize("cfg", STRATEGIES, ids=IDS)
def test_two_engines_two_syncs_bit_exact(engines, models, cfg):
    async def run():
        client = FanOutClient(engines, timeout_s=60)
        _, sender = await wire({**cfg, "bucket_size_mb": 1}, client)
        base = await engines[0].call("get_version")
        try:
            for step, sd in enumerate(models, start=1):
                stats = await sender.send_chunks(chunks_of(sd, 7), client, version=base + step)
                assert stats.versions == [base + step, base + step]
                assert stats.num_chunks > 3 and stats.total_bytes == sum(
                    t.numel() * t.element_size() for t in sd.values())
                want = digests_of(sd)
                for e in engines:
                    assert await engine_digests(e) == want
        finally:
            await sender.close()

    asyncio.run(run())


def test_broadcast_rank_offsets_with_a_two_worker_engine(models):
    """world sizes [2, 1] -> ranks 1,2 and 3; every worker of every engine gets the weights."""
    e0 = LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name="tp", world_size=2)
    e1 = LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name="single")
    try:
        async def run():
            client = FanOutClient([e0, e1], timeout_s=60)
            strategy = build_strategy({"type": "broadcast", "timeout_s": 30})
            info = await strategy.create_sync_info(None, client)
            assert info.world_size == 4
            sender = await strategy.create_sender(None, client, info)
            await sender.send_chunks(chunks_of(models[0], 10), client, version=1)
            want = digests_of(models[0])
            for w in (0, 1):
                got = await e0.call("state_digest", worker=w)
                assert {n: d["digest"] for n, d in got.items()} == want
            assert await engine_digests(e1) == want
            await sender.close()

        asyncio.run(run())
    finally:
        e0.stop()
        e1.stop()


def _bad_model(models):
    """v1 with an unknown name, a wrong shape and a wrong dtype (and the rest fine)."""
    sd = dict(models[0])
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:, :-1]
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.bfloat16)
    sd["model.layers.99.mlp.up_proj.weight"] = torch.zeros(3, 3)
    return sd


BAD = {
    "model.layers.0.self_attn.q_proj.weight": "shape",
    "model.norm.weight": "dtype",
    "model.layers.99.mlp.up_proj.weight": "not a parameter",
}


@pytest.mark.parametrize("cfg", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "per-chunk"])
def test_bad_input_rejected_before_any_byte_moves(engines, models, cfg, with_manifest):
    """Unknown name / wrong shape / wrong dtype: every offender listed, engines untouched.

    With a manifest the engines refuse at start; without one (a streamed update), the bad names
    are all in the first chunk and each receiver refuses it before the data plane moves."""
    bad = _bad_model(models)
    names = list(BAD) + [n for n in bad if n not in BAD]
    chunk = WeightChunk(names, [bad[n] for n in names])

    async def run():
        client = FanOutClient(engines, timeout_s=60)
        _, sender = await wire(cfg, client)
        before = [await engine_digests(e) for e in engines]
        versions = [await e.call("get_version") for e in engines]

        async def stream():
            yield chunk

        try:
            t0 = time.monotonic()
            with pytest.raises(WeightMismatchError) as ei:
                await sender.send_chunks(
                    [chunk] if with_manifest else stream(), client, version=versions[0] + 1
                )
            assert time.monotonic() - t0 < 20
            offenders = "\n".join(ei.value.offenders)
            for name, what in BAD.items():
                assert name in offenders and what in offenders, offenders
            assert len(ei.value.offenders) == 3
            assert "engine" in str(ei.value)
            for e, b, v in zip(engines, before, versions, strict=True):
                assert await engine_digests(e) == b
                assert await e.call("get_version") == v
                assert (await e.call("get_state"))["state"] == "idle"
            # the transport still works after a refusal
            stats = await sender.send_chunks(chunks_of(models[1], 50), client, version=versions[0] + 1)
            assert stats.versions == [versions[0] + 1] * 2
        finally:
            await sender.close()

    asyncio.run(run())


def test_request_of_the_wrong_strategy_is_rejected(engines, models):
    async def run():
        client = FanOutClient(engines, timeout_s=60)
        _, sender = await wire({"type": "cuda_ipc"}, client)  # engines now expect cuda_ipc
        v = await engines[0].call("get_version")
        bstrategy = build_strategy({"type": "broadcast"})
        chunk = chunks_of(models[0], 3)[0]
        req = bstrategy.get_request_type()(
            names=chunk.names, dtypes=chunk.dtype_names, shapes=chunk.shape_lists, update_id="u1",
        )
        await client.start_weight_update({"type": "start", "update_id": "u1", "version": v + 1})
        with pytest.raises(ValueError, match="expects a 'cuda_ipc' request, got 'broadcast'"):
            await client.update_named_weights(req.to_dict())
        await client.finish_weight_update(
            {"type": "finish", "update_id": "u1", "ok": False, "error": "test"})
        assert await engines[0].call("get_version") == v
        await sender.close()

    asyncio.run(run())


@pytest.mark.parametrize("cfg", STRATEGIES, ids=IDS)
def test_chunk_rejected_mid_stream_with_the_next_in_flight(engines, models, cfg):
    """A streamed update (no manifest) whose 4th chunk has a wrong shape, while the sender keeps
    two chunks in flight: the mismatch is raised naming the tensor, nothing hangs (for
    broadcast, every rank votes once on the chunk that was already on its way), the engines are
    torn (3 chunks had landed) and keep their version, and the next complete sync heals them
    over the same group."""
    good = chunks_of(models[0], 4)
    bad_name = good[3].names[0]
    bad = WeightChunk(
        good[3].names, [torch.zeros(7, 3)] + list(good[3].tensors[1:])
    )
    stream_chunks = good[:3] + [bad] + good[4:]

    async def run():
        client = FanOutClient(engines, timeout_s=60)
        assert client.max_inflight_updates == 2
        _, sender = await wire({**cfg, "max_inflight_chunks": 2}, client)
        v = await engines[0].call("get_version")

        async def stream():
            for c in stream_chunks:
                yield c

        try:
            t0 = time.monotonic()
            with pytest.raises(WeightMismatchError, match="shape") as ei:
                await sender.send_chunks(stream(), client, version=v + 1)
            assert time.monotonic() - t0 < 20
            assert any(bad_name in o for o in ei.value.offenders), ei.value.offenders
            for e in engines:
                state = await e.call("get_state")
                assert state["state"] == "torn" and state["version"] == v, state
            stats = await sender.send_chunks(chunks_of(models[1], 4), client, version=v + 2)
            assert stats.versions == [v + 2] * 2
            for e in engines:
                assert await engine_digests(e) == digests_of(models[1])
                assert (await e.call("get_state"))["state"] == "idle"
        finally:
            await sender.close()

    asyncio.run(run())
