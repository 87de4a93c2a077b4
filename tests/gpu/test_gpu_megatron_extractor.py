"""``megatron`` extractor on 2 GPUs (TP=2 over NCCL) with a bridge as it is used in training
(marked ``gpu``; needs 2 GPUs, Megatron-Core and mbridge or Megatron-Bridge).

The CPU test (tests/integration/extractors/test_megatron_extractor.py) runs Megatron-Core's local
layers through mbridge and pushes into a real engine; this one runs, where Transformer Engine
is installed, the Transformer Engine layers the bridges build, with the bridge the extractor
finds itself from ``hf_model_path`` (Megatron-Bridge when installed, else mbridge), and without
it mbridge on Megatron-Core's local layers moved to the GPU (``_megatron_local``), bf16 on CUDA,
the collectives over NCCL. Rank 0 consumes the chunks one at a time, as a sender does, and
compares each tensor with the bridge's own export made apart (bit-exact), checks the chunks are
packed threshold buckets on the GPU, and rank 1 gets none.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import timedelta

import pytest

from weightsync.testing.servers import free_port

pytestmark = pytest.mark.gpu

BUCKET_MB = 0.25


def _bridge_package() -> tuple[str, bool] | None:
    """(the bridge package, whether its Transformer Engine layers can be built). Without
    Transformer Engine (its torch extension is built from source: not staged on the GPU
    machine), mbridge drives Megatron-Core's own local layers (``_megatron_local``, as on CPU);
    Megatron-Bridge imports Transformer Engine itself."""
    try:
        import transformer_engine  # noqa: F401 - both bridges build TE layers
        te = True
    except ImportError:
        te = False
    for pkg in ("megatron.bridge", "mbridge"):
        try:
            __import__(pkg)
        except ImportError:
            continue
        if te or pkg == "mbridge":
            return pkg, te
    return None


def _build(pkg: str, model_dir: str, world: int, te: bool):
    """The TP-sharded model as the bridge builds it, with the checkpoint's weights; and the
    bridge the extractor must use (None: the extractor builds its own from the checkpoint)."""
    import torch

    if not te:  # mbridge on Megatron-Core's local layers, moved to this rank's GPU
        from _megatron_local import local_bridge, local_model
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        bridge = local_bridge(model_dir, dtype=torch.bfloat16)
        return local_model(bridge, model_dir, device=torch.cuda.current_device()), bridge
    if pkg == "megatron.bridge":
        from megatron.bridge import AutoBridge

        provider = AutoBridge.from_hf_pretrained(model_dir).to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = world
        provider.pipeline_model_parallel_size = 1
        provider.params_dtype = torch.bfloat16
        provider.bf16 = True
        provider.finalize()
        provider.initialize_model_parallel(seed=0)
        return provider.provide_distributed_model(wrap_with_ddp=False), None
    from mbridge import AutoBridge as MBridge
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    bridge = MBridge.from_pretrained(model_dir)
    return bridge.get_model(weight_path=model_dir, wrap_with_ddp=False), None


def _rank_main(rank: int, world: int, port: int, pkg: str, te: bool, out: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", timeout=timedelta(seconds=120),
                                         device_id=torch.device("cuda", rank))
    try:
        asyncio.run(_rank_async(rank, world, pkg, te, out))
    finally:
        torch.distributed.destroy_process_group()


async def _rank_async(rank: int, world: int, pkg: str, te: bool, out: str) -> None:
    import torch

    from weightsync import build_extractor
    from weightsync.extractors.megatron import MegatronExtractorConfig, MegatronWeightExtractor

    model_dir = os.path.join(out, "model")
    model, bridge = _build(pkg, model_dir, world, te)
    if bridge is None:
        ext = build_extractor({"type": "megatron", "hf_model_path": model_dir,
                               "bridge_package": pkg, "bucket_size_mb": BUCKET_MB})
    else:
        ext = MegatronWeightExtractor(MegatronExtractorConfig(bucket_size_mb=BUCKET_MB),
                                      bridge=bridge)
    from weightsync.extractors.megatron import as_model_list, export_function

    want = {n: t.detach().clone()  # the bridge's own export: it takes the list of model chunks
            for n, t in export_function(ext.bridge)(as_model_list(model))}
    metas = ext.metadata(model)
    report: dict = {"names": [m.name for m in metas], "want": sorted(want), "chunks": []}
    async for chunk in ext.extract_weights(model):  # one at a time, as a sender takes them
        report["chunks"].append({
            "packed": chunk.packed, "bytes": chunk.total_size_bytes, "n": len(chunk),
            "cuda": all(t.is_cuda for t in chunk.tensors),
            "buffers": len({t.untyped_storage().data_ptr() for t in chunk.tensors}),
            "dtypes": len(set(chunk.dtypes)),
            "mismatched": [n for n, t in zip(chunk.names, chunk.tensors, strict=True)
                           if not torch.equal(t, want[n])],
        })
        del chunk
    report["peak_bytes"] = ext.memory.peak_bytes
    if rank == 0:
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f)
    else:
        assert report["chunks"] == []


def test_megatron_tp2_nccl_chunks_equal_the_bridge_export(tmp_path) -> None:
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    found = _bridge_package()
    if found is None:
        pytest.skip("needs mbridge (or megatron-bridge with transformer-engine) and "
                    "megatron-core")
    pkg, te = found
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    build_tiny_causal_lm(tmp_path / "model", family="qwen2", hidden_size=128, num_layers=4,
                         num_heads=2, num_kv_heads=2, seed=0)
    mp.spawn(_rank_main, args=(2, free_port(), pkg, te, str(tmp_path)), nprocs=2, join=True)
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    assert sorted(report["names"]) == report["want"]
    assert len(report["chunks"]) >= 3
    bucket = int(BUCKET_MB * (1 << 20))
    for c in report["chunks"]:
        assert c["mismatched"] == [], c
        assert c["packed"] and c["cuda"] and c["buffers"] == c["dtypes"], c
        assert c["bytes"] <= bucket or c["n"] == 1, c
    assert report["peak_bytes"] > 0
