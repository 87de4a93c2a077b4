"""The streamed broadcast (``weightsync/strategies/_stream.py``): what a chunk's collectives are,
and whole updates between a sender and engines in this process over a real gloo group (threads
of this process), into ``torch_module`` loaders whose large tensors are written in place.

Faults between real processes (an engine killed or stopped mid-stream, a chunk corrupted in
transit) are in ``tests/integration/test_engine_faults.py``; vLLM engines in
``tests/integration/loaders``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import weightsync as ws
from weightsync.errors import WeightMismatchError
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.pipeline import make_chunks
from weightsync.strategies._stream import (
    ALIGN,
    PACK_BYTES,
    SMALL_BYTES,
    WIRE_VERSION,
    Staging,
    StreamReceiver,
    plan_transfers,
)
from weightsync.types import TensorMeta


def _meta(name: str, nbytes: int, dtype: str = "uint8") -> TensorMeta:
    return TensorMeta(name, dtype, [nbytes])


# -- a chunk's collectives ----------------------------------------------------------------------


def test_large_tensors_go_alone_in_order_and_small_ones_are_packed_after_them():
    metas = [_meta("norm", 100), _meta("q", SMALL_BYTES), _meta("bias", 10, "float32"),
             _meta("empty", 0), _meta("k", 3 * SMALL_BYTES), _meta("b2", 7),
             _meta("mid", SMALL_BYTES - 1)]
    plan = plan_transfers(metas)
    assert [(t.members, t.packed) for t in plan] == [((1,), False), ((4,), False),
                                                     ((0, 2, 5, 6), True)]
    pack = plan[-1]
    assert pack.offsets == (0, ALIGN, 2 * ALIGN, 3 * ALIGN)  # each small tensor starts aligned
    assert pack.nbytes == 3 * ALIGN + SMALL_BYTES - 1
    # the request's thresholds: below 1 KB packed, in buffers of at most 2 KB
    plan = plan_transfers(metas, 1024, 2048)
    assert [(t.members, t.packed) for t in plan] == [
        ((1,), False), ((4,), False), ((6,), False), ((0, 2, 5), True)]


def test_packs_are_split_at_the_pack_limit():
    n = SMALL_BYTES - 1
    metas = [_meta(f"s{i}", n) for i in range(PACK_BYTES // SMALL_BYTES + 3)]
    plan = plan_transfers(metas)
    assert len(plan) == 2 and all(t.packed and t.nbytes <= PACK_BYTES for t in plan)
    assert [i for t in plan for i in t.members] == list(range(len(metas)))  # all, in order


def test_a_staging_buffer_keeps_a_layouts_views_until_it_is_replaced():
    staging = Staging("cpu")
    built = []

    def build(tag):
        def make():
            built.append(tag)
            return staging.get(8)[:4]
        return make

    staging.get(64)
    first = staging.views("a", build("a"))
    assert staging.views("a", build("a")) is first and built == ["a"]  # made once
    staging.get(32)  # fits: the same buffer, the views stay
    assert staging.views("a", build("a")) is first and built == ["a"]
    staging.get(128)  # a bigger buffer: the old views (and their memory) are dropped
    assert staging.views("a", build("a")) is not first and built == ["a", "a"]
    staging.close()
    assert staging.nbytes == 0 and staging.views("b", build("b")) is not None


# -- whole updates -------------------------------------------------------------------------------


class Net(torch.nn.Module):
    """Two tensors above ``SMALL_BYTES`` (received in place) and three small ones (packed)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.big = torch.nn.Linear(512, 1024)  # 2 MiB weight, 4 KiB bias
        self.head = torch.nn.Linear(1024, 300)  # 1.2 MiB weight
        self.norm = torch.nn.LayerNorm(300, elementwise_affine=False)
        self.register_buffer("scale", torch.full((4,), float(seed)))


def _engine(seed: int = 0) -> tuple[Net, ws.WeightUpdateEndpoint]:
    module = Net(seed)
    return module, ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=module), name="eng0")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                 strict=True))


