"""Timeouts from config: how long each phase may take, and what a peer that never joins or
stops answering turns into. Real gloo groups between threads of this process (a peer that never
joins is a rank nobody starts; a stuck peer is a rank that never calls the collective); real
processes in tests/integration/test_engine_faults.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import weightsync as ws
from weightsync._runtime.process_group import GroupJoinError, build_group, make_master_store
from weightsync.clients import FanOutClient
from weightsync.config import scaled_timeout
from weightsync.errors import WeightSyncTimeout
from weightsync.strategies.broadcast import TorchDistributedWeightSyncInfo

pytestmark = pytest.mark.timeout(60)


def test_defaults_are_seconds_and_chunks_scale_with_bytes():
    cfg = ws.StrategyConfig()
    assert (cfg.timeout_s, cfg.timeout_s_per_gb, cfg.join_timeout_s, cfg.idle_timeout_s) == (
        30.0, 20.0, 120.0, 60.0)
    assert cfg.chunk_timeout_s(0) == 30.0
    assert cfg.chunk_timeout_s(2 * 10**9) == 70.0  # a 2 GB chunk: 30 s + 2 x 20 s
    assert scaled_timeout(1, 0.5, 3 * 10**9) == 2.5
    with pytest.raises(ValueError, match="join_timeout_s must be > 0"):
        ws.StrategyConfig(join_timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s_per_gb must be >= 0"):
        ws.StrategyConfig(timeout_s_per_gb=-1)


class Recording:
    """A channel that records the timeout of every call and answers at once."""

    ordered = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.timeouts: dict[str, float] = {}

    async def world_size(self) -> int:
        return 1

    def call(self, method, kwargs, *, timeout_s):
        self.timeouts[method] = timeout_s

        async def answer():
            return 1

        return answer()

    async def aclose(self) -> None:
        pass


def test_fanout_gives_each_phase_its_timeout():
    ch = Recording("e0")
    client = FanOutClient([ch], timeout_s=5, timeout_s_per_gb=10, join_timeout_s=50)
    big = {"type": "broadcast", "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[10**9]]}

    async def go():
        await client.init_weight_transfer({}, {})
        await client.start_weight_update({"update_id": "u"})
        await client.update_named_weights(big)
        await client.finish_weight_update({"update_id": "u"})
        await client.close_weight_transfer()

    asyncio.run(go())
    assert ch.timeouts == {
        "init_weight_transfer": 50, "start_weight_update": 50,
        "update_named_weights": 5 + 10 * 2.0,  # 2 GB of bf16
        "finish_weight_update": 5, "close_weight_transfer": 5,
    }
    # a malformed request is the engine's to refuse; its call still has a timeout
    assert FanOutClient([ch], timeout_s=5).chunk_timeout_s(0) == 5


def _info(store, world: int, *, join: float = 30.0, op: float = 30.0):
    return TorchDistributedWeightSyncInfo(
        master_addr="127.0.0.1", master_port=store.port, world_size=world, join_timeout_s=join,
        timeout_s=op, timeout_s_per_gb=0.0)


def _join(info, ranks, store):
    out: dict[int, object] = {}

    def run(r):
        try:
            out[r] = build_group(info, r, store=store if r == 0 else None)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_rank_that_never_joins_fails_creation_in_time_naming_it():
    store = make_master_store(0, 3, 30.0)
    t0 = time.monotonic()
    out = _join(_info(store, 3, join=2.0), [0, 1], store)  # rank 2 is never started
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    for r in (0, 1):
        e = out[r]
        assert isinstance(e, GroupJoinError) and e.missing == [2], e
        assert "rank(s) [2] never joined" in str(e) and "within 2s" in str(e)


def test_a_stuck_peer_is_a_timeout_naming_the_operation_and_the_peer():
    store = make_master_store(0, 2, 30.0)
    groups = _join(_info(store, 2, op=1.0), [0, 1], store)
    receiver = groups[1]
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"broadcast of 4096 bytes from the sender "
                                                r"\(rank 0\) on weight-sync rank 1/2 failed "
                                                r"after at most 1s"):
        receiver.broadcast(torch.zeros(4096, dtype=torch.uint8), src=0)  # rank 0 never sends
    assert time.monotonic() - t0 < 5
    for g in groups.values():
        g.close()


def test_a_collective_waits_longer_for_more_bytes():
    store = make_master_store(0, 2, 30.0)
    info = TorchDistributedWeightSyncInfo(
        master_addr="127.0.0.1", master_port=store.port, world_size=2, timeout_s=2.0,
        timeout_s_per_gb=100.0)
    groups = _join(info, [0, 1], store)
    g = groups[1]
    assert g.op_timeout(0).total_seconds() == 2.0
    assert g.op_timeout(10**9).total_seconds() == 102.0
    for g in groups.values():
        g.close()
