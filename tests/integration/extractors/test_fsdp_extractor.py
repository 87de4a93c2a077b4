"""FSDP2 extractor on 2 real gloo ranks (CPU) syncing into a real engine process.

Rank 0 (the sender) spawns a ``LocalEngineProcess`` holding a zero-filled module with the
engine's names and pushes the FSDP2-sharded tiny Qwen2 causal LM (layers wrapped with
activation checkpointing) into it through the real ``broadcast`` (gloo) strategy; rank 1 only
takes part in the gathers. Twice: train, sync, train, sync. Checked: the engine holds exactly the
unsharded model (bit-exact digests against ``get_model_state_dict(full_state_dict=True)``, an
independent gather path in torch), names are clean (checkpoint-wrapper prefix gone, tied
lm_head sent once as the embedding), metadata needs no collective, and the sender's live
gathered bytes never exceed 2 buckets.
"""

from __future__ import annotations

import json

import pytest
from _sharded_sync import batch, check_report, spawn_gloo_ranks, sync_loop, tiny_qwen2

pytestmark = pytest.mark.slow

BUCKET_MB = 0.125


async def _rank_async(rank: int, world: int, out_path: str) -> None:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import build_extractor

    model = tiny_qwen2()
    mesh = init_device_mesh("cpu", (world,))
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
        fully_shard(layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(step: int) -> None:
        ids = batch(rank, step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def full_state() -> dict:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in full.items()}

    ext = build_extractor({"type": "fsdp", "bucket_size_mb": BUCKET_MB, "src_rank": 0})
    assert ext.is_sender == (rank == 0)
    await sync_loop(rank=rank, ext=ext, model=model, train_step=train_step,
                    full_state=full_state, out_path=out_path)


def test_fsdp2_two_ranks_sync_bit_exact_and_bounded(tmp_path) -> None:
    out = str(tmp_path / "report.json")
    spawn_gloo_ranks(_rank_async, out)  # the ranks leave together (a barrier before destroy)
    expected = [n for n in tiny_qwen2().state_dict() if n != "lm_head.weight"]
    report = check_report(out, bucket_mb=BUCKET_MB, expected_names=expected)
    assert "model.embed_tokens.weight" in report["names"]
    print("fsdp: sender peak gathered bytes", [s["peak_bytes"] for s in report["syncs"]],
          "bucket", int(BUCKET_MB * (1 << 20)), "model bytes", report["syncs"][0]["bytes"],
          "chunks", report["syncs"][0]["chunks"])
    json.dumps(report)
