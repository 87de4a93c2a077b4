"""The machinery under ``fsdp``/``deepspeed`` (``weightsync.extractors._gather``), in one process.

``_CloneExtractor`` "gathers" by cloning (a fresh allocation per parameter, like
``full_tensor()``), and counts its calls; the real collectives are covered by the 2-rank
integration tests. Here: bucket layout, no gather for metadata, back-pressure under the real
``WeightTransferSender`` pipeline with a slow transfer, no deadlock for consumers that keep
chunks, drain on abort, non-senders keep nothing.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from weightsync.extractors._gather import GatheringExtractor, ShardedExtractorConfig
from weightsync.interfaces import InferenceEngineClient, WeightTransferSender
from weightsync.pipeline import make_chunks
from weightsync.types import WeightUpdateRequest


class _CloneExtractor(GatheringExtractor):
    backend_name = "clone"

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)
        self.gathered: list[int] = []

    def _gather(self, sources, keep):
        self.gathered.append(len(sources))
        return [(s.detach().clone(), True) if keep else None for s in sources]


def _model(layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential()
    m.add_module("embed", torch.nn.Embedding(64, 32))
    for i in range(layers):
        m.add_module(f"l{i}", torch.nn.Linear(32, 32))
    m.add_module("norm", torch.nn.LayerNorm(32))
    m.add_module("head", torch.nn.Linear(32, 64, bias=False))
    m.head.weight = m.embed.weight  # tied
    return m


def _cfg(**kw) -> ShardedExtractorConfig:
    base = dict(bucket_size_mb=10_000 / (1 << 20), rank=0)
    base.update(kw)
    return ShardedExtractorConfig(**base)


async def _collect(ext, model, dtype=None):
    return [c async for c in ext.extract_weights(model, dtype)]


def test_layout_matches_base_batching_and_metadata_needs_no_gather() -> None:
    model = _model()
    ext = _CloneExtractor(_cfg())
    metas = ext.metadata(model, torch.bfloat16)
    assert ext.gathered == []  # metadata: no gather
    names = [m.name for m in metas]
    assert "embed.weight" in names and "head.weight" not in names  # tied: once, as embedding
    assert all(m.dtype == "bfloat16" for m in metas)

    chunks = asyncio.run(_collect(ext, model, torch.bfloat16))
    plain = list(model.state_dict().items())
    plain = [(n, t.to(torch.bfloat16)) for n, t in plain if n != "head.weight"]
    want = list(make_chunks(iter(plain), bucket_size_mb=ext.cfg.bucket_size_mb))
    assert [c.names for c in chunks] == [c.names for c in want]
    for c, w in zip(chunks, want, strict=True):
        for a, b in zip(c.tensors, w.tensors, strict=True):
            assert torch.equal(a, b) and a.dtype == torch.bfloat16
    assert [m.name for m in metas] == [n for c in chunks for n in c.names]


def test_non_sender_yields_and_keeps_nothing_but_gathers_everything() -> None:
    model = _model()
    ext = _CloneExtractor(_cfg(rank=1, src_rank=0))
    assert not ext.is_sender
    assert asyncio.run(_collect(ext, model)) == []
    assert sum(ext.gathered) == len(ext.metadata(model))
    assert ext.memory.peak_bytes == 0


class _MemoryClient(InferenceEngineClient):
    async def get_world_sizes(self):
        return [1]

    async def init_weight_transfer(self, strategy_cfg, sync_info):
        return None

    async def start_weight_update(self, start):
        return None

    async def update_named_weights(self, request):
        return None

    async def finish_weight_update(self, finish):
        return [1]


class _SlowSender(WeightTransferSender):
    """Holds each chunk for a while during 'transfer' (the slow network of a real sync)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def create_request(self, chunk):
        return WeightUpdateRequest(names=chunk.names, dtypes=chunk.dtype_names, shapes=chunk.shape_lists)

    async def _transfer(self, chunk, request, client):
        await asyncio.sleep(self.delay)
        await client.update_named_weights(request.to_dict())


