"""Shared by the FSDP2 / ZeRO-3 extractor tests: a tiny Qwen2, training steps, and the sync loop
that pushes a sharded model from training rank 0 into a real ``LocalEngineProcess`` over the real
``broadcast`` (gloo) strategy and reports what the engine holds."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from weightsync.testing.servers import free_port


def _gloo_rank(rank: int, world: int, port: int, rank_async: Callable[..., Any], out: str) -> None:
    import asyncio
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        asyncio.run(rank_async(rank, world, out))
        # leave together: a rank that destroys its group while the other still uses the store
        # rank 0 hosts has ended in gloo's "terminate called without an active exception"
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo_ranks(rank_async: Callable[..., Any], out: str, world: int = 2) -> None:
    """Run ``await rank_async(rank, world, out)`` on ``world`` real processes joined by a gloo
    default group (``rank_async`` must be a module-level function: it is pickled by name)."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_rank, args=(world, free_port(), rank_async, out), nprocs=world, join=True)


def tiny_qwen2(layers: int = 3) -> Any:
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=256, tie_word_embeddings=True, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def batch(rank: int, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 256, (2, 12), generator=g)


async def sync_loop(
    *,
    rank: int,
    ext: Any,
    model: Any,
    train_step: Callable[[int], None],
    full_state: Callable[[], dict[str, Any]],
    out_path: str,
    steps: int = 2,
) -> None:
    """Every rank: ``steps`` x (train, sync). Rank 0 owns the engine and writes the report."""
    from weightsync import build_strategy
    from weightsync.clients import FanOutClient
    from weightsync.digest import tensor_digest
    from weightsync.local import LocalEngineProcess

    metas = ext.metadata(model)  # no collective
    names = [m.name for m in metas]
    report: dict[str, Any] = {"names": names, "syncs": []}
    engine = client = sender = None
    if rank == 0:
        engine = LocalEngineProcess.spawn(
            "weightsync.local.modules:metas_module",
            {"metas": [m.to_dict() for m in metas], "fill": "zeros"}, name="sharded-engine",
            num_threads=1,
        )
        client = FanOutClient([engine], timeout_s=120)
        strategy = build_strategy({"type": "broadcast", "backend": "gloo", "timeout_s": 120})
        info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, info)
    prev: dict[str, str] | None = None
    try:
        for step in range(1, steps + 1):
            train_step(step)
            full = full_state()  # collective on every rank (an independent gather path)
            chunks = ext.extract_weights(model)
            if rank != 0:
                async for _ in chunks:
                    raise AssertionError("a non-sending rank got a chunk")
                assert ext.memory.peak_bytes == 0
                continue
            stats = await sender.send_chunks(chunks, client, version=step, manifest=metas)
            got = {n: d["digest"] for n, d in (await engine.call("state_digest")).items()}
            want = {n: tensor_digest(full[n]) for n in names}
            report["syncs"].append({
                "versions": stats.versions, "chunks": stats.num_chunks,
                "bytes": stats.total_bytes, "meta_bytes": sum(m.nbytes for m in metas),
                "mismatched": sorted(n for n in want if got.get(n) != want[n]),
                "missing_from_ref": sorted(set(names) - set(full)),
                "changed": prev is None or prev != got,
                "peak_bytes": ext.memory.peak_bytes, "live_after": ext.memory.live_bytes,
            })
            prev = got
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(report, f)
    finally:
        if sender is not None:
            await sender.close()
        if engine is not None:
            engine.stop()


def check_report(
    out_path: str, *, bucket_mb: float, expected_names: list[str], fresh: bool = True
) -> dict:
    """``fresh``: the extractor allocates gathered copies (sharded); otherwise (whole
    parameters) it must allocate nothing."""
    with open(out_path) as f:
        report = json.load(f)
    names = report["names"]
    assert sorted(names) == sorted(expected_names), (
        f"extra: {sorted(set(names) - set(expected_names))}, "
        f"missing: {sorted(set(expected_names) - set(names))}"
    )
    bucket = int(bucket_mb * (1 << 20))
    for i, sync in enumerate(report["syncs"], start=1):
        assert sync["versions"] == [i]
        assert sync["missing_from_ref"] == []
        assert sync["mismatched"] == [], f"engine differs from the unsharded model: {sync}"
        assert sync["changed"]
        assert sync["chunks"] >= 3  # several buckets, so the memory bound is exercised
        assert sync["bytes"] == sync["meta_bytes"]
        if fresh:
            assert 0 < sync["peak_bytes"] <= 2 * bucket, sync
        else:
            assert sync["peak_bytes"] == 0, sync
        assert sync["live_after"] == 0
    return report
