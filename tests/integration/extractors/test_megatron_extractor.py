"""``megatron`` extractor on a real Megatron-Core GPT model: tensor parallel over 2 gloo ranks
(CPU), exported by mbridge, pushed through ``ws.connect`` into an engine holding the HF model.

Each rank holds its TP shard of a GPT built by Megatron-Core from a tiny HF Qwen2 checkpoint
(``_megatron_local``: mbridge's real load/export on Megatron-Core's local layers, as Transformer
Engine needs CUDA). Twice: one optimizer step (SGD on seeded gradients: Megatron-Core's rotary
embedding needs CUDA in forward, so no forward pass runs on CPU), then ``push`` on both ranks.
Rank 0 is the sender: its engine is a real ``WeightUpdateEndpoint`` with the HF
``Qwen2ForCausalLM`` behind a ``torch_module`` loader (names, shapes and dtypes validated against
the HF model), reached over the real gloo ``broadcast``. Checked: after each push the engine's
HF state equals, bit for bit, what the bridge's own ``export_weights`` gives (called apart on
every rank), every HF tensor is covered, the weights moved, rank 1 got nothing; the chunks are
threshold buckets (several of them, none over the bucket unless one tensor is) and packed (each
chunk's tensors are views of one buffer), and the sender's live buffers stay within 2 buckets.
"""

from __future__ import annotations

import json
import os

import pytest
from _sharded_sync import spawn_gloo_ranks

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")
pytest.importorskip("mbridge", reason="needs mbridge (pip install -e '.[megatron]')")

pytestmark = pytest.mark.slow

BUCKET_MB = 0.03  # ~31 KB: the tiny model (~0.5 MB) goes in many chunks


def _sgd_step(model, step: int, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    model.zero_grad(set_to_none=True)


async def _rank_async(rank: int, world: int, out: str) -> None:
    import torch
    from _megatron_local import local_bridge, local_model
    from megatron.core import parallel_state

    import weightsync as ws
    from weightsync.extractors.megatron import MegatronExtractorConfig, MegatronWeightExtractor
    from weightsync.loaders.torch_module import TorchModuleWeightLoader

    model_dir = os.path.join(out, "model")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        bridge = local_bridge(model_dir)
        model = local_model(bridge, model_dir)
        ext = MegatronWeightExtractor(MegatronExtractorConfig(bucket_size_mb=BUCKET_MB),
                                      bridge=bridge)
        hf = None
        engines: list = []
        if rank == 0:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            engines = [ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=hf), name="hf")]
        report: dict = {"syncs": []}
        strategy = {"type": "broadcast", "backend": "gloo", "timeout_s": 60}
        async with ws.connect(engines, strategy, extractor=ext) as sync:
            before = None
            for step in (1, 2):
                _sgd_step(model, step, rank)
                want = {n: t.clone() for n, t in bridge.export_weights([model])}  # collective
                stats = await sync.push(model, version=step)
                if rank != 0:
                    assert stats is None
                    continue
                got = {n: t.detach().clone() for n, t in hf.state_dict().items()}
                report["syncs"].append({
                    "versions": stats.versions, "chunks": stats.num_chunks,
                    "bytes": stats.total_bytes,
                    "export_bytes": sum(t.numel() * t.element_size() for t in want.values()),
                    "hf_names_not_exported": sorted(set(got) - set(want)),
                    "exported_not_in_hf": sorted(set(want) - set(got)),
                    "mismatched": sorted(n for n in want if not torch.equal(got[n], want[n])),
                    "moved": before is None or any(not torch.equal(before[n], got[n])
                                                   for n in got),
                    "peak_bytes": ext.memory.peak_bytes,
                    "largest_tensor": max(t.numel() * t.element_size() for t in want.values()),
                })
                before = got
        chunks = [c async for c in ext.extract_weights(model)]  # collective again, directly
        if rank == 0:
            report["chunk_check"] = [{
                "packed": c.packed,
                "bytes": c.total_size_bytes,
                "buffers": len({t.untyped_storage().data_ptr() for t in c.tensors}),
                "dtypes": len(set(c.dtypes)),
                "contiguous": all(t.is_contiguous() for t in c.tensors),
                "tensors": len(c),
            } for c in chunks]
            with open(os.path.join(out, "report.json"), "w") as f:
                json.dump(report, f)
        else:
            assert chunks == []
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_tp2_push_equals_the_bridge_export(tmp_path) -> None:
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    # 2 KV heads: tensor parallelism splits the KV heads over the 2 ranks
    build_tiny_causal_lm(tmp_path / "model", family="qwen2", num_kv_heads=2, seed=0)
    spawn_gloo_ranks(_rank_async, str(tmp_path), world=2)
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    bucket = int(BUCKET_MB * (1 << 20))
    assert len(report["syncs"]) == 2
    for step, sync in enumerate(report["syncs"], start=1):
        assert sync["versions"] == [step]
        assert sync["hf_names_not_exported"] == []
        assert sync["exported_not_in_hf"] == []
        assert sync["mismatched"] == [], sync
        assert sync["moved"]
        assert sync["bytes"] == sync["export_bytes"]
        assert sync["chunks"] >= 5
        assert 0 < sync["peak_bytes"] <= 2 * max(bucket, sync["largest_tensor"]), sync
    checks = report["chunk_check"]
    assert len(checks) >= 5
    for c in checks:
        assert c["packed"] and c["contiguous"]
        assert c["buffers"] == c["dtypes"] == 1, c  # float32 model: one buffer per chunk
        assert c["bytes"] <= bucket or c["tensors"] == 1, c
