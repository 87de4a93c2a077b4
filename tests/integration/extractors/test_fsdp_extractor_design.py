"""``FSDPWeightExtractor(cfg)`` built from a SkyRL-style trainer config, as the interface
design's example builds it, on 2 real gloo ranks (CPU) syncing an FSDP2 tiny Qwen2 into a real
engine process (``_sharded_sync.sync_loop``: rank 0 sends over the real ``broadcast`` strategy,
rank 1 takes part in the gathers). The design's keys decide the chunks: with
``weight_sync_backend: nccl``, ``colocate_all: true`` and a threshold, whole modules batched up
to ``weight_transfer_threshold_cuda_ipc_GB``; with ``gloo``, one tensor per chunk. Either way
the engine holds exactly the unsharded model (digests against ``get_model_state_dict``)."""

from __future__ import annotations

import json

import pytest
from _sharded_sync import batch, check_report, spawn_gloo_ranks, sync_loop, tiny_qwen2

pytestmark = pytest.mark.slow

THRESHOLD_GB = 0.125 / 1024  # 128 KiB buckets


async def _rank_async(rank: int, world: int, out_path: str) -> None:
    import torch
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.extractors.fsdp import FSDPWeightExtractor

    model = tiny_qwen2()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(step: int) -> None:
        ids = batch(rank, step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def full_state() -> dict:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    for backend in ("nccl", "gloo"):
        cfg = OmegaConf.create({
            "generator": {"weight_sync_backend": backend,
                          "weight_transfer_threshold_cuda_ipc_GB": THRESHOLD_GB},
            "trainer": {"placement": {"colocate_all": True}, "strategy": "fsdp2"}})
        ext = FSDPWeightExtractor(cfg)  # every rank; the sending rank is rank 0 (the default)
        assert ext.is_sender == (rank == 0)
        path = out_path.replace(".json", f".{backend}.json")
        await sync_loop(rank=rank, ext=ext, model=model, train_step=train_step,
                        full_state=full_state, out_path=path)
        if rank == 0:
            with open(path) as f:
                report = json.load(f)
            report["planned"] = len(ext.buckets(ext.plan(model)))
            report["flags"] = [bool(ext._group_by_module), bool(ext._batch_by_threshold)]
            with open(path, "w") as f:
                json.dump(report, f)


def test_the_designs_config_keys_cut_an_fsdp2_models_stream_and_it_lands_exactly(tmp_path):
    out = str(tmp_path / "design.json")
    spawn_gloo_ranks(_rank_async, out)
    expected = [n for n in tiny_qwen2().state_dict() if n != "lm_head.weight"]
    batched = check_report(out.replace(".json", ".nccl.json"), bucket_mb=THRESHOLD_GB * 1024,
                           expected_names=expected)
    assert batched["flags"] == [True, True]
    assert [s["chunks"] for s in batched["syncs"]] == [batched["planned"]] * 2
    assert 3 <= batched["planned"] < len(expected)  # several modules a chunk
    with open(out.replace(".json", ".gloo.json")) as f:
        single = json.load(f)
    assert single["flags"] == [False, False]
    assert [s["chunks"] for s in single["syncs"]] == [len(expected)] * 2  # a tensor a chunk
    assert all(s["mismatched"] == [] and s["versions"] == [i]
               for i, s in enumerate(single["syncs"], start=1))
