"""Each strategy moves a Qwen2-0.5B-shaped state dict (real names/shapes, bf16, random values,
about 1 GB) bit-exact into a LocalEngineProcess whose module starts at zeros.

One fresh engine per strategy (so each test proves every byte moved); the trainer's weights are
shared by the module. Bucket 256 MB: the transfer buffers stay far below the model size.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from weightsync import WeightChunk, build_strategy
from weightsync.clients import FanOutClient
from weightsync.digest import tensor_digest
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module
from weightsync.pipeline import make_chunks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FACTORY = "weightsync.local.modules:qwen2_module"
BUCKET_MB = 256


@pytest.fixture(scope="module")
def trainer_weights():
    sd = qwen2_module("0.5b", "bfloat16", seed=7).state_dict()
    digests = {n: tensor_digest(t) for n, t in sd.items()}
    yield sd, digests
    del sd
    gc.collect()


def _chunks(sd):
    """Grouped by module and batched by the bucket, as extractors do."""
    return list(make_chunks(sd.items(), bucket_size_mb=BUCKET_MB))


@pytest.mark.parametrize("cfg", [
    {"type": "broadcast", "backend": "gloo"},
    {"type": "cuda_ipc"},
    {"type": "packed_cuda_ipc"},
], ids=["broadcast", "cuda_ipc", "packed_cuda_ipc"])
def test_qwen2_05b_bit_exact(trainer_weights, cfg):
    sd, want = trainer_weights
    chunks: list[WeightChunk] = _chunks(sd)
    assert len(chunks) >= 4
    assert sum(c.total_size_bytes for c in chunks) > 900 << 20
    engine = LocalEngineProcess.spawn(
        FACTORY, {"size": "0.5b", "dtype": "bfloat16", "fill": "zeros"}, name="qwen05b",
        start_timeout_s=180,
    )
    try:
        async def run():
            client = FanOutClient([engine], timeout_s=240)
            s = build_strategy({**cfg, "bucket_size_mb": BUCKET_MB, "timeout_s": 120})
            info = await s.create_sync_info(None, client)
            sender = await s.create_sender(None, client, info)
            try:
                stats = await sender.send_chunks(chunks, client, version=1)
            finally:
                await sender.close()
            assert stats.versions == [1]
            got = await engine.call("state_digest")
            assert {n: d["digest"] for n, d in got.items()} == want
            return stats

        stats = asyncio.run(run())
        print(f"{cfg['type']}: {stats.total_bytes / 1e9:.2f} GB in {stats.seconds:.2f}s "
              f"({stats.gbps:.2f} GB/s)")
    finally:
        engine.stop()
