"""GPU paths of the transports (run on a CUDA machine; skipped without CUDA).

- cuda_ipc: trainer CUDA tensors shared zero-copy through CUDA IPC handles we encode/open
  ourselves, into an engine whose module lives on the GPU.
- packed_cuda_ipc: chunks packed into pooled GPU buffers (one handle per dtype group); and the
  CPU-tensor path (shared memory) into a GPU engine.
- broadcast/NCCL: needs 2 GPUs (NCCL refuses two ranks on one GPU).
Every test checks bit-exact arrival through the engine's digests.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from weightsync import WeightChunk, build_strategy  # noqa: E402
from weightsync.clients import FanOutClient  # noqa: E402
from weightsync.digest import tensor_digest  # noqa: E402
from weightsync.local import LocalEngineProcess  # noqa: E402
from weightsync.local.modules import qwen2_module  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]

FACTORY = "weightsync.local.modules:qwen2_module"
SHAPE = {"size": "small", "dtype": "bfloat16"}


def _chunks(sd, per_chunk=9):
    names = list(sd)
    return [WeightChunk(names[i : i + per_chunk], [sd[n] for n in names[i : i + per_chunk]])
            for i in range(0, len(names), per_chunk)]


def _sync(engine_kwargs, strategy_cfg, sd, *, engines=1, syncs=2, env=None, before=None,
          chunks=None):
    """``syncs`` syncs of ``sd`` (new values each time, in place); ``chunks``: send this very
    list of chunks every time (else chunks made anew for each sync)."""
    engs = [
        LocalEngineProcess.spawn(FACTORY, {**SHAPE, "fill": "zeros", **engine_kwargs},
                                 name=f"gpu-engine{i}", env=(env or [None] * engines)[i])
        for i in range(engines)
    ]
    try:
        async def run():
            client = FanOutClient(engs, timeout_s=120)
            s = build_strategy({"timeout_s": 60, "bucket_size_mb": 4, **strategy_cfg})
            info = await s.create_sync_info(None, client)
            sender = await s.create_sender(None, client, info)
            want = {n: tensor_digest(t) for n, t in sd.items()}
            try:
                for v in range(1, syncs + 1):
                    # new values each sync, in place (the same allocations, as a trainer does)
                    for t in sd.values():
                        t.add_(1)
                    if before is not None:
                        before(v, sd)
                    want = {n: tensor_digest(t) for n, t in sd.items()}
                    stats = await sender.send_chunks(chunks if chunks is not None
                                                     else _chunks(sd), client, version=v)
                    assert stats.versions == [v] * engines
                    for e in engs:
                        got = await e.call("state_digest")
                        assert {n: d["digest"] for n, d in got.items()} == want
            finally:
                await sender.close()
            return sender

        return asyncio.run(run())
    finally:
        for e in engs:
            e.stop()


def test_cuda_ipc_zero_copy_into_gpu_engine():
    sd = qwen2_module(**SHAPE, seed=1, device="cuda").state_dict()
    _sync({"device": "cuda"}, {"type": "cuda_ipc"}, sd)


def test_cuda_ipc_reuses_the_handles_of_unchanged_tensors_and_encodes_a_replaced_one():
    """Syncs of the very same tensors (updated in place) reuse the handles encoded for the
    first and go as a layout reference; a tensor replaced by a new allocation (sync 3) is
    encoded again, sent in full, and lands bit-exact; sync 4 reuses the new handles."""
    sd = qwen2_module(**SHAPE, seed=4, device="cuda").state_dict()
    first = next(iter(sd))

    def replace(v, sd):
        if v == 3:
            sd[first] = sd[first].clone()

    sender = _sync({"device": "cuda"}, {"type": "cuda_ipc"}, sd, syncs=4, before=replace)
    assert sender.reencoded_skipped == 2  # syncs 2 and 4
    assert sender.references == 2  # syncs 2 and 4: the engine's decoded layout, by key


def test_cuda_ipc_replays_an_update_of_the_very_same_chunks():
    """The same chunk objects sent again (a trainer's held update, its tensors updated in
    place) are replayed: one call that refers to the layout the engine decoded, nothing made
    anew; bit-exact each time. A chunk whose tensor the caller replaced by a new allocation
    (sync 3) is not replayed: encoded again and sent in full, bit-exact; sync 4 replays that."""
    sd = qwen2_module(**SHAPE, seed=5, device="cuda").state_dict()
    first = next(iter(sd))
    chunks = _chunks(sd)

    def replace(v, sd):
        if v == 3:
            sd[first] = sd[first].clone()
            chunks[0].tensors[0] = sd[first]

    sender = _sync({"device": "cuda"}, {"type": "cuda_ipc"}, sd, syncs=4, before=replace,
                   chunks=chunks)
    assert sender.replayed == 2  # syncs 2 and 4


def test_packed_cuda_ipc_gpu_buffers_into_gpu_engine():
    sd = qwen2_module(**SHAPE, seed=2, device="cuda").state_dict()
    sender = _sync({"device": "cuda"}, {"type": "packed_cuda_ipc"}, sd, syncs=3)
    assert sender.pool.created <= 2 + 1  # slots reused across syncs (one regrow at most)


def test_packed_cuda_ipc_cpu_tensors_into_gpu_engine():
    sd = qwen2_module(**SHAPE, seed=3).state_dict()
    _sync({"device": "cuda"}, {"type": "packed_cuda_ipc", "device": "cpu"}, sd)


def test_cuda_handle_round_trip_in_process():
    from weightsync._runtime.cuda_handles import encode

    t = torch.arange(1 << 20, dtype=torch.int32, device="cuda")[7:]
    h = encode(t.contiguous())
    assert h.kind == "cuda" and h.nbytes == t.numel() * 4 and len(h.handle) > 0
    assert h.device_uuid == str(torch.cuda.get_device_properties(0).uuid)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_nccl_broadcast_two_gpus():
    torch.cuda.set_device(0)
    sd = qwen2_module(**SHAPE, seed=4, device="cuda:0").state_dict()
    _sync({"device": "cuda"}, {"type": "broadcast", "backend": "nccl"}, sd,
          env=[{"CUDA_VISIBLE_DEVICES": "1"}])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 3, reason="needs 3 GPUs"
)
def test_nccl_broadcast_to_two_engines():
    torch.cuda.set_device(0)
    sd = qwen2_module(**SHAPE, seed=5, device="cuda:0").state_dict()
    _sync({"device": "cuda"}, {"type": "broadcast", "backend": "nccl", "packed": False}, sd,
          engines=2, env=[{"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2"}])