@pytest.mark.parametrize(("max_live", "bounded"), [(2, True), (0, False)])
def test_backpressure_bounds_live_gathered_bytes(max_live: int, bounded: bool) -> None:
    model = _model(layers=12)
    bucket = 3 * 33 * 32 * 4  # three Linear(32, 32) modules
    ext = _CloneExtractor(_cfg(bucket_size_mb=bucket / (1 << 20), max_live_chunks=max_live))

    async def run():
        return await _SlowSender(0.02).send_chunks(ext.extract_weights(model), _MemoryClient())

    stats = asyncio.run(run())
    assert stats.num_chunks >= 5
    peak = ext.memory.peak_bytes
    if bounded:
        assert 0 < peak <= 2 * bucket, (peak, bucket)
    else:  # the sender pipeline alone keeps up to 3 chunks alive: back-pressure is what bounds it
        assert peak > 2 * bucket, (peak, bucket)
    assert ext.memory.live_bytes == 0


def test_consumer_that_keeps_chunks_does_not_deadlock() -> None:
    model = _model()
    ext = _CloneExtractor(_cfg(bucket_size_mb=3000 / (1 << 20)))
    chunks = asyncio.run(_collect(ext, model))  # keeps every chunk: nothing could free them
    assert len(chunks) >= 3
    assert ext.memory.live_bytes == sum(c.total_size_bytes for c in chunks)


def test_abort_drains_the_remaining_gathers() -> None:
    model = _model()
    ext = _CloneExtractor(_cfg(bucket_size_mb=3000 / (1 << 20)))
    total = len(ext.metadata(model))

    async def first_only():
        gen = ext.extract_weights(model)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                break

    asyncio.run(first_only())
    assert sum(ext.gathered) == total  # every parameter still went through the (collective) gather


def test_send_extracted_keeps_every_rank_in_the_gathers() -> None:
    """``pipeline.send_extracted`` (the front door's and the publisher's one extraction per
    update): each rank runs every gather exactly once, whether the send succeeds, fails before
    the stream started (a refused manifest: the sending rank drains) or fails part-way (the
    stream itself finishes the gathers)."""
    from weightsync.pipeline import send_extracted

    model = _model()
    total = len(_CloneExtractor(_cfg()).metadata(model))

    def run(ext, send):
        return asyncio.run(send_extracted(ext, model, None, send))

    async def consume(stream):
        return [c.names async for c in stream()]

    ok = _CloneExtractor(_cfg(bucket_size_mb=3000 / (1 << 20)))
    names = run(ok, consume)
    assert [n for c in names for n in c] == [m.name for m in ok.metadata(model)]
    assert sum(ok.gathered) == total and ok.runs_started == 1

    async def refused(stream):
        raise ValueError("refused at start")

    before = _CloneExtractor(_cfg())
    with pytest.raises(ValueError, match="refused at start"):
        run(before, refused)
    assert sum(before.gathered) == total and before.runs_started == 0  # drained, not extracted

    async def first_then_fail(stream):
        async with contextlib.aclosing(stream()) as gen:
            async for _ in gen:
                raise RuntimeError("engine died")

    midway = _CloneExtractor(_cfg(bucket_size_mb=3000 / (1 << 20)))
    with pytest.raises(RuntimeError, match="engine died"):
        run(midway, first_then_fail)
    assert sum(midway.gathered) == total and midway.runs_started == 1  # no second drain

    other = _CloneExtractor(_cfg(rank=1, src_rank=0))
    assert run(other, refused) is None  # not the sending rank: send is never called
    assert sum(other.gathered) == total


def test_unmerged_lora_names_are_refused_before_any_gather() -> None:
    model = torch.nn.Module()
    model.register_module("q_proj", torch.nn.Module())
    model.q_proj.register_module("lora_A", torch.nn.ModuleDict({"default": torch.nn.Linear(2, 2)}))
    ext = _CloneExtractor(_cfg())
    with pytest.raises(ValueError, match="unmerged"):
        asyncio.run(_collect(ext, model))
    assert ext.gathered == []
