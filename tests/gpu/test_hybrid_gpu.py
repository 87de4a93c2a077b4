"""The hybrid engine on two GPUs (the verl / SkyRL colocated layout): an FSDP2 trainer over 2
ranks and a vLLM engine with tensor parallel size 2 on the same 2 GPUs; TP worker ``i`` is fed
by CUDA IPC from training rank ``i`` on its own GPU (``every_rank: true``), every rank sending
in lockstep and rank 0 alone driving the engine.

* ``fsdp``: the trainer holds the "new" model sharded with ``fully_shard``; every rank gathers
  the full weights (``is_sender: true`` on every rank) and sends handles to its copy;
* ``lora_merge``: every rank holds the same PEFT LoRA model (replicated, as data parallel
  training keeps it) with trained adapters (set from one seed on every rank); the merged
  weights are sent.

After the push the prompt logprobs vLLM serves equal transformers' for the trainer's model
(bf16), and each TP worker reports that it read the copy of the rank on its GPU.
Each rank writes its report as soon as it has it; a rank that fails exits, and ``mp.spawn``
ends the other one.
"""

from __future__ import annotations

import json
import os

import pytest

from weightsync.testing.servers import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(560)]

def _rank_main(rank: int, world: int, port: int, kind: str, strategy: str, root: str) -> None:
    from datetime import timedelta

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", timeout=timedelta(seconds=300),
                                         device_id=torch.device("cuda", rank))
    try:
        import asyncio

        asyncio.run(_rank_async(rank, world, kind, strategy, root))
    finally:
        torch.distributed.destroy_process_group()


def _trainer_model(kind: str, new: str, rank: int, world: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.bfloat16).cuda(rank)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, {"type": "fsdp", "bucket_size_mb": 0.25, "is_sender": True}
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                       target_modules="all-linear"))
    # "trained" adapters, the same on every rank (as data-parallel replicas are): both A and B
    # from one seeded generator. PEFT initialises A from the process's own random state, which
    # differs between the ranks: with A left as it was, each TP worker read a rank with other
    # adapters and the engine served a mix of two models (seen on 2 x H100, 2026-11-25)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                scale = 0.5 if "lora_B" in name else 0.1
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model, {"type": "lora_merge", "bucket_size_mb": 0.25, "is_sender": True}


def _reference_logprobs(kind: str, model, new: str, ids: list[list[int]]) -> list[float]:
    """Rank 0: transformers on the full weights the trainer holds."""
    import copy

    from _vllm_helpers import hf_prompt_logprobs

    return hf_prompt_logprobs(new if kind == "fsdp" else copy.deepcopy(model).merge_and_unload(),
                              ids)


async def _rank_async(rank: int, world: int, kind: str, strategy: str, root: str) -> None:
    import torch
    from _vllm_helpers import close, prompt_ids, start_llm, vllm_prompt_logprobs

    from weightsync import build_extractor, build_strategy
    from weightsync.clients import FanOutClient
    from weightsync.types import EmptyWeightSyncInfo

    base, new = os.path.join(root, "base"), os.path.join(root, "new")
    report: dict = {"rank": rank}
    out = os.path.join(root, f"{kind}-{strategy}-rank{rank}.json")
    llm = client = None
    try:
        model, ext_cfg = _trainer_model(kind, new, rank, world)
        torch.distributed.barrier()
        if rank == 0:
            llm = start_llm(base, "0,1", tp=2)
            client = FanOutClient([llm], timeout_s=120)
        torch.distributed.barrier()  # the engine is up before anyone joins
        ids = prompt_ids(base)
        before = vllm_prompt_logprobs(llm, ids) if rank == 0 else None
        ext = build_extractor(ext_cfg)
        strat = build_strategy({"type": strategy, "every_rank": True, "timeout_s": 120,
                                "bucket_size_mb": 0.25})
        sender = await strat.create_sender(None, client, EmptyWeightSyncInfo())
        try:
            stats = await sender.send_chunks(
                ext.extract_weights(model, torch.bfloat16), client, version=1,
                manifest=ext.metadata(model, torch.bfloat16))
        finally:
            await sender.close()
        report.update(versions=stats.versions, chunks=stats.num_chunks)
        if rank == 0:
            after = vllm_prompt_logprobs(llm, ids)
            want = _reference_logprobs(kind, model, new, ids)
            report.update(
                matches=close(after, want), changed=max(abs(a - b) for a, b in
                                                        zip(before, after, strict=True)),
                replicas=llm.collective_rpc("bench_receiver_attr", args=("last_replica",)),
                tp=[r[1] for r in llm.collective_rpc("bench_tp")],
            )
    except BaseException as e:
        report["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        with open(out, "w") as f:
            json.dump(report, f)
        if client is not None:
            await client.close_weight_transfer()
        if llm is not None:
            from weightsync._runtime.vllm_compat import shutdown_llm

            shutdown_llm(llm)


@pytest.mark.parametrize(("kind", "strategy"), [("fsdp", "cuda_ipc"),
                                                ("fsdp", "packed_cuda_ipc"),
                                                ("lora_merge", "cuda_ipc")])
def test_hybrid_fsdp2_tp2_engine_on_the_same_gpus(tmp_path, kind, strategy):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    from weightsync.testing.tiny_models import build_tiny_causal_lm

    root = str(tmp_path)
    build_tiny_causal_lm(os.path.join(root, "base"), hidden_size=128, num_heads=2,
                         num_kv_heads=2, seed=0)
    build_tiny_causal_lm(os.path.join(root, "new"), hidden_size=128, num_heads=2,
                         num_kv_heads=2, seed=5)
    mp.spawn(_rank_main, args=(2, free_port(), kind, strategy, root), nprocs=2, join=True)
    r0, r1 = (json.load(open(os.path.join(root, f"{kind}-{strategy}-rank{r}.json")))  # noqa: SIM115
              for r in (0, 1))
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["versions"] == r1["versions"] == [1]
    assert r0["chunks"] == r1["chunks"] > 2
    assert r0["tp"] == [2, 2]
    assert r0["replicas"] == [0, 1]  # TP worker i read training rank i's copy, on its own GPU
    assert r0["matches"] and r0["changed"] > 0.5, r0
