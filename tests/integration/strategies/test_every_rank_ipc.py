"""``every_rank`` IPC (the hybrid-engine layout) on CPU: 2 real gloo training ranks, each with its
own copy of the weights, push into one engine of 2 workers (the shape of a TP=2 engine); every
rank sends in lockstep, rank 0 alone talks to the engine, and engine worker ``i`` reads training
rank ``i``'s copy. The ranks hold *different* values, so what each worker ends up with shows
which copy it read. A refused update fails on both ranks with the same error."""

from __future__ import annotations

import json

import pytest
from _sharded_sync import spawn_gloo_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FACTORY = "weightsync.bench.shapes:build_module"


async def _rank_async(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from weightsync import WeightChunk, build_extractor, build_strategy
    from weightsync.bench.shapes import build_module
    from weightsync.clients import FanOutClient
    from weightsync.digest import state_digest
    from weightsync.errors import WeightMismatchError
    from weightsync.local import LocalEngineProcess
    from weightsync.types import EmptyWeightSyncInfo

    strategy_type = out.rsplit("/", 1)[-1].removesuffix(".json")  # ".../<strategy>.json"
    module = build_module(shape="tiny", dtype="float32", seed=0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(10.0 * rank)  # each rank's copy differs
    engine = client = None
    report: dict = {"rank": rank, "versions": []}
    try:
        if rank == 0:
            engine = LocalEngineProcess.spawn(FACTORY, {"shape": "tiny", "dtype": "float32",
                                                        "fill": 0.0}, world_size=2)
            client = FanOutClient([engine], timeout_s=60)
        strategy = build_strategy({"type": strategy_type, "every_rank": True, "timeout_s": 60,
                                   "bucket_size_mb": 0.02})
        sender = await strategy.create_sender(None, client, EmptyWeightSyncInfo())
        ext = build_extractor({"type": "hf", "bucket_size_mb": 0.02})
        for v in (1, 2):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
            stats = await sender.send_chunks(ext.extract_weights(module), client, version=v,
                                             manifest=ext.metadata(module))
            report["versions"].append(stats.versions)
            report["chunks"] = stats.num_chunks
        mine = state_digest(module.state_dict())
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            got = [await engine.call("state_digest", worker=i) for i in range(2)]
            report["worker_matches_rank"] = [
                [got[w] == every[r] for r in range(world)] for w in range(2)]
        try:
            await sender.send_chunks([WeightChunk(["model.norm.weight"], [torch.zeros(3)])],
                                     client, version=3)
            report["refused"] = None
        except WeightMismatchError as e:
            report["refused"] = list(e.offenders)
        if rank == 0:
            report["engine_versions"] = await client.versions()
        await sender.close()
    finally:
        if client is not None:
            await client.close_weight_transfer()
        if engine is not None:
            engine.stop()
        with open(out.replace(".json", f".rank{rank}.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("strategy", ["cuda_ipc", "packed_cuda_ipc"])
def test_every_rank_ipc_worker_reads_its_ranks_copy(tmp_path, strategy):
    out = str(tmp_path / f"{strategy}.json")
    spawn_gloo_ranks(_rank_async, out)
    r0, r1 = (json.loads((tmp_path / f"{strategy}.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["chunks"] > 2  # several chunks, each gathered from both ranks
    assert r0["versions"] == r1["versions"] == [[1], [2]]  # both ranks see rank 0's outcome
    # worker 0 holds rank 0's copy, worker 1 rank 1's (the ranks' values differ)
    assert r0["worker_matches_rank"] == [[True, False], [False, True]]
    # the same error (type and offenders) on both ranks
    assert r0["refused"] == r1["refused"] == ["model.norm.weight: shape [3] but target has [64]"]
    assert r0["engine_versions"] == [2]  # the refused update changed nothing