def _run(coro):
    return asyncio.run(coro)


# tensors of 1 MB and more alone (into the module's own tensors), smaller ones packed
STREAM = {"type": "broadcast", "backend": "gloo", "bucket_size_mb": 2.5, "timeout_s": 20,
          "pack_below_mb": 1, "pack_mb": 64}


def test_a_stream_lands_bit_exact_with_the_large_tensors_written_in_place():
    module, ep = _engine()

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            stats = []
            for v in (1, 2):
                stats.append(await sync.push(Net(v), version=v))
                receiver = ep.receiver
                direct, staged = receiver.stream.direct, receiver.stream.staging.nbytes
                assert _same(module, Net(v)), v
                assert direct == 2 * v, direct  # big.weight and head.weight, every update
                assert staged < 64 * 1024, staged  # staging held only the small tensors
            return stats

    stats = _run(go())
    assert [s.versions for s in stats] == [[1], [2]]
    assert stats[0].num_chunks == 2 and stats[0].num_tensors == 5  # two chunks on the wire
    assert ep.loader.loads >= 2


def test_with_the_default_packing_every_small_tensor_travels_packed_and_lands_exact():
    """Net's tensors are all under the default ``pack_below_mb`` (16): each chunk is one packed
    broadcast, loaded through the loader, nothing written in place; the request carries the
    thresholds and the wire version."""
    module, ep = _engine()
    cfg = {k: v for k, v in STREAM.items() if not k.startswith("pack")}
    seen = []

    async def go():
        async with ws.connect([ep], cfg, device="cpu") as sync:
            original = ep.receiver.stream.run

            async def spy(request, sink, prepared=None):
                seen.append(request)
                await original(request, sink, prepared)

            ep.receiver.stream.run = spy
            return await sync.push(Net(5), version=1), ep.receiver.stream.direct

    stats, direct = _run(go())
    assert stats.versions == [1] and stats.num_chunks == 2 and _same(module, Net(5))
    assert direct == 0
    (req,) = seen
    assert (req.pack_below_bytes, req.pack_bytes) == (SMALL_BYTES, PACK_BYTES)
    assert req.wire_version == WIRE_VERSION


def test_an_engine_refuses_another_wire_version_before_any_byte_moves():
    """A sender of another weightsync version (its stream's collectives in another order).
    Setting the sender's private wire version is the only way to have two versions on one
    machine; the engine's refusal, the vote and the unchanged weights are real."""
    module, ep = _engine()
    before = {n: t.clone() for n, t in module.state_dict().items()}

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            sync.sender._wire = WIRE_VERSION - 1
            with pytest.raises(ws.WeightSyncError, match="wire version 1, this engine speaks 2"):
                await sync.push(Net(6), version=1)
            unchanged = all(torch.equal(t, before[n]) for n, t in module.state_dict().items())
            return unchanged, await sync.push(Net(6), version=2)  # a fresh sender

    unchanged, stats = _run(go())
    assert unchanged and stats.versions == [2] and _same(module, Net(6))


def test_later_updates_reuse_the_views_of_the_first_on_both_sides():
    """Every update of one model cuts its chunks alike: the engine hands the loader the same
    staging views each time, and the sender packs into the same views (made once)."""
    module, ep = _engine()
    cfg = {k: v for k, v in STREAM.items() if not k.startswith("pack")}  # everything packed
    seen: list[list[int]] = []

    async def go():
        async with ws.connect([ep], cfg, device="cpu") as sync:
            loader = ep.loader
            original = loader.load_weights

            async def spy(named):
                seen[-1].extend(id(t) for t in named.values())
                await original(named)

            loader.load_weights = spy
            for v in (1, 2, 3):
                seen.append([])
                assert (await sync.push(Net(v), version=v)).versions == [v]
                assert _same(module, Net(v)), v
            packs = sync.sender._packs
            return [len(p._views) for p in packs], len(ep.receiver.stream.staging._views)

    (sent0, sent1), received = _run(go())
    assert seen[0] and seen[0] == seen[1] == seen[2]  # the same view objects every update
    assert sent0 >= 1 and sent1 >= 1 and received >= 1  # made once per chunk layout


