"""GPU path of the vLLM loader (marked ``gpu``; skipped without CUDA): ``model.load_weights``
(direct mode) fed by CUDA IPC and packed CUDA IPC from this process into a pooling model on the
same GPU. bf16, so scores are compared to transformers with a bf16 tolerance."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from weightsync import WeightChunk, build_strategy
from weightsync.errors import WeightMismatchError

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TEXTS = ["The model is helpful today.", "hi", "Question: what is 2 + 2? Answer: 4."]
EXT = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"


def close(got, want) -> bool:
    """bf16 end to end (vLLM's kernels against transformers'): relative + absolute tolerance.
    The scores lie between -15 and 15 and two weight sets' scores differ by more than 0.5 (the
    test checks that too); vLLM and transformers, same bf16 weights, differed by 0.056 at a
    score of -0.18 on an H100 (2026-11-23), so the absolute part is 0.1."""
    return all(abs(a - b) <= 0.03 * abs(b) + 0.1 for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is live in this process
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import build_tiny_reward_model

    root = tmp_path_factory.mktemp("gpu-rm")
    base = build_tiny_reward_model(root / "base", seed=0, head_std=1.0)
    new = build_tiny_reward_model(root / "new", seed=5, head_std=1.0)
    llm = LLM(model=base, runner="pooling", dtype="bfloat16", max_model_len=256,
              gpu_memory_utilization=0.2, enforce_eager=True, worker_extension_cls=EXT)
    try:
        yield llm, base, new
    finally:
        shutdown_llm(llm)


def served(llm):
    from vllm import PoolingParams

    outs = llm.encode(TEXTS, pooling_params=PoolingParams(task="classify", use_activation=False),
                      pooling_task="classify", use_tqdm=False)
    return [float(o.outputs.data.reshape(-1)[0]) for o in outs]


def hf(model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(torch.bfloat16).cuda()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt").to("cuda")).logits[0, 0].float().item()
                for t in TEXTS]


def cuda_state(model_dir):
    from safetensors.torch import load_file

    return {k: v.to(torch.bfloat16).cuda() for k, v in load_file(f"{model_dir}/model.safetensors").items()}


@pytest.mark.parametrize("strategy", ["cuda_ipc", "packed_cuda_ipc"])
def test_direct_load_over_cuda_ipc(rm, strategy):
    from weightsync.clients import FanOutClient

    llm, base, new = rm
    (state,) = llm.collective_rpc("weightsync_state")
    assert state["load_mode"] == "direct"
    client = FanOutClient([llm])
    target, other = (new, base) if state["version"] % 2 == 0 else (base, new)
    sd = cuda_state(target)
    names = list(sd)

    async def go():
        strat = build_strategy({"type": strategy})
        info = await strat.create_sync_info(None, client)
        sender = await strat.create_sender(None, client, info)
        try:
            chunks = [WeightChunk(names[i:i + 4], [sd[n] for n in names[i:i + 4]])
                      for i in range(0, len(names), 4)]
            stats = await sender.send_chunks(chunks, client)
            with pytest.raises(WeightMismatchError, match="shape"):
                bad = torch.zeros(3, device="cuda", dtype=torch.bfloat16)
                await sender.send_chunks([WeightChunk(["model.norm.weight"], [bad])], client)
            return stats
        finally:
            await sender.close()

    before = served(llm)
    stats = asyncio.run(go())
    after = served(llm)
    assert stats.versions == [state["version"] + 1]
    assert close(after, hf(target)), (after, hf(target))
    assert close(before, hf(other)), (before, hf(other))
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 0.5
