"""``weightsync._runtime``: the one thread pool, the one buffer pool and the one shared-memory
helper that every package uses (the copy pool's fork safety and the shm pools' bounds are in
``strategies/test_shared_weights.py`` / ``test_shm.py``)."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest
import torch

from weightsync._runtime import copy as rt_copy
from weightsync._runtime import shm
from weightsync._runtime.pool import BufferPool
from weightsync._runtime.threads import LoopThread, in_thread, spawn
from weightsync.errors import WeightSyncError


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_plain_buffer_pool_hands_out_tensors_and_creates_no_segment():
    before = _shm_names()
    pool = BufferPool(2, timeout_s=5, shared=False)
    cpu = torch.device("cpu")
    try:
        k0, s0 = pool.acquire(1000, cpu)
        k1, s1 = pool.acquire(3000, None)  # None: the CPU
        assert {k0, k1} == {0, 1} and s0.tensor.dtype == torch.uint8
        assert s1.tensor.numel() >= 3000 and s1.device == cpu and pool.created == 2
        first = s0.tensor.data_ptr()
        pool.release(k0)
        k, s = pool.acquire(500, cpu)  # reused, not reallocated
        assert k == k0 and s.tensor.data_ptr() == first and pool.created == 2
        pool.release(k)
        pool.release(k1)
        assert not hasattr(s, "describe")  # nothing another process could open
        assert _shm_names() - before == set()
    finally:
        pool.close()


def test_shared_pool_refuses_a_device_it_cannot_share():
    pool = BufferPool(1, timeout_s=1, shared=True)
    try:
        with pytest.raises(ValueError, match="CPU or a CUDA GPU, not meta"):
            pool.acquire(10, torch.device("meta"))
        k, _ = pool.acquire(10, torch.device("cpu"))  # the failed acquire gave its slot back
        pool.release(k)
    finally:
        pool.close()


def test_spawn_and_in_thread_deliver_results_and_errors():
    assert spawn(lambda a, b: a + b, 2, 3).result(timeout=5) == 5
    with pytest.raises(ZeroDivisionError):
        spawn(lambda: 1 / 0).result(timeout=5)

    async def go():
        got = await in_thread(threading.current_thread)
        assert got is not threading.current_thread() and got.daemon
        with pytest.raises(KeyError):
            await in_thread({}.__getitem__, "x")
        return await in_thread(sum, [1, 2, 3])

    assert asyncio.run(go()) == 6


def test_loop_thread_keeps_its_loop_between_calls_and_restarts_after_close():
    twin = LoopThread("test-twin")

    async def which_loop():
        return asyncio.get_running_loop()

    async def from_inside_a_running_loop():
        return twin.run(which_loop())  # blocking twin called from async code: still works

    try:
        assert not twin.started
        first = twin.run(which_loop())
        assert twin.run(which_loop()) is first and twin.started
        assert asyncio.run(from_inside_a_running_loop()) is first
        thread = twin._thread
        twin.close()
        assert not twin.started and not thread.is_alive() and first.is_closed()
        assert twin.run(which_loop()) is not first  # a new loop on first use again
    finally:
        twin.close()


def test_loop_thread_awaits_on_its_loop_from_another_and_refuses_to_block_itself():
    twin = LoopThread("test-twin")

    async def which_loop():
        return asyncio.get_running_loop()

    async def from_another_loop():
        return await twin.run_async(which_loop()), asyncio.get_running_loop()

    async def blocking_from_its_own_loop():
        return twin.run(which_loop())

    try:
        on_twin, caller = asyncio.run(from_another_loop())
        assert on_twin is twin.run(which_loop()) and on_twin is not caller
        with pytest.raises(RuntimeError, match="would wait for itself"):
            twin.run(blocking_from_its_own_loop())
        assert twin.run(twin.run_async(which_loop())) is on_twin  # on its loop: awaited directly
    finally:
        twin.close()


def test_copy_helpers_stay_within_copy_threads_over_concurrent_callers(monkeypatch):
    monkeypatch.setattr(rt_copy, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(rt_copy, "PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(rt_copy, "COPY_THREADS", 3)
    seen = []
    real = rt_copy._copy_bytes

    def counting(d, s):
        seen.append(rt_copy._helpers_busy)
        real(d, s)

    monkeypatch.setattr(rt_copy, "_copy_bytes", counting)
    pairs = [(torch.zeros(1 << 16), torch.randn(1 << 16)) for _ in range(4)]
    callers = [threading.Thread(target=rt_copy.copy_into, args=p) for p in pairs]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=30)
    assert all(torch.equal(d, s) for d, s in pairs)
    assert seen and max(seen) <= 2 and rt_copy._helpers_busy == 0


def test_create_mapped_names_the_segment_and_unlink_is_idempotent():
    name = f"ws_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    mm = shm.create_mapped(name, 4096, hint="lower bucket_size_mb")
    try:
        assert shm.segment_exists(name) and len(mm) == 4096
        with pytest.raises(WeightSyncError, match=f"could not create shared-memory segment '{name}'"):
            shm.create_mapped(name, 4096, hint="x")
        view = shm.attach_segment(name)
        view.tensor[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
        assert bytes(mm[:3]) == b"\x01\x02\x03"
        view.release()
    finally:
        shm.unlink(name)
        shm.unlink(name)
    assert not shm.segment_exists(name)


def test_a_vote_the_sender_never_joins_times_out_naming_the_sender():
    """A real 2-rank gloo group (both ranks in this process): rank 1 votes, rank 0 (the sender)
    never does; the error names the phase, the sender and the limit."""
    import datetime

    import torch.distributed as dist

    from weightsync._runtime.process_group import Group
    from weightsync.errors import CollectiveTimeout

    store = dist.HashStore()
    limit = datetime.timedelta(seconds=1)
    pgs: dict[int, object] = {}

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, limit)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    receiver = Group("gloo", pgs[1], rank=1, world_size=2, timeout=limit)
    with pytest.raises(CollectiveTimeout, match=r"go/no-go all_reduce with the sender \(rank 0\)"
                                                r" on weight-sync rank 1/2 failed after at most 1s"):
        receiver.all_reduce_min(1)
    assert Group("gloo", None, rank=0, world_size=3, timeout=limit).peers() == \
        "with the 2 receiver rank(s)"
    assert Group("gloo", None, rank=2, world_size=4, timeout=limit).peers() == \
        "with the sender (rank 0) and 2 other receiver rank(s)"