def test_a_staged_stream_writes_nothing_in_place():
    module, ep = _engine()
    cfg = {**STREAM, "staged": True, "checksum": True}

    async def go():
        async with ws.connect([ep], cfg, device="cpu") as sync:
            return await sync.push(Net(3), version=1), ep.receiver.stream.direct

    stats, direct = _run(go())
    assert stats.versions == [1] and direct == 0 and _same(module, Net(3))


def test_chunks_that_do_not_follow_the_manifest_are_refused_and_the_group_stays_in_step():
    module, ep = _engine()
    src = Net(4)
    named = list(src.state_dict().items())

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            manifest = [TensorMeta(n, "float32", list(t.shape)) for n, t in reversed(named)]
            with pytest.raises(ValueError, match="must follow the manifest"):
                await sync.push_chunks(make_chunks(named), manifest, version=1)
            sender = sync.sender
            assert (await sync.push(src, version=2)).versions == [2]
            return sender is sync.sender  # the same group carried the next update

    assert _run(go()) and _same(module, Net(4))


def test_an_extraction_that_fails_mid_stream_raises_its_own_error_and_the_next_push_lands():
    module, ep = _engine()
    src = Net(5)
    named = list(src.state_dict().items())
    manifest = [TensorMeta(n, "float32", list(t.shape)) for n, t in named]

    def failing():
        chunks = list(make_chunks(named, bucket_size_mb=2.5))
        yield chunks[0]
        raise RuntimeError("the trainer's gather broke")

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            with pytest.raises(RuntimeError, match="gather broke"):
                await sync.push_chunks(failing(), manifest, version=1)
            status = (await sync.status())[0]
            stats = await sync.push(src, version=2)
            return status, stats

    status, stats = _run(go())
    # the first chunk was written in place, then the engine heard the abort: torn, not v1
    assert status["state"] == "torn" and "aborted its stream" in status["last_error"], status
    assert status["version"] == 0
    assert stats.versions == [2] and _same(module, src)


def test_a_refused_manifest_moves_nothing_and_the_session_keeps_its_group():
    module, ep = _engine()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    bad = {n: (t[:10] if n == "big.weight" else t) for n, t in Net(6).state_dict().items()}

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            with pytest.raises(WeightMismatchError, match="big.weight"):
                await sync.push(bad, version=1)
            sender = sync.sender
            assert all(torch.equal(t, before[n]) for n, t in module.state_dict().items())
            stats = await sync.push(Net(6), version=1)
            return stats, sender is sync.sender

    stats, kept = _run(go())
    assert stats.versions == [1] and kept and _same(module, Net(6))


def test_the_extraction_starts_only_once_every_engine_voted():
    """Extraction code that waits for the device (an ``.item()``, a synchronize) waits for the
    sender's pending vote, whose peers need the event loop to send them the request; on GPU that
    deadlocked (a bench probe that synchronised between chunks, 2 x H100, 2026-11-25). Here the
    extraction blocks the loop until the engine has voted, as the device would."""
    import threading

    module, ep = _engine()
    src = Net(7)
    named = list(src.state_dict().items())
    manifest = [TensorMeta(n, "float32", list(t.shape)) for n, t in named]
    voted = threading.Event()

    def extraction():
        assert voted.wait(10), "the extraction ran before the engine had voted"
        yield from make_chunks(named, bucket_size_mb=2.5)

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            receiver = ep.receiver
            vote = receiver._vote_yes
            receiver._vote_yes = lambda issued: (vote(issued), voted.set())[0]
            return await sync.push_chunks(extraction(), manifest, version=1)

    assert _run(go()).versions == [1] and _same(module, src)


