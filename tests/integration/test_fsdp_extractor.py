"""FSDP2 extractor on 2 real gloo ranks (CPU) syncing into a real engine process.

Rank 0 (the sender) spawns a ``LocalEngineProcess`` holding a zero-filled module with the
engine's names and pushes the FSDP2-sharded tiny Qwen2 causal LM into it through the real
``broadcast`` (gloo) strategy; rank 1 only takes part in the gathers. Twice: train, sync, train,
sync. Checked: the engine holds exactly the unsharded model (bit-exact digests against
``get_model_state_dict(full_state_dict=True)``, an independent gather path in torch), names are
clean (checkpoint-wrapper prefix gone, tied lm_head sent once as the embedding), metadata needs
no collective, and the sender's live gathered bytes never exceed 2 buckets.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from datetime import timedelta

import pytest

pytestmark = pytest.mark.slow

BUCKET_MB = 0.125


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_qwen2():
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=256, tie_word_embeddings=True, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def _train_step(model, opt, rank: int, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _rank_main(rank: int, world: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        asyncio.run(_rank_async(rank, world, out_path))
    finally:
        dist.destroy_process_group()


async def _rank_async(rank: int, world: int, out_path: str) -> None:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import build_extractor, build_strategy
    from weightsync.local import LocalEngineClient, LocalEngineProcess
    from weightsync.local.worker import tensor_digest
    from weightsync.types import TensorMeta

    model = _tiny_qwen2()
    clean_names = [n for n in model.state_dict() if n != "lm_head.weight"]
    mesh = init_device_mesh("cpu", (world,))
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
        fully_shard(layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    ext = build_extractor({"type": "fsdp", "bucket_size_mb": BUCKET_MB, "src_rank": 0})
    assert ext.is_sender == (rank == 0)
    metas = ext.metadata(model)  # no collective: rank 1 does not call it at all
    names = [m.name for m in metas]
    report: dict = {"names": names, "clean_names": clean_names, "syncs": []}

    engine = client = sender = None
    if rank == 0:
        engine = LocalEngineProcess.spawn(
            "weightsync.local.modules:metas_module",
            {"metas": [m.to_dict() for m in metas], "fill": "zeros"}, name="fsdp-engine",
            num_threads=1,
        )
        client = LocalEngineClient([engine], timeout_s=120)
        strategy = build_strategy({"type": "broadcast", "backend": "gloo", "timeout_s": 120})
        info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, info)
    try:
        for step in (1, 2):
            _train_step(model, opt, rank, step)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            full = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in full.items()}
            chunks = ext.extract_weights(model)
            if rank != 0:
                async for _ in chunks:
                    raise AssertionError("a non-sending rank got a chunk")
                assert ext.memory.peak_bytes == 0
                continue
            stats = await sender.send_chunks(chunks, client, version=step, manifest=metas)
            digests = await engine.call("state_digest")
            want = {n: tensor_digest(full[n]) for n in names}
            got = {n: d["digest"] for n, d in digests.items()}
            report["syncs"].append({
                "version": stats.versions, "chunks": stats.num_chunks,
                "bytes": stats.total_bytes, "mismatched": sorted(n for n in want if got.get(n) != want[n]),
                "peak_bytes": ext.memory.peak_bytes, "live_after": ext.memory.live_bytes,
                "changed": bool(step == 1 or report.get("prev") != got),
                "meta_bytes": sum(TensorMeta.from_dict(m.to_dict()).nbytes for m in metas),
            })
            report["prev"] = got
        if rank == 0:
            report.pop("prev")
            with open(out_path, "w") as f:
                json.dump(report, f)
    finally:
        if sender is not None:
            await sender.close()
        if engine is not None:
            engine.stop()


def test_fsdp2_two_ranks_sync_bit_exact_and_bounded(tmp_path) -> None:
    import torch.multiprocessing as mp

    out = str(tmp_path / "report.json")
    mp.spawn(_rank_main, args=(2, _free_port(), out), nprocs=2, join=True)
    with open(out) as f:
        report = json.load(f)

    names, clean = report["names"], report["clean_names"]
    assert sorted(names) == sorted(clean)  # wrapper prefix gone, tied lm_head sent once
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not any("_checkpoint_wrapped_module" in n or "_fsdp" in n for n in names)

    bucket = int(BUCKET_MB * (1 << 20))
    assert len(report["syncs"]) == 2
    for i, sync in enumerate(report["syncs"], start=1):
        assert sync["version"] == [i]
        assert sync["mismatched"] == [], f"engine differs from the unsharded model: {sync}"
        assert sync["changed"]
        assert sync["chunks"] >= 3  # the model is several buckets, so memory bounding is tested
        assert sync["bytes"] == sync["meta_bytes"]
        assert 0 < sync["peak_bytes"] <= 2 * bucket, sync
        assert sync["live_after"] == 0
    print("fsdp sender peak gathered bytes:", [s["peak_bytes"] for s in report["syncs"]],
          "bucket:", bucket, "model bytes:", report["syncs"][0]["bytes"])
