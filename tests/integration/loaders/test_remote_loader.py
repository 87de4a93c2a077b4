"""``remote`` loader against a real server: a relay endpoint in this process forwards a trainer's
push to the shared policy server (vLLM on CPU, fp32) over its HTTP control plane.

The trainer pushes into the relay over ``cuda_ipc`` (shared memory: the relay's receive buffers
are reused, so the relay forwards copies); the relay's ``RemoteWeightLoader`` pushes on through
its own ``ws.connect`` session over the gloo ``broadcast`` strategy. Checked: after the push the
server serves exactly what transformers computes for the pushed weights (prompt logprobs within
fp32 tolerance, same greedy tokens) under the pushed version; a push the server refuses (a
tensor of the wrong shape) fails the trainer's push naming the tensor and the server still
serves the previous weights.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from _policy_ref import PROMPTS, Reference, check_against

import weightsync as ws
from weightsync.errors import WeightMismatchError
from weightsync.loaders.remote import RemoteLoaderConfig, RemoteWeightLoader

pytestmark = pytest.mark.slow

LOCAL = {"type": "cuda_ipc", "bucket_size_mb": 0.05}


def test_relay_into_the_policy_server_serves_the_pushed_weights(policy_server) -> None:
    ref = Reference(policy_server.model_dir)
    loader = RemoteWeightLoader(RemoteLoaderConfig(
        url=policy_server.url, api_key=policy_server.api_key, timeout_s=120,
        strategy={"type": "broadcast", "backend": "gloo", "timeout_s": 60}))
    relay = ws.WeightUpdateEndpoint(loader, name="relay")
    version = policy_server.version() + 1
    trained = ref.perturb(seed=11)

    async def run():
        async with ws.connect([relay], LOCAL) as sync:
            stats = await sync.push(trained, version=version)
            assert stats.versions == [version] and stats.num_chunks >= 3
            assert loader.last_stats.versions == [version]
            assert loader.last_stats.num_chunks == stats.num_chunks
            bad = dict(trained)
            bad["model.norm.weight"] = torch.zeros(3)
            with pytest.raises(WeightMismatchError, match=r"model\.norm\.weight"):
                await sync.push(bad, version=version + 1)
        await loader.aclose()

    try:
        asyncio.run(run())
        assert policy_server.version() == version
        for prompt in PROMPTS:  # logprobs within fp32 tolerance, greedy tokens, the version
            assert check_against(policy_server, ref, prompt) == version
    finally:
        policy_server.restore()
