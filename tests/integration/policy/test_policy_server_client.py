"""``VLLMChatClient`` (the reference's client, on the front door) and the example that uses it,
against the shared policy server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from _policy_ref import PROMPTS, TOL, Reference, max_diff

from weightsync.errors import WeightMismatchError, WeightSyncError
from weightsync.testing.servers import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_chat_client_completes_and_syncs(policy_server):
    import torch

    from weightsync.policy import ChatCompletionRequest, VLLMChatClient

    server = policy_server
    server.restore()
    ref = Reference(server.model_dir)
    client = VLLMChatClient("127.0.0.1", server.port, group_port=free_port(),
                            enable_weight_updates=True, device="cpu", api_key=server.api_key)
    try:
        async def ask(prompt):
            chat = await client.complete(ChatCompletionRequest(
                messages=[{"role": "user", "content": "hello"}], sampling={"max_tokens": 3}))
            text = await client.complete(ChatCompletionRequest(
                prompt=prompt, sampling={"max_tokens": 4, "temperature": 0},
                return_token_ids=True, logprobs=0, extra_body={"ignore_eos": True}))
            return chat, text, await client.get_policy_version()

        v0 = server.version()
        (chat, _), (text, info), version = asyncio.run(ask(PROMPTS[0]))
        assert chat.weight_version == v0 == version and chat.finish_reason is not None
        assert text.completion_token_ids == ref.greedy(text.prompt_token_ids, 4)
        assert info["used_args"]["logprobs"] == 0 and info["weight_version"] == v0

        ref.perturb(seed=21)
        assert client.sync_weights(ref.model.state_dict(), version=v0 + 3) == str(v0 + 3)
        assert client.last_sync_stats.versions == [v0 + 3]
        (_, _), (text, _), version = asyncio.run(ask(PROMPTS[1]))
        ids = text.prompt_token_ids
        assert version == v0 + 3 and text.weight_version == v0 + 3
        assert text.completion_token_ids == ref.greedy(ids, 4)
        gen = text.completion_token_ids
        assert max_diff(text.completion_logprobs, ref.logprobs(ids + gen)[len(ids) - 1:]) <= TOL

        with pytest.raises(WeightMismatchError, match="model.norm.weight"):
            client.sync_weights({"model.norm.weight": torch.zeros(3)})
        assert server.version() == v0 + 3
    finally:
        client.close_communicator()

    reader = VLLMChatClient("127.0.0.1", server.port)  # inference only
    with pytest.raises(WeightSyncError, match="enable_weight_updates=True"):
        reader.sync_weights({"model.norm.weight": torch.zeros(64)})
    with pytest.raises(ValueError, match="exactly one of messages"):
        ChatCompletionRequest(prompt="x", messages=[])
    server.restore()


def test_example_pushes_to_the_policy_server(policy_server):
    server = policy_server
    v0 = server.version()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "push_to_policy_server.py"),
         "--url", server.url, "--model-dir", server.model_dir, "--api-key", server.api_key],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("[ok]") == 3 and "FAIL" not in proc.stdout
    assert server.version() == v0 + 1
    server.restore()
