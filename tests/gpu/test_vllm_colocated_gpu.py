"""Colocation on one GPU: a generative policy engine (about 55% of the GPU's memory) and a
pooling reward engine (about 20%) in one process, each receiving its own sync over CUDA IPC
from tensors on the same GPU; each then serves what transformers computes for its new weights,
and the other engine is untouched by a sync that was not its own."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]

from _vllm_helpers import (  # noqa: E402
    EXT,
    close,
    close_scores,
    cuda_state,
    hf_prompt_logprobs,
    hf_scores,
    prompt_ids,
    sync,
    vllm_prompt_logprobs,
    vllm_scores,
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import build_tiny_causal_lm, build_tiny_reward_model

    root = tmp_path_factory.mktemp("gpu-colocated")
    lm = (build_tiny_causal_lm(root / "lm0", seed=0), build_tiny_causal_lm(root / "lm1", seed=5))
    rm = (build_tiny_reward_model(root / "rm0", seed=0, head_std=1.0),
          build_tiny_reward_model(root / "rm1", seed=5, head_std=1.0))
    policy = LLM(model=lm[0], dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.55,
                 enforce_eager=True, worker_extension_cls=EXT, seed=0)
    try:
        reward = LLM(model=rm[0], runner="pooling", dtype="bfloat16", max_model_len=256,
                     gpu_memory_utilization=0.2, enforce_eager=True, worker_extension_cls=EXT)
        try:
            yield policy, reward, lm, rm
        finally:
            shutdown_llm(reward)
    finally:
        shutdown_llm(policy)


def test_policy_and_reward_on_one_gpu_each_get_their_own_sync(engines):
    import torch

    policy, reward, lm, rm = engines
    ids = prompt_ids(lm[0])
    free, total = torch.cuda.mem_get_info()
    assert free < 0.4 * total  # both engines really hold their share of this GPU
    scores0 = vllm_scores(reward)
    assert close_scores(scores0, hf_scores(rm[0]))
    stats = sync(policy, cuda_state(lm[1]), {"type": "cuda_ipc"})
    assert stats.versions == [1]
    assert close(vllm_prompt_logprobs(policy, ids), hf_prompt_logprobs(lm[1], ids))
    # the reward engine did not take the policy's sync: its version, and its scores up to the
    # run-to-run noise of a bf16 GPU pass (~1e-7 seen on an H200; a sync moves them by > 1e-2)
    (r_state,) = reward.collective_rpc("weightsync_state")
    assert r_state["version"] == 0
    assert vllm_scores(reward) == pytest.approx(scores0, abs=1e-4)
    stats = sync(reward, cuda_state(rm[1]), {"type": "packed_cuda_ipc"})
    assert stats.versions == [1]
    assert close_scores(vllm_scores(reward), hf_scores(rm[1]))
    assert not close_scores(vllm_scores(reward), scores0)  # the new head really scores apart
    assert close(vllm_prompt_logprobs(policy, ids), hf_prompt_logprobs(lm[1], ids))
    (p_state,) = policy.collective_rpc("weightsync_state")
    (r_state,) = reward.collective_rpc("weightsync_state")
    assert p_state["version"] == r_state["version"] == 1
