"""Fewer control round trips: an update of one chunk goes as one ``apply_update`` call (start,
chunk and finish at the engine), chunks of the trainer's own tensors are coalesced by
``cuda_ipc``, and the engine keeps the update's rules (validation first, torn after a failed
chunk, versions only from complete updates) inside the one call.

Real parts: the ``cuda_ipc`` / ``packed_cuda_ipc`` strategies over shared memory (CPU), the
``hf`` extractor, ``FanOutClient`` over ``EndpointChannel`` into endpoints with a
``torch_module`` loader, in one process. ``Recording`` is a channel that forwards to the real
one and notes which endpoint methods were called."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

import weightsync as ws  # noqa: E402
from weightsync.clients import FanOutClient  # noqa: E402
from weightsync.clients.channel import EndpointChannel  # noqa: E402
from weightsync.engine import EndpointState, WeightUpdateEndpoint  # noqa: E402
from weightsync.errors import WeightMismatchError  # noqa: E402
from weightsync.loaders.torch_module import TorchModuleWeightLoader  # noqa: E402
from weightsync.pipeline import coalesce, peek_single  # noqa: E402
from weightsync.types import WeightChunk  # noqa: E402


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class Recording(EndpointChannel):
    def __init__(self, endpoint: WeightUpdateEndpoint) -> None:
        super().__init__(endpoint)
        self.methods: list[str] = []

    def call(self, method, kwargs, *, timeout_s):
        self.methods.append(method)
        return super().call(method, kwargs, timeout_s=timeout_s)


def _engine() -> tuple[torch.nn.Module, WeightUpdateEndpoint, Recording]:
    module = _model(0)
    ep = WeightUpdateEndpoint(TorchModuleWeightLoader(module=module), name="eng")
    return module, ep, Recording(ep)


async def _sender(strategy: dict, client: FanOutClient):
    s = ws.build_strategy({"timeout_s": 20, **strategy})
    return await s.create_sender(None, client, await s.create_sync_info(None, client))


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(t, sb[n]) for n, t in a.state_dict().items())


def test_a_one_chunk_update_is_one_call_and_lands_whole():
    module, ep, ch = _engine()
    trainer = _model(1)

    async def run():
        client = FanOutClient([ch])
        assert client.supports_apply_update
        sender = await _sender({"type": "packed_cuda_ipc"}, client)
        try:
            ch.methods.clear()
            extractor = ws.build_extractor({"type": "hf"})
            stats = await sender.send_chunks(extractor.extract_weights(trainer), client,
                                             version=5, manifest=extractor.metadata(trainer))
        finally:
            await sender.close()
        return stats

    stats = asyncio.run(run())
    assert ch.methods == ["apply_update"]
    assert stats.versions == [5] and stats.num_chunks == 1
    assert _equal(module, trainer) and ep.version == 5 and ep.state is EndpointState.IDLE


def test_several_chunks_keep_start_chunk_finish():
    module, ep, ch = _engine()
    trainer = _model(2)
    sd = trainer.state_dict()
    chunks = [WeightChunk([n], [t]) for n, t in sd.items()]

    async def run():
        client = FanOutClient([ch])
        sender = await _sender({"type": "packed_cuda_ipc"}, client)
        try:
            ch.methods.clear()
            return await sender.send_chunks(chunks, client, version=1)
        finally:
            await sender.close()

    stats = asyncio.run(run())
    assert ch.methods == (["start_weight_update"] + ["update_named_weights"] * len(chunks)
                          + ["finish_weight_update"])
    assert stats.versions == [1] and _equal(module, trainer)


def test_cuda_ipc_keeps_the_chunks_of_tensors_it_must_copy():
    """Plain CPU tensors (not in shared weights) are copied into pooled shared memory, which
    the bucket bounds: cuda_ipc does not coalesce them, even from a list the caller holds.
    (Coalescing of the trainer's own memory: tests/integration/strategies/test_strategies_shared.py.)"""
    module, ep, ch = _engine()
    trainer = _model(3)
    sd = trainer.state_dict()
    chunks = [WeightChunk([n], [t]) for n, t in sd.items()]

    async def run():
        client = FanOutClient([ch])
        sender = await _sender({"type": "cuda_ipc"}, client)
        try:
            ch.methods.clear()
            return await sender.send_chunks(chunks, client, version=1)
        finally:
            await sender.close()

    stats = asyncio.run(run())
    # plain CPU tensors are not zero-copy for cuda_ipc: they keep their chunks
    assert stats.num_chunks == len(chunks)
    assert ch.methods[0] == "start_weight_update" and _equal(module, trainer)


def test_refused_start_in_one_call_changes_nothing():
    module, ep, ch = _engine()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    bad = {"0.weight": torch.zeros(32, 16), "oops.weight": torch.zeros(3)}

    async def run():
        client = FanOutClient([ch])
        sender = await _sender({"type": "packed_cuda_ipc"}, client)
        try:
            with pytest.raises(WeightMismatchError, match="oops.weight"):
                await sender.send_chunks([WeightChunk(list(bad), list(bad.values()))], client,
                                         version=1)
        finally:
            await sender.close()

    asyncio.run(run())
    assert ep.version == 0 and ep.state is EndpointState.IDLE
    assert all(torch.equal(t, before[n]) for n, t in module.state_dict().items())


def test_apply_update_with_a_failing_chunk_is_torn_and_refuses_the_rest():
    """Chunk 1 of 3 names a shared-memory segment that does not exist: chunk 0 landed, so the
    weights are torn; chunk 2 is refused; the version stays; the error names the chunk."""
    module, ep, ch = _engine()
    trainer = _model(4)
    sd = trainer.state_dict()
    names = list(sd)

    async def run():
        client = FanOutClient([ch])
        strategy = ws.build_strategy({"type": "cuda_ipc", "timeout_s": 20})
        await strategy.create_sender(None, client, await strategy.create_sync_info(None, client))
        sender = strategy.sender_cls(strategy.cfg)
        try:
            reqs = []
            for i, n in enumerate(names[:3]):
                req = sender.create_request(WeightChunk([n], [sd[n]]))
                req.update_id, req.chunk_index, req.is_last = "u1", i, i == 2
                d = req.to_dict()
                if i == 1:
                    d["handles"][0]["name"] = "ws_no_such_segment"
                reqs.append(d)
            start = ws.WeightUpdateStart(update_id="u1", version=3).to_dict()
            finish = ws.WeightUpdateFinish(update_id="u1", version=3, num_chunks=3).to_dict()
            with pytest.raises(Exception, match="ws_no_such_segment"):
                await client.apply_update(start, reqs, finish)
        finally:
            await sender.close()

    asyncio.run(run())
    assert ep.state is EndpointState.TORN and ep.version == 0
    assert "chunk 1" in ep.last_error
    assert torch.equal(module.state_dict()[names[0]], sd[names[0]])  # chunk 0 had landed


def test_coalesce_merges_runs_and_keeps_order():
    t = [torch.full((2,), float(i)) for i in range(5)]
    chunks = [WeightChunk([f"a{i}"], [t[i]], borrowed=i != 2) for i in range(5)]

    async def run():
        return [c async for c in coalesce(chunks, lambda c: c.borrowed)]

    out = asyncio.run(run())
    assert [c.names for c in out] == [["a0", "a1"], ["a2"], ["a3", "a4"]]
    assert out[0].borrowed and not out[1].borrowed and out[2].tensors[1] is t[4]


def test_peek_single_gives_back_what_it_read():
    async def run(n):
        only, rest = await peek_single(WeightChunk([f"x{i}"], [torch.zeros(1)]) for i in range(n))
        return only, [c.names[0] async for c in rest]

    only, rest = asyncio.run(run(1))
    assert only is not None and only.names == ["x0"] and rest == []
    only, rest = asyncio.run(run(3))
    assert only is None and rest == ["x0", "x1", "x2"]
    only, rest = asyncio.run(run(0))
    assert only is None and rest == []


def test_hf_extractor_marks_borrowed_chunks_unless_it_casts():
    model = _model(5)

    async def chunks(dtype):
        ex = ws.build_extractor({"type": "hf", "bucket_size_mb": 0.001})
        return [c async for c in ex.extract_weights(model, dtype)]

    own = asyncio.run(chunks(None))
    assert len(own) > 1 and all(c.borrowed for c in own)
    cast = asyncio.run(chunks(torch.float64))
    assert cast and not any(c.borrowed for c in cast)


def _shared_pair(seed: int):
    """A trainer whose weights live in shared memory (zero-copy for cuda_ipc on the CPU) and an
    engine endpoint with a torch_module loader."""
    from weightsync.strategies import share_cpu_weights

    trainer = _model(seed)
    shared = share_cpu_weights(trainer)
    module, ep, ch = _engine()
    return trainer, shared, module, ep, ch


def test_repeated_layouts_go_as_references_and_land_exactly():
    """From the second sync on, cuda_ipc sends only a layout key (the trainer's memory is the
    same); the engine reuses what it decoded, and every sync lands the new values. Memory the
    trainer re-allocates is a new layout, sent in full."""
    trainer, shared, module, ep, ch = _shared_pair(6)

    async def run():
        client = FanOutClient([ch])
        sender = await _sender({"type": "cuda_ipc"}, client)
        extractor = ws.build_extractor({"type": "hf"})
        receiver = ep.receiver
        try:
            for v in range(1, 5):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(1.0)  # in place: same memory, new values
                await sender.send_chunks(extractor.extract_weights(trainer), client, version=v)
                assert _equal(module, trainer), v
            assert sender.references == 3  # syncs 2..4
            assert len(receiver.layouts) == 1
            # a re-allocated tensor (the user replaced .data): not shared any more -> a new
            # layout, in full, and still exact
            w = trainer[0].weight
            w.data = w.data.clone() * 3
            await sender.send_chunks(extractor.extract_weights(trainer), client, version=5)
            assert _equal(module, trainer)
            assert sender.references == 3
        finally:
            await sender.close()

    try:
        asyncio.run(run())
    finally:
        shared.close()


def test_a_reference_the_engine_does_not_hold_is_refused_clearly():
    trainer, shared, module, ep, ch = _shared_pair(7)

    async def run():
        client = FanOutClient([ch])
        sender = await _sender({"type": "cuda_ipc"}, client)
        extractor = ws.build_extractor({"type": "hf"})
        try:
            await sender.send_chunks(extractor.extract_weights(trainer), client, version=1)
            ep.receiver.layouts.clear()  # as if another sender had re-initialised the engine
            with pytest.raises(ws.WeightSyncError, match="does not hold"):
                await sender.send_chunks(extractor.extract_weights(trainer), client, version=2)
            assert ep.version == 1 and ep.state is EndpointState.IDLE  # refused before loading
            # the sender forgot its layouts after the failure: the next sync is sent in full
            await sender.send_chunks(extractor.extract_weights(trainer), client, version=3)
            assert ep.version == 3 and _equal(module, trainer)
        finally:
            await sender.close()

    try:
        asyncio.run(run())
    finally:
        shared.close()


def test_cached_views_are_rebuilt_after_a_mapping_was_dropped():
    trainer, shared, module, ep, ch = _shared_pair(8)

    async def run():
        client = FanOutClient([ch])
        sender = await _sender({"type": "cuda_ipc"}, client)
        extractor = ws.build_extractor({"type": "hf"})
        try:
            await sender.send_chunks(extractor.extract_weights(trainer), client, version=1)
            receiver = ep.receiver
            (layout,) = receiver.layouts.values()
            first = layout.views
            receiver.buffers.segments.close()  # every mapping dropped: the epoch moves on
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(-1.0)
            await sender.send_chunks(extractor.extract_weights(trainer), client, version=2)
            assert sender.references == 1 and _equal(module, trainer)
            assert layout.views is not first  # rebuilt over the new mappings
        finally:
            await sender.close()

    try:
        asyncio.run(run())
    finally:
        shared.close()
