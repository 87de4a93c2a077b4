"""DeepSpeed ZeRO-3 extractor on 2 real gloo ranks, DeepSpeed's CPU accelerator, into a real
engine process.

Same check as the FSDP2 test: train, sync, train, sync a tiny Qwen2 trained with ZeRO-3 (every
parameter partitioned: ``stage3_param_persistence_threshold`` 0), the engine ends bit-exact equal
to the unsharded model (reference: one ``GatheredParameters`` over all parameters, cloned), names
carry no ``module.`` prefix, the tied lm_head is sent once, the sender's gathered copies alive at
once stay within 2 buckets. A second, cheap case: ZeRO-2 (whole parameters, no gather).

DeepSpeed on CPU: ``DS_ACCELERATOR=cpu`` and ``deepspeed.init_distributed(dist_backend="gloo")``;
torch's AdamW with ``zero_allow_untested_optimizer``. DeepSpeed would JIT-compile its
shared-memory all-reduce kernel at start (minutes on 2 cores; gloo is used anyway), so the
tests tell it that op is unavailable (``deepspeed.ops.__compatible_ops__``, a dict DeepSpeed
keeps for exactly this).
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta

import pytest
from _sharded_sync import batch, check_report, sync_loop, tiny_qwen2

from weightsync.testing.servers import free_port

pytestmark = pytest.mark.slow

BUCKET_MB = 0.125


def _rank_main(rank: int, world: int, port: int, stage: int, out_path: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu",
    )
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__ = {}  # no JIT build of the shm all-reduce kernel
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    import torch.distributed as dist

    try:
        asyncio.run(_rank_async(rank, stage, out_path))
        # leave together: a rank that destroys its group while the other still uses the store
        # rank 0 hosts has ended in gloo's "terminate called without an active exception"
        dist.barrier()
    finally:
        dist.destroy_process_group()


async def _rank_async(rank: int, stage: int, out_path: str) -> None:
    import deepspeed
    import torch

    from weightsync import build_extractor

    model = tiny_qwen2()
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    params = list(engine.module.parameters())
    if stage == 3:
        assert all(p.ds_tensor.numel() < p.ds_numel for p in params), "not partitioned"

    def train_step(step: int) -> None:
        ids = batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    def full_state() -> dict:
        if stage != 3:
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    from weightsync.extractors.auto import model_kind

    # the front door picks this extractor from the engine (ZeRO-1/2 and -3 alike)
    assert model_kind(engine) == "deepspeed" and model_kind(engine.module) == (
        "deepspeed" if stage == 3 else "hf")
    ext = build_extractor({"type": "deepspeed", "bucket_size_mb": BUCKET_MB})
    assert ext.is_sender == (rank == 0)
    # the engine itself is passed (names start with "module."): the extractor unwraps it
    await sync_loop(rank=rank, ext=ext, model=engine, train_step=train_step,
                    full_state=full_state, out_path=out_path)


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_two_ranks_sync_bit_exact_and_bounded(tmp_path, stage: int) -> None:
    import torch.multiprocessing as mp

    out = str(tmp_path / "report.json")
    mp.spawn(_rank_main, args=(2, free_port(), stage, out), nprocs=2, join=True)
    expected = [n for n in tiny_qwen2().state_dict() if n != "lm_head.weight"]
    report = check_report(out, bucket_mb=BUCKET_MB, expected_names=expected, fresh=stage == 3)
    print(f"deepspeed zero-{stage}: sender peak gathered bytes",
          [s["peak_bytes"] for s in report["syncs"]], "bucket", int(BUCKET_MB * (1 << 20)),
          "model bytes", report["syncs"][0]["bytes"], "chunks", report["syncs"][0]["chunks"])
