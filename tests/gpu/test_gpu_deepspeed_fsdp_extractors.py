"""FSDP2 and DeepSpeed ZeRO-3 extractors on 2 GPUs over NCCL (marked ``gpu``; needs 2 GPUs).

The CPU/gloo tests in tests/integration cover the same logic with real engines; these check the
CUDA path: ``full_tensor()`` / ``GatheredParameters`` over NCCL, gathered tensors on the GPU,
bf16 models, the exact memory meter on CUDA storages. Rank 0 consumes the chunks one at a time
(as a sender does) and compares digests against the unsharded model gathered independently
(``get_model_state_dict`` / one ``GatheredParameters`` over everything).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from datetime import timedelta

import pytest

from weightsync.testing.servers import free_port

pytestmark = pytest.mark.gpu

BUCKET_MB = 0.25


def _digest(t) -> str:
    import torch

    t = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()


def _model():
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def _rank_main(rank: int, world: int, port: int, kind: str, out: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    if kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl", timeout=timedelta(seconds=120))
    else:
        torch.distributed.init_process_group("nccl", timeout=timedelta(seconds=120),
                                             device_id=torch.device("cuda", rank))
    try:
        asyncio.run(_rank_async(rank, world, kind, out))
    finally:
        torch.distributed.destroy_process_group()


async def _rank_async(rank: int, world: int, kind: str, out: str) -> None:
    import torch

    from weightsync import build_extractor

    model = _model()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(rank)).cuda()
    if kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.cuda()
        mesh = init_device_mesh("cuda", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        target = model
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
               "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        target = engine
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    ext = build_extractor({"type": kind, "bucket_size_mb": BUCKET_MB})
    names = [m.name for m in ext.metadata(target)]
    got: dict[str, str] = {}
    devices: set[str] = set()
    chunks = 0
    async for chunk in ext.extract_weights(target):
        chunks += 1
        for n, t in zip(chunk.names, chunk.tensors, strict=True):
            got[n] = _digest(t)
            devices.add(t.device.type)
        del chunk, t
    if rank == 0:
        with open(out, "w") as f:
            json.dump({
                "names": names, "chunks": chunks, "devices": sorted(devices),
                "mismatched": sorted(n for n in names if got.get(n) != _digest(full[n])),
                "peak": ext.memory.peak_bytes, "live": ext.memory.live_bytes,
            }, f)


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_sharded_extractor_on_two_gpus(tmp_path, kind: str) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp

    out = str(tmp_path / "report.json")
    mp.spawn(_rank_main, args=(2, free_port(), kind, out), nprocs=2, join=True)
    with open(out) as f:
        r = json.load(f)
    expected = [n for n in _model().state_dict() if n != "lm_head.weight"]
    assert sorted(r["names"]) == sorted(expected)
    assert r["mismatched"] == [], r["mismatched"]
    assert r["devices"] == ["cuda"] and r["chunks"] >= 3
    assert 0 < r["peak"] <= 2 * int(BUCKET_MB * (1 << 20)), r
    assert r["live"] == 0
    print(f"{kind} on 2 GPUs: peak gathered bytes {r['peak']}, bucket "
          f"{int(BUCKET_MB * (1 << 20))}, chunks {r['chunks']}")
