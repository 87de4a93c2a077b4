"""Shared-memory segments, the pools' reuse and bounds, and the receiver's mapping cache."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from weightsync._runtime.pool import BufferPool, SizedSegmentPool
from weightsync._runtime.shm import AttachedSegments, attach_segment
from weightsync.errors import WeightSyncError, WeightSyncTimeout


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_buffer_pool_reuses_slots_and_grows_only_when_needed():
    pool = BufferPool(2, timeout_s=5, shared=True)
    cpu = torch.device("cpu")
    try:
        k0, s0 = pool.acquire(1000, cpu)
        k1, s1 = pool.acquire(2000, cpu)
        assert {k0, k1} == {0, 1} and pool.created == 2
        names = {s0.name, s1.name}
        pool.release(k0)
        pool.release(k1)
        for _ in range(5):  # later syncs: same segments, no new pages
            k, s = pool.acquire(1500, cpu)
            assert s.name in names
            pool.release(k)
        assert pool.created == 2
        # a bigger chunk regrows one slot (new name) and the old segment is unlinked
        k, s = pool.acquire(5 << 20, cpu)
        assert s.capacity >= 5 << 20 and s.name not in names and pool.created == 3
        old = [n for n in names if not _exists(n)]
        assert len(old) == 1
        pool.release(k)
        assert pool.nbytes <= 2 * (5 << 20) + (1 << 20)
    finally:
        pool.close()
    assert not any(_exists(n) for n in names)


def test_buffer_pool_blocks_until_release_and_times_out():
    pool = BufferPool(1, timeout_s=0.3, shared=True)
    cpu = torch.device("cpu")
    try:
        k, _ = pool.acquire(10, cpu)
        with pytest.raises(WeightSyncTimeout, match="no free transfer buffer"):
            pool.acquire(10, cpu)
        t = threading.Timer(0.1, pool.release, args=(k,))
        t.start()
        t0 = time.monotonic()
        k2, _ = pool.acquire(10, cpu)  # woken by the release
        assert k2 == k and time.monotonic() - t0 < 0.3
        pool.release(k2)
    finally:
        pool.close()


def test_sized_pool_reuses_by_size_and_bounds_free_bytes():
    pool = SizedSegmentPool(max_free_bytes=10_000)
    try:
        a = pool.acquire(4000)
        b = pool.acquire(4000)
        pool.release(a)
        pool.release(b)
        assert pool.created == 2 and pool.free_bytes == 8000
        c = pool.acquire(3000)  # fits in a 4000 segment (<= 2x)
        assert c.name in {a.name, b.name} and pool.created == 2
        d = pool.acquire(1000)  # 4000 is > 2x 1000: a new, smaller segment
        assert d.capacity == 1000 and pool.created == 3
        pool.release(c)
        pool.release(d)
        e = pool.acquire(6000)
        pool.release(e)  # 4000+4000+1000+6000 > 10000: oldest released are unlinked
        assert pool.free_bytes <= 10_000
    finally:
        pool.close()
    assert pool.free_bytes == 0


def test_attached_cache_maps_once_and_evicts_lru():
    pool = SizedSegmentPool(max_free_bytes=1 << 20)
    segs = [pool.acquire(4096) for _ in range(3)]
    for i, s in enumerate(segs):
        s.tensor.fill_(i + 1)
    cache = AttachedSegments(max_bytes=2 * 4096)
    try:
        for _ in range(3):
            t = cache.get(segs[0].name, 4096)
            assert int(t[0]) == 1
        assert cache.attached == 1
        cache.get(segs[1].name, 4096)
        cache.get(segs[2].name, 4096)  # evicts segs[0]
        assert len(cache) == 2 and cache.attached == 3
        segs[2].tensor[0] = 99  # shared, not copied
        assert int(cache.get(segs[2].name, 1)[0]) == 99
        with pytest.raises(WeightSyncError, match="needs"):
            cache.get(segs[1].name, 1 << 20)
    finally:
        cache.close()
        for s in segs:
            pool.release(s)
        pool.close()


def test_attach_missing_segment_is_a_clear_error():
    with pytest.raises(WeightSyncError, match="does not exist"):
        attach_segment("ws_no_such_segment_x")
