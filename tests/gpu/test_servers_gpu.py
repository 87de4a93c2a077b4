"""``broadcast`` over NCCL from a trainer on GPU 0 into our servers on GPU 1, through the front
door (``ws.connect(url, strategy="broadcast").push(model)``; the backend follows the tensors:
NCCL). Afterwards what the server serves equals the trainer's model (bf16 tolerance):

* ``serve-reward`` (pooling): ``/score`` against transformers' scores;
* ``serve-policy`` (generative, vLLM's OpenAI app + our control plane): prompt logprobs from
  ``/v1/completions`` against transformers'.

Both servers share GPU 1 (reward about 25% of its memory, policy about 45%)."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(560)]

API_KEY = "gpu-test-token"
GPU1 = {"CUDA_VISIBLE_DEVICES": "1"}


def _need_two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL allows one rank per GPU)")


def _push(url: str, model) -> object:
    import weightsync as ws

    async def go():
        async with ws.connect([url], strategy="broadcast", api_key=API_KEY,
                              timeout_s=120) as sync:
            return await sync.push(model)

    return asyncio.run(go())


def test_broadcast_into_reward_server_on_gpu1(tmp_path):
    _need_two_gpus()
    import torch
    from _vllm_helpers import close, hf_scores
    from transformers import AutoModelForSequenceClassification

    from weightsync.testing.servers import RewardServerProcess
    from weightsync.testing.tiny_models import build_tiny_reward_model

    base = build_tiny_reward_model(tmp_path / "base", seed=0, head_std=1.0)
    new = build_tiny_reward_model(tmp_path / "new", seed=5, head_std=1.0)
    server = RewardServerProcess(
        base, log_path=str(tmp_path / "reward.log"), env=GPU1,
        extra_args=["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "256",
                    "--gpu-memory-utilization", "0.25", "--enforce-eager"],
    ).start_healthy()
    url = server.url
    try:
        from weightsync.reward import VLLMRewardClient

        async def scores():
            async with VLLMRewardClient(port=int(url.rsplit(":", 1)[1]), api_key=API_KEY) as c:
                from _vllm_helpers import TEXTS

                return await c.score_batch(TEXTS)

        before = asyncio.run(scores())
        assert close(before, hf_scores(base))
        torch.cuda.set_device(0)
        model = AutoModelForSequenceClassification.from_pretrained(
            new, dtype=torch.bfloat16).cuda(0)
        stats = _push(url, model)
        after = asyncio.run(scores())
        assert stats.versions == [1]
        assert close(after, hf_scores(new)), (after, hf_scores(new))
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 0.5
    finally:
        server.stop()


def test_broadcast_into_policy_server_on_gpu1(tmp_path):
    _need_two_gpus()
    import httpx
    import torch
    from _vllm_helpers import close, hf_prompt_logprobs, prompt_ids
    from transformers import AutoModelForCausalLM

    from weightsync.testing.servers import PolicyServerProcess
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    base = build_tiny_causal_lm(tmp_path / "base", seed=0)
    new = build_tiny_causal_lm(tmp_path / "new", seed=5)
    ids = prompt_ids(base)
    server = PolicyServerProcess(
        base, log_path=str(tmp_path / "policy.log"), env=GPU1,
        extra_args=["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "256",
                    "--gpu-memory-utilization", "0.45", "--enforce-eager"],
    ).start_healthy()
    url = server.url

    def served() -> list[float]:
        out = []
        for p in ids:
            r = httpx.post(f"{url}/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"model": base, "prompt": p, "max_tokens": 1,
                                 "temperature": 0, "prompt_logprobs": 0})
            r.raise_for_status()
            lps = r.json()["choices"][0]["prompt_logprobs"]
            out += [lps[i][str(p[i])]["logprob"] for i in range(1, len(p))]
        return out

    try:
        before = served()
        assert close(before, hf_prompt_logprobs(base, ids))
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.bfloat16).cuda(0)
        stats = _push(url, model)
        after = served()
        assert stats.versions == [1]
        assert close(after, hf_prompt_logprobs(new, ids)), after
    finally:
        server.stop()
