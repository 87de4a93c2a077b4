"""``weightsync.pipeline.SendPipeline``: window bound, order, one outcome per request, first
failure stops, cancellation settles, never-transferred requests are released; and the receiver
base class's template (validation before any byte, refusal on a mismatch).

The pipeline is machinery over three callables (prepare, transfer, release); the tests give it
plain functions that record what happened and wait on events. No transport is involved.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from weightsync.errors import WeightMismatchError
from weightsync.interfaces import WeightTransferReceiver
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.pipeline import SendPipeline, make_chunks
from weightsync.types import SyncStats, WeightChunk, WeightUpdateRequest


def _chunks(n: int) -> list[WeightChunk]:
    return [WeightChunk([f"layer{i}.weight"], [torch.full((4,), float(i))]) for i in range(n)]


class Recorder:
    """prepare/transfer/release that record every call; transfers take ``delay`` seconds and
    chunk ``fail_at`` raises."""

    def __init__(self, delay: float = 0.02, fail_at: int | None = None) -> None:
        self.delay = delay
        self.fail_at = fail_at
        self.prepared: list[int] = []
        self.started: list[int] = []
        self.finished: list[int] = []
        self.released: list[int] = []
        self.inflight = 0
        self.peak = 0
        self.lock = threading.Lock()

    def prepare(self, chunk: WeightChunk) -> WeightUpdateRequest:
        with self.lock:
            self.prepared.append(int(chunk.names[0][5:].split(".")[0]))
        return WeightUpdateRequest(names=chunk.names, dtypes=chunk.dtype_names, shapes=chunk.shape_lists)

    async def transfer(self, chunk: WeightChunk, request: WeightUpdateRequest) -> None:
        self.started.append(request.chunk_index)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await asyncio.sleep(self.delay)
            if request.chunk_index == self.fail_at:
                raise ConnectionError(f"chunk {request.chunk_index} lost")
            self.finished.append(request.chunk_index)
        finally:
            self.inflight -= 1

    def release(self, request: WeightUpdateRequest) -> None:
        with self.lock:
            self.released.append(request.chunk_index)

    def pipeline(self, window: int, **kw) -> SendPipeline:
        return SendPipeline(prepare=self.prepare, transfer=self.transfer, release=self.release,
                            window=window, **kw)


def _stamp(request: WeightUpdateRequest, index: int, is_last: bool) -> None:
    request.update_id, request.chunk_index, request.is_last = "u", index, is_last


@pytest.mark.parametrize("window", [1, 2, 3])
def test_window_bounds_transfers_and_keeps_order(window):
    rec = Recorder()
    stats = SyncStats(update_id="u")
    asyncio.run(rec.pipeline(window).run(_chunks(7), stats, _stamp))
    assert rec.started == list(range(7)) and rec.finished == list(range(7))
    assert rec.peak == window
    assert sorted(rec.released) == list(range(7))
    assert (stats.num_chunks, stats.num_tensors, stats.total_bytes) == (7, 7, 7 * 16)


def test_no_overlap_means_one_at_a_time_prepared_after_the_previous_ended():
    rec = Recorder()
    order: list[str] = []
    prep = rec.prepare

    def prepare(chunk):
        order.append(f"prepare {chunk.names[0]} finished={len(rec.finished)}")
        return prep(chunk)

    p = SendPipeline(prepare=prepare, transfer=rec.transfer, release=rec.release, window=3,
                     overlap=False)
    asyncio.run(p.run(_chunks(3), SyncStats(update_id="u"), _stamp))
    assert rec.peak == 1
    assert order == [f"prepare layer{i}.weight finished={i}" for i in range(3)]


def test_last_chunk_is_marked_and_async_streams_work():
    seen: list[tuple[int, bool]] = []
    rec = Recorder(delay=0)

    async def stream():
        for c in _chunks(3):
            await asyncio.sleep(0)
            yield c

    def stamp(request, index, is_last):
        _stamp(request, index, is_last)
        seen.append((index, is_last))

    asyncio.run(rec.pipeline(2).run(stream(), SyncStats(update_id="u"), stamp))
    assert seen == [(0, False), (1, False), (2, True)]


def test_first_failure_stops_the_update_and_every_request_is_released_once():
    rec = Recorder(delay=0.05, fail_at=2)
    stats = SyncStats(update_id="u")
    with pytest.raises(ConnectionError, match="chunk 2 lost"):
        asyncio.run(rec.pipeline(2).run(_chunks(10), stats, _stamp))
    # chunk 3 was in flight with chunk 2 (window 2) and ended in its grace; nothing after it
    # started; the request prepared for chunk 4 was released without a transfer
    assert rec.started == [0, 1, 2, 3]
    assert 3 in rec.finished
    assert max(rec.prepared) <= 4
    assert sorted(rec.released) == sorted(rec.prepared)  # one outcome per prepared request
    assert len(set(rec.released)) == len(rec.released)
    assert stats.num_chunks == 4


def test_a_failing_stream_releases_the_prepared_request():
    rec = Recorder(delay=0.01)

    async def stream():
        yield _chunks(1)[0]
        raise RuntimeError("extraction failed")

    with pytest.raises(RuntimeError, match="extraction failed"):
        asyncio.run(rec.pipeline(2).run(stream(), SyncStats(update_id="u"), _stamp))
    assert rec.prepared == [0] and rec.started == [] and len(rec.released) == 1


def test_cancellation_settles_transfers_in_flight_and_releases_everything():
    rec = Recorder(delay=0.2)

    async def go():
        task = asyncio.create_task(rec.pipeline(2).run(_chunks(10), SyncStats(update_id="u"),
                                                       _stamp))
        await asyncio.sleep(0.1)  # chunks 0 and 1 in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert rec.started == [0, 1]
    assert rec.finished == [0, 1]  # not cut off: they ended within the settle grace
    assert sorted(rec.released) == sorted(rec.prepared)
    assert rec.inflight == 0


def test_cancellation_while_preparing_releases_the_request_made_late():
    gate = threading.Event()
    released: list[WeightUpdateRequest] = []
    made: list[WeightUpdateRequest] = []

    def prepare(chunk):
        gate.wait(5)
        req = WeightUpdateRequest(names=chunk.names, dtypes=chunk.dtype_names, shapes=chunk.shape_lists)
        made.append(req)
        return req

    async def transfer(chunk, request):  # pragma: no cover - never reached
        raise AssertionError("nothing may be transferred")

    async def go():
        p = SendPipeline(prepare=prepare, transfer=transfer, release=released.append, window=2)
        task = asyncio.create_task(p.run(_chunks(2), SyncStats(update_id="u"), _stamp))
        await asyncio.sleep(0.05)  # the worker thread is packing chunk 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        for _ in range(100):
            if released:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert made and released == made


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be >= 1"):
        SendPipeline(prepare=lambda c: None, transfer=None, release=lambda r: None, window=0)


def test_make_chunks_bounds_bytes_and_keeps_modules_whole():
    named = [(f"m{i // 2}.{'weight' if i % 2 == 0 else 'bias'}", torch.zeros(256)) for i in range(8)]
    chunks = list(make_chunks(named, bucket_size_mb=4096 / (1 << 20)))  # 4 KiB: two modules
    assert [c.names for c in chunks] == [
        ["m0.weight", "m0.bias", "m1.weight", "m1.bias"],
        ["m2.weight", "m2.bias", "m3.weight", "m3.bias"],
    ]
    singles = list(make_chunks(named, bucket_size_mb=1024 / (1 << 20), by_module=False))
    assert all(len(c) == 1 for c in singles) and len(singles) == 8


# -- the receiver template: validation before any byte, refusal on a mismatch -------------------


class NaiveReceiver(WeightTransferReceiver):
    """A strategy that does no checking of its own: the base class must do it."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.refused: list[int] = []

    async def _receive_and_load(self, request, loader) -> None:
        self.received.append(request.chunk_index)
        await loader.load_weights({n: torch.ones(s) for n, s in zip(request.names, request.shapes,
                                                                    strict=True)})

    async def refuse(self, request) -> None:
        self.refused.append(request.chunk_index)


