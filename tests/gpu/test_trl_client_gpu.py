"""TRL's own ``VLLMClient`` (the installed ``trl`` package, unchanged) against ``serve-policy``
started with ``--weight-transfer-config '{"backend": "nccl"}'`` and no dev mode.

The server runs on GPU 1 (bf16, a tiny Qwen2); TRL's client is the trainer on GPU 0:
``init_communicator`` (``/get_world_size``, then ``/init_weight_transfer_engine`` beside vLLM's
NCCL ``trainer_init``), then step after step ``update_model_params`` (one update of every
parameter), ``update_named_param`` inside ``weight_update()`` (one update), and
``update_named_param`` alone (one update per tensor), each through ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``. After each step the served version
(``/runtime_version``) has moved by the updates it made, and what TRL's ``generate`` returns is
what transformers computes with the pushed weights: the logprob of every generated token,
teacher-forced (bf16 tolerance; the tokens themselves may differ at a near tie). Skipped
without ``trl`` or with fewer than 2 GPUs."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(560)]

GPU1 = {"CUDA_VISIBLE_DEVICES": "1"}
N_NEW = 8


def _vllm_client_cls():
    pytest.importorskip("trl")
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:  # TRL releases before the module moved
        from trl.extras.vllm_client import VLLMClient
    return VLLMClient


def _need_two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL allows one rank per GPU)")


def _version(url: str) -> int:
    import httpx

    state = httpx.get(url + "/runtime_version", timeout=10).json()
    assert state["state"] == "ready", state
    return int(state["version"])


def _matches(client, model, prompts: list[list[int]]) -> bool:
    """Whether TRL's greedy generation is ``model``'s: each generated token's logprob equals
    transformers' (teacher-forced on the served tokens)."""
    from _vllm_helpers import close, hf_prompt_logprobs

    out = client.generate(prompts, temperature=0.0, max_tokens=N_NEW, logprobs=0)
    got, want = [], []
    for prompt, gen, lps in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                strict=True):
        assert len(gen) == N_NEW
        got += [lp[0] for lp in lps]
        want += hf_prompt_logprobs(model, [prompt + gen])[len(prompt) - 1:]
    return close(got, want)


def test_trls_vllm_client_pushes_through_the_update_gate(tmp_path):
    client_cls = _vllm_client_cls()
    _need_two_gpus()
    import torch
    from _vllm_helpers import prompt_ids
    from transformers import AutoModelForCausalLM

    from weightsync.testing.servers import PolicyServerProcess, free_port
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    base = build_tiny_causal_lm(tmp_path / "base", seed=0)
    new = build_tiny_causal_lm(tmp_path / "new", seed=5)
    server = PolicyServerProcess(
        # dev mode off even if this machine sets it: the routes are served without it
        base, log_path=str(tmp_path / "policy.log"), env={**GPU1, "VLLM_SERVER_DEV_MODE": "0"},
        extra_args=["--dtype", "bfloat16", "--max-model-len", "256",
                    "--gpu-memory-utilization", "0.45", "--enforce-eager",
                    "--weight-transfer-config", '{"backend": "nccl"}'])
    server.start_healthy(timeout_s=300)
    client = None
    try:
        prompts = prompt_ids(base)
        client = client_cls(base_url=server.url, group_port=free_port(), connection_timeout=60)
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.bfloat16).cuda(0).eval()
        client.init_communicator(device=0)
        v = _version(server.url)
        assert not _matches(client, model, prompts)  # the server still serves the base

        client.update_model_params(model)  # one update of every parameter
        assert _version(server.url) == v + 1
        assert _matches(client, model, prompts)

        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():  # a trainer step
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.05)
        with client.weight_update():  # one update, a call per tensor
            for name, p in model.named_parameters():
                client.update_named_param(name, p.data)
        assert _version(server.url) == v + 2
        assert _matches(client, model, prompts)

        with torch.no_grad():
            model.model.norm.weight.mul_(1.5)
            model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        client.update_named_param("model.norm.weight", model.model.norm.weight.data)
        client.update_named_param("model.layers.0.mlp.down_proj.weight",
                                  model.model.layers[0].mlp.down_proj.weight.data)
        assert _version(server.url) == v + 4  # each call alone: its own update
        assert _matches(client, model, prompts)
    finally:
        if client is not None:
            client.close_communicator()
        server.stop()