def test_a_push_cancelled_mid_stream_aborts_it_and_the_sender_goes_on():
    """The caller cancels while the extraction is between chunks: the sender tells the engines
    (an abort on the data plane), so its group stays in step and the next update lands."""
    from weightsync.clients import FanOutClient

    module, ep = _engine()
    src = Net(8)
    named = list(src.state_dict().items())
    manifest = [TensorMeta(n, "float32", list(t.shape)) for n, t in named]

    async def slow():
        chunks = list(make_chunks(named, bucket_size_mb=2.5))
        yield chunks[0]
        await asyncio.sleep(30)  # the trainer is busy; the caller gives up meanwhile
        yield chunks[1]

    async def go():
        client = FanOutClient([ep], timeout_s=20)
        strategy = ws.build_strategy({**STREAM})
        sender = await strategy.create_sender(None, client,
                                              await strategy.create_sync_info(None, client))
        try:
            push = asyncio.ensure_future(sender.send_chunks(slow(), client, manifest=manifest,
                                                            version=1))
            await asyncio.sleep(1.0)
            push.cancel()
            with pytest.raises(asyncio.CancelledError):
                await push
            for _ in range(100):  # the engine hears the abort a moment later
                state = (await client.status())[0]
                if state["state"] != "receiving":
                    break
                await asyncio.sleep(0.05)
            stats = await sender.send_chunks(make_chunks(named, bucket_size_mb=2.5), client,
                                             manifest=manifest, version=2)
            return state, stats
        finally:
            await sender.close()
            await client.close_weight_transfer()

    state, stats = _run(go())
    assert state["state"] == "torn" and "aborted its stream" in state["last_error"], state
    assert stats.versions == [2] and _same(module, src)


def test_a_gloo_group_never_asks_for_grouped_broadcasts():
    """``group_calls`` (default on) applies to NCCL only: on gloo the request says ``grouped:
    false`` and the update lands as one call per tensor."""
    module, ep = _engine()

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            assert sync.strategy.cfg.group_calls is True
            assert sync.sender.group.can_group() is False and sync.sender._grouped is False
            return await sync.push(Net(8), version=1)

    assert _run(go()).versions == [1] and _same(module, Net(8))


def test_an_engine_that_cannot_group_refuses_a_grouped_update_before_any_byte_moves():
    """A sender that asks for grouped NCCL broadcasts reaching an engine whose group cannot issue
    them (here: gloo). Forcing the sender's private flag is the only way to cause this mismatch
    on one CPU machine (it needs two torch builds); the receiver's refusal, the vote and the
    unchanged engine are real."""
    module, ep = _engine()
    before = {n: t.clone() for n, t in module.state_dict().items()}

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            sync.sender._grouped = True
            with pytest.raises(ws.WeightSyncError, match="group_calls: false"):
                await sync.push(Net(9), version=1)
            unchanged = all(torch.equal(t, before[n]) for n, t in module.state_dict().items())
            return unchanged, await sync.push(Net(9), version=2)  # a fresh sender: not grouped

    unchanged, stats = _run(go())
    assert unchanged and stats.versions == [2] and _same(module, Net(9))


@pytest.mark.parametrize(("overlap_limit", "overlap"), [
    (StreamReceiver.OVERLAP_STAGING, True), (0, True), (StreamReceiver.OVERLAP_STAGING, False)])
def test_a_staged_multi_chunk_stream_lands_with_and_without_overlapping_its_chunks(
        overlap_limit, overlap, monkeypatch):
    """Chunk k + 1 is posted before chunk k lands, into the other staging buffer; a chunk that
    needs more staging than ``OVERLAP_STAGING`` waits for the one before it and uses the first
    buffer only; ``overlap_chunks: false`` moves one chunk at a time on both sides. Every way
    every chunk lands, checksums checked, bit for bit."""
    monkeypatch.setattr(StreamReceiver, "OVERLAP_STAGING", overlap_limit)
    module, ep = _engine()
    cfg = {**STREAM, "staged": True, "checksum": True, "bucket_size_mb": 1.5,
           "overlap_chunks": overlap}

    async def go():
        async with ws.connect([ep], cfg, device="cpu") as sync:
            stats = await sync.push(Net(7), version=1)
            stream = ep.receiver.stream
            return stats, stream.staging.nbytes, stream.spare.nbytes

    stats, first, spare = _run(go())
    assert stats.versions == [1] and stats.num_chunks >= 3 and _same(module, Net(7))
    assert first > 0
    assert (spare > 0) if overlap_limit and overlap else (spare == 0)