def test_receiver_template_validates_before_the_strategy_moves_a_byte():
    module = torch.nn.Linear(2, 3)
    loader = TorchModuleWeightLoader(module=module)
    r = NaiveReceiver()
    bad = WeightUpdateRequest(names=["weight"], dtypes=["float32"], shapes=[[2, 3]], chunk_index=4)
    with pytest.raises(WeightMismatchError, match=r"weight: shape \[2, 3\] but target has \[3, 2\]"):
        asyncio.run(r.receive_and_load_weights(bad, loader))
    assert r.received == [] and r.refused == [4]  # peers told no; the strategy never ran
    good = WeightUpdateRequest(names=["weight"], dtypes=["float32"], shapes=[[3, 2]], chunk_index=5)
    asyncio.run(r.receive_and_load_weights(good, loader))
    assert r.received == [5] and torch.equal(module.weight, torch.ones(3, 2))


def test_receiver_template_refuses_another_strategys_request():
    from weightsync.strategies.broadcast import BroadcastWeightUpdateRequest

    class OwnType(NaiveReceiver):
        request_cls = BroadcastWeightUpdateRequest

    req = WeightUpdateRequest(names=[], dtypes=[], shapes=[])
    with pytest.raises(ValueError, match="expects a 'broadcast' request"):
        asyncio.run(OwnType().receive_and_load_weights(req, None))
