"""A receiver killed in the middle of a multi-chunk sync: the sender raises within the
configured timeout, naming what failed, and never hangs. Real processes, SIGKILL."""

from __future__ import annotations

import asyncio
import time

import pytest

from weightsync import WeightChunk, WeightSyncError, build_strategy
from weightsync.clients import FanOutClient
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FACTORY = "weightsync.local.modules:qwen2_module"
SMALL = {"size": "small", "dtype": "float32"}
TIMEOUT_S = 10.0


@pytest.mark.parametrize(
    "strategy,inflight",
    [("broadcast", 1), ("broadcast", 2), ("cuda_ipc", 2), ("packed_cuda_ipc", 2)],
)
def test_engine_killed_mid_sync_makes_the_sender_raise_in_time(strategy, inflight):
    engines = [
        LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name=f"engine{i}")
        for i in range(2)
    ]
    sd = qwen2_module(**SMALL, seed=3).state_dict()
    names = list(sd)
    chunks = [WeightChunk(names[i : i + 4], [sd[n] for n in names[i : i + 4]])
              for i in range(0, len(names), 4)]
    assert len(chunks) > 5

    async def stream():
        for i, c in enumerate(chunks):
            if i == 3:
                engines[0].kill()  # chunks 0-2 went out; chunk 2 may be in flight
            yield c

    async def run():
        client = FanOutClient(engines, timeout_s=60)
        s = build_strategy({"type": strategy, "timeout_s": TIMEOUT_S, "bucket_size_mb": 1,
                            "max_inflight_chunks": inflight})
        info = await s.create_sync_info(None, client)
        sender = await s.create_sender(None, client, info)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as ei:
            await sender.send_chunks(stream(), client, version=1)
        elapsed = time.monotonic() - t0
        # within the timeout (plus the engines' short grace), usually at once (EOF)
        assert elapsed < TIMEOUT_S + 6, elapsed
        assert "engine0" in str(ei.value), str(ei.value)
        if strategy == "broadcast":  # the group is unusable now, and the sender says so
            with pytest.raises(WeightSyncError, match="create a new sender"):
                await sender.send_chunks(chunks[:1], FanOutClient([engines[1]]), version=2)
        await sender.close()
        return elapsed

    try:
        asyncio.run(run())
        assert not engines[0].is_alive()
    finally:
        for e in engines:
            e.kill()