def test_the_first_chunk_is_planned_while_the_vote_is_out_and_only_used_when_it_matches():
    """An update with the same names as the last one gets its first chunk's receive plan while
    its vote is out (cut as the last update's first chunk was); the header decides: the same
    cut uses it, another cut (the same tensors in other chunks) is planned anew. Every update
    lands exact, its large tensors in place."""
    module, ep = _engine()
    src = Net(1)
    names = list(src.state_dict())
    metas = [TensorMeta(n, "float32", list(t.shape)) for n, t in src.state_dict().items()]
    planned = []

    def chunks(model, cuts):
        sd = model.state_dict()
        return [ws.WeightChunk(names[a:b], [sd[n] for n in names[a:b]]) for a, b in cuts]

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            stream = ep.receiver.stream
            original = stream.prepare

            def spy(request, sink, metas=None):
                prepared = original(request, sink, metas)
                planned.append(prepared.first if prepared.chunk is not None else None)
                return prepared

            stream.prepare = spy
            for v, cuts in ((1, [(0, 2), (2, 5)]), (2, [(0, 2), (2, 5)]), (3, [(0, 3), (3, 5)]),
                            (4, [(0, 3), (3, 5)])):
                model = Net(v)
                stats = await sync.push_chunks(chunks(model, cuts), metas, version=v)
                assert stats.versions == [v] and _same(module, model), v
            return stream.direct

    direct = _run(go())
    # first update: nothing to go by; then the last update's first cut (2), right for v2,
    # wrong for v3 (3 entries came: planned anew), right again for v4
    assert planned == [None, 2, 2, 3]
    assert direct == 2 * 4  # big.weight and head.weight in place every update


# -- replays: an update of the very chunks of the last one ----------------------------------------


