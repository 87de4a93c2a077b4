"""``share_cpu_weights``: weights moved into shared segments in place (values, ties, views,
training), located by address, unlinked on close / when freed; the receiver cache keeps shared
segments while they exist and sizes its pool bound from the largest segment; the copy helpers
(aliasing-safe memcpy, pieces on threads, batched small copies) are exact."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from weightsync._runtime import copy as _copy
from weightsync._runtime.pool import SizedSegmentPool
from weightsync._runtime.shm import AttachedSegments
from weightsync.strategies import SharedCpuWeights, locate_shared, share_cpu_weights
from weightsync.strategies.shared_weights import SHARED_PREFIX, shared_segment_names
from weightsync.types import str_to_dtype


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.norm = torch.nn.LayerNorm(16).to(torch.bfloat16)
        self.register_buffer("steps", torch.tensor(3, dtype=torch.int64))


def test_share_moves_every_tensor_in_place_keeping_values_ties_and_training():
    torch.manual_seed(0)
    m = Tied()
    params = {n: p for n, p in m.named_parameters()}
    before = {k: v.clone() for k, v in m.state_dict().items()}
    shared = share_cpu_weights(m, segment_mb=0.004)  # ~4 KB: several segments
    try:
        assert isinstance(shared, SharedCpuWeights) and len(shared.segment_names) > 1
        assert all(n.startswith(SHARED_PREFIX) and _exists(n) for n in shared.segment_names)
        after = m.state_dict()
        assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
                   for k in before)
        assert {n: p for n, p in m.named_parameters()} == params  # same Parameter objects
        assert m.head.weight is m.emb.weight
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            loc = locate_shared(t)
            assert loc is not None and loc.name in shared.segment_names, name
            assert loc.offset % 256 == 0 and loc.offset + t.numel() * t.element_size() <= loc.segment_nbytes
        # training keeps working on the shared tensors, in place
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m.proj(m.emb(torch.tensor([1, 2]))).sum().backward()
        w_old = m.proj.weight.detach().clone()
        opt.step()
        assert not torch.equal(w_old, m.proj.weight) and locate_shared(m.proj.weight) is not None
        # sharing again is a no-op
        again = share_cpu_weights(m)
        assert again.num_tensors == 0 and again.segment_names == []
        # a replaced .data is detected: not shared any more, the sender copies it
        m.proj.bias.data = m.proj.bias.data.clone()
        assert locate_shared(m.proj.bias) is None
        assert locate_shared(m.proj.weight.t()) is None  # not contiguous
        assert locate_shared(m.proj.weight[1:3]) is not None  # a contiguous slice is inside
    finally:
        shared.close()
    assert not any(_exists(n) for n in shared.segment_names)
    assert locate_shared(m.proj.weight) is None  # closed: copy path again
    m.proj.weight.data.add_(1)  # the tensors still work after unlink


def test_views_of_one_storage_stay_views_and_state_dicts_are_accepted():
    base = torch.arange(24, dtype=torch.float32)
    sd = {"a": base[:12].view(3, 4), "b": base[12:].view(4, 3), "c": torch.ones(5)}
    shared = share_cpu_weights(sd)
    try:
        assert shared.num_tensors == 3
        sd["a"].fill_(-1)  # still one storage: b did not move away from a
        assert sd["a"].untyped_storage().data_ptr() == sd["b"].untyped_storage().data_ptr()
        assert torch.equal(sd["b"], torch.arange(12, 24, dtype=torch.float32).view(4, 3))
        assert locate_shared(sd["b"]).offset - locate_shared(sd["a"]).offset == 48
    finally:
        shared.close()


def test_segments_are_unlinked_when_the_tensors_are_freed():
    m = torch.nn.Linear(8, 8)
    shared = share_cpu_weights(m)
    names = list(shared.segment_names)
    assert names and all(_exists(n) for n in names) and set(names) <= set(shared_segment_names())
    del m
    gc.collect()
    assert not any(_exists(n) for n in names)
    assert not set(names) & set(shared_segment_names())
    shared.close()  # idempotent


def test_bad_input_is_refused_by_name():
    with pytest.raises(TypeError, match="torch.nn.Module or a mapping"):
        share_cpu_weights([torch.ones(2)])
    with pytest.raises(TypeError, match="not: \\['x'\\]"):
        share_cpu_weights({"x": 1.0})
    with pytest.raises(ValueError, match="segment_mb must be > 0"):
        share_cpu_weights(torch.nn.Linear(2, 2), segment_mb=0)
    meta = {"m": torch.empty(3, device="meta"), "s": torch.ones(3).to_sparse()}
    out = share_cpu_weights(meta)
    assert sorted(out.skipped) == ["m", "s"] and out.num_tensors == 0


def test_receiver_cache_keeps_shared_segments_until_unlinked():
    m = torch.nn.Linear(64, 64)
    shared = share_cpu_weights(m)
    pool = SizedSegmentPool(max_free_bytes=1 << 20)
    cache = AttachedSegments(max_bytes=1)  # tiny byte bound: only for transfer buffers
    try:
        name = shared.segment_names[0]
        for _ in range(3):  # three syncs: one attach
            cache.begin_sync()
            raw = cache.get(name, 64)
            seg = pool.acquire(1000)
            cache.get(seg.name, 1000)
            pool.release(seg)
        assert cache.pinned == [name] and cache.attached == 2
        loc = locate_shared(m.weight)
        got = raw[loc.offset : loc.offset + 64 * 64 * 4].view(torch.float32).view(64, 64)
        assert torch.equal(got, m.weight.detach())  # the trainer's memory, seen by the engine
        shared.close()
        cache.begin_sync()  # the sender unlinked it: the mapping goes
        assert cache.pinned == []
    finally:
        cache.close()
        pool.close()
        shared.close()


def test_receiver_pool_bound_grows_with_the_largest_segment():
    pool = SizedSegmentPool(max_free_bytes=64 << 20)
    cache = AttachedSegments(max_bytes=1 << 20, min_slots=3)
    segs = [pool.acquire(4 << 20) for _ in range(3)]  # slots bigger than the byte bound
    try:
        for _ in range(4):
            for s in segs:
                cache.get(s.name, 4 << 20)
        assert cache.attached == 3 and len(cache) == 3 and cache.bound_bytes >= 12 << 20
        extra = pool.acquire(4 << 20)
        cache.get(extra.name, 1)  # a fourth: the least recently used goes
        assert len(cache) == 3
        pool.release(extra)
    finally:
        for s in segs:
            pool.release(s)
        cache.close()
        pool.close()


@pytest.mark.parametrize("shift", [0, 64, 256, 2048, 3])
def test_copy_bytes_exact_at_every_relative_alignment(shift):
    n = (1 << 20) + 13
    src = torch.randint(0, 255, (n + 4096,), dtype=torch.uint8)
    dst = torch.zeros(n + 8192, dtype=torch.uint8)
    s = src[:n]
    d = dst[shift : shift + n]
    _copy._copy_bytes(d.numpy(), s.numpy())
    assert torch.equal(d, s) and int(dst[:shift].sum()) == 0 and int(dst[shift + n :].sum()) == 0


def test_copy_many_large_small_and_fallback(monkeypatch):
    monkeypatch.setattr(_copy, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(_copy, "PIECE_BYTES", 1 << 14)
    monkeypatch.setattr(_copy, "COPY_THREADS", 3)
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(300, 100, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
            torch.randn(5, generator=g), torch.randn(4, 6, generator=g).t(),  # non-contiguous
            torch.randn(3, generator=g).double(), torch.empty(0)]
    dsts = [torch.zeros(300, 100), torch.zeros(7, dtype=torch.bfloat16), torch.zeros(5),
            torch.zeros(6, 4), torch.zeros(3), torch.empty(0)]  # float64 -> float32: copy_ casts
    _copy.copy_many(dsts, srcs)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.to(d.dtype))
    big_d, big_s = torch.zeros(1 << 18), torch.randn(1 << 18, generator=g)
    _copy.copy_into(big_d, big_s)  # pieces on the pool threads
    assert torch.equal(big_d, big_s)


def test_str_to_dtype_is_cached_and_still_refuses_unknown_names():
    assert str_to_dtype("bfloat16") is torch.bfloat16 is str_to_dtype("torch.bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'bfloat17'"):
        str_to_dtype("bfloat17")
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        str_to_dtype("Tensor")


def test_copy_pool_works_in_a_forked_child(monkeypatch):
    """The pool's threads do not survive fork: a child must not wait on them forever."""
    monkeypatch.setattr(_copy, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(_copy, "PIECE_BYTES", 1 << 14)
    monkeypatch.setattr(_copy, "COPY_THREADS", 3)
    d, s = torch.zeros(1 << 16), torch.randn(1 << 16)
    _copy.copy_into(d, s)  # the parent's pool exists now
    # made before fork: torch's own thread pools are not fork-safe either
    d2, s2 = torch.zeros(1 << 16), torch.randn(1 << 16)
    pid = os.fork()
    if pid == 0:  # child: copy with pieces, exit 0 only if exact
        try:
            _copy.copy_into(d2, s2)
            os._exit(0 if (d2.numpy() == s2.numpy()).all() else 1)  # no torch op after fork
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in copy_into")
    assert os.waitstatus_to_exitcode(status) == 0


def test_sized_pool_keeps_the_segments_a_repeated_sync_needs():
    """Each 'sync' walks the same sizes in order (a big first tensor, then layers) with two
    chunks in flight; from the second sync on nothing is created (engines never re-map)."""
    pool = SizedSegmentPool(max_free_bytes=2 * 3000, room_for_largest=True)
    order = [[5000], [1000, 1000, 1000], [1000, 1000, 1000], [1000, 1000, 1000]]
    try:
        created = []
        for _ in range(4):
            before = pool.created
            held: list = []
            for chunk in order:
                segs = [pool.acquire(n) for n in chunk]
                if held:
                    for s in held.pop(0):
                        pool.release(s)
                held.append(segs)
            for segs in held:
                for s in segs:
                    pool.release(s)
            created.append(pool.created - before)
        assert created[0] == 7 and created[1:] == [0, 0, 0]
        assert pool.free_bytes <= 2 * 3000 + 5000
    finally:
        pool.close()