def _bump(model: torch.nn.Module, by: float) -> None:
    """A training step's effect: every tensor changed in place (the same tensor objects)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(by)


def test_an_update_of_the_same_held_chunks_is_replayed_by_reference_and_lands_exact():
    """The front door holds the model's update (views of its own tensors) from its second push
    on: the push after that sends a request that refers to the layout the engine keeps (no
    entries) and a start that refers to the manifest it keeps, and every update lands
    bit-exact, its large tensors still written in place."""
    module, ep = _engine()
    src = Net(1)
    requests: list[dict] = []
    starts: list[dict] = []

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            receiver = ep.receiver
            parse, start = receiver.parse_request, ep.start_weight_update

            def parse_spy(d):
                requests.append(d)
                return parse(d)

            async def start_spy(d):
                starts.append(d)
                return await start(d)

            receiver.parse_request, ep.start_weight_update = parse_spy, start_spy
            for v in (1, 2, 3, 4):
                assert (await sync.push(src, version=v)).versions == [v]
                assert _same(module, src), v
                _bump(src, 0.5)
            return sync.sender.replayed, receiver.stream.direct

    replayed, direct = _run(go())
    assert replayed == 2  # the first push extracts; the second sends the held update in full
    full, *later = requests[1:]
    assert full["names"] and full["layout_key"]
    assert all(r["names"] == r["dtypes"] == r["shapes"] == []
               and r["layout_key"] == full["layout_key"] for r in later)
    assert all(s["manifest"] and not s.get("manifest_of") for s in starts[:2])
    assert all(s["manifest"] is None and s["manifest_of"] == starts[1]["update_id"]
               for s in starts[2:])
    assert direct == 2 * 4  # big.weight and head.weight in place every update


def test_a_replaced_tensor_or_another_list_is_sent_in_full():
    """A replay is for the very chunks of the last update: a model whose tensor was replaced
    (a new object), and chunks of another list, are sent in full; the same list again is
    replayed, with the values its tensors hold now. Every update lands exact."""
    module, ep = _engine()
    src = Net(1)

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            await sync.push(src, version=1)
            with torch.no_grad():
                src.head.weight = torch.nn.Parameter(src.head.weight + 1)  # a new tensor
            assert (await sync.push(src, version=2)).versions == [2]
            assert _same(module, src)
            after_replace = sync.sender.replayed
            sd = Net(3).state_dict()
            chunks = list(make_chunks(list(sd.items()), bucket_size_mb=2.5))
            metas = [m for c in chunks for m in c.metas()]
            await sync.push_chunks(chunks, metas, version=3)
            listed = [ws.WeightChunk(list(c.names), list(c.tensors)) for c in chunks]
            await sync.push_chunks(listed, metas, version=4)  # equal, not the same chunks
            assert all(torch.equal(t, sd[n]) for n, t in module.state_dict().items())
            in_full = sync.sender.replayed
            for t in sd.values():
                t.mul_(2)
            await sync.push_chunks(listed, metas, version=5)  # the same list: replayed
            assert all(torch.equal(t, sd[n]) for n, t in module.state_dict().items())
            return after_replace, in_full, sync.sender.replayed

    after_replace, in_full, replayed = _run(go())
    assert after_replace == 0 and in_full == 0 and replayed == 1


def test_a_replay_the_engine_cannot_take_is_refused_before_any_byte_and_the_group_goes_on():
    """An engine that no longer holds what a replay refers to. Its manifest (an endpoint keeps
    the last 8; another trainer's updates can push it out): the one engine refuses the start,
    nothing moves, the sender sends the update in full at once. Its layout (only a receiver
    re-initialised by another sender loses it, and then it is in another group): the engine
    votes no, the push fails saying so, the group stays in step and the next push lands.
    Forgetting is done by clearing the engine's caches: the only way to cause either in one
    sender's session."""
    module, ep = _engine()
    src = Net(1)

    async def go():
        async with ws.connect([ep], STREAM, device="cpu") as sync:
            for v in (1, 2):  # the second push sends the held update in full
                await sync.push(src, version=v)
            _bump(src, 1.0)
            ep._manifests.clear()
            assert (await sync.push(src, version=3)).versions == [3]  # in full, at once
            assert _same(module, src) and sync.sender.replayed == 1
            _bump(src, 1.0)
            assert (await sync.push(src, version=4)).versions == [4]  # replayed again
            assert _same(module, src) and sync.sender.replayed == 2
            before = {n: t.clone() for n, t in module.state_dict().items()}
            _bump(src, 1.0)
            ep.receiver.layouts.clear()
            with pytest.raises(ws.WeightSyncError, match="does not hold"):
                await sync.push(src, version=5)
            unchanged = all(torch.equal(t, before[n]) for n, t in module.state_dict().items())
            assert (await sync.push(src, version=6)).versions == [6]  # the same group
            return unchanged

    unchanged = _run(go())
    assert unchanged and _same(module, src)


def test_two_engines_take_a_replay_with_the_manifest_in_full():
    """With several engines the start goes out alone first and carries the manifest (an engine
    that no longer held it would refuse while the others accepted); the request still refers
    to the layout. Both engines land every update exact."""
    (m0, e0), m1 = _engine(), Net(5)
    e1 = ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=m1), name="eng1")
    src = Net(1)
    starts: list[dict] = []

    async def go():
        async with ws.connect([e0, e1], STREAM, device="cpu") as sync:
            original = e1.start_weight_update

            async def start_spy(start):
                starts.append(start)
                return await original(start)

            e1.start_weight_update = start_spy
            for v in (1, 2, 3, 4):
                assert (await sync.push(src, version=v)).versions == [v, v]
                assert _same(m0, src) and _same(m1, src), v
                _bump(src, 0.25)
            return sync.sender.replayed

    assert _run(go()) == 2
    assert all(s["manifest"] and not s.get("manifest_of") for s in starts)
