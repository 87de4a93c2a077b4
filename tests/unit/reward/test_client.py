"""``VLLMRewardClient`` without a server: the reward plan's arguments and defaults, the
protocols it satisfies, and what it refuses before any request."""

from __future__ import annotations

import time

import pytest

from weightsync.errors import WeightSyncError
from weightsync.policy.types import ChatClient, ChatCompletionRequest
from weightsync.reward.client import RewardModelClient, VLLMRewardClient

torch = pytest.importorskip("torch")


def test_the_plans_arguments_order_and_defaults():
    c = VLLMRewardClient()
    # the plan's/spec's defaults: device 0 (the CPU on a machine without CUDA), model_name
    # "reward-model", connection and /score timeouts 60 s; ours: host and group_port
    assert (c.host, c.port, c.group_port, c.enable_weight_updates, c.connection_timeout_s,
            c.model_name, c.request_timeout_s) == (
        "127.0.0.1", 8001, None, False, 60.0, "reward-model", 60.0)
    assert c.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert c.server_url == "http://127.0.0.1:8001"
    assert (VLLMRewardClient.DEFAULT_PORT, VLLMRewardClient.DEFAULT_GROUP_PORT) == (8001, 51217)
    # the plan's positional order: host, port, group_port, enable_weight_updates, device
    p = VLLMRewardClient("10.0.0.7", 9001, 51217, False, "cuda:1")
    assert (p.host, p.port, p.group_port, p.enable_weight_updates, p.device) == (
        "10.0.0.7", 9001, 51217, False, "cuda:1")
    assert p.strategy_cfg == {"type": "broadcast", "backend": "nccl", "master_port": 51217}


def test_strategy_config_follows_device_and_strategy():
    cpu = VLLMRewardClient(device="cpu", group_port=51217).strategy_cfg
    assert cpu == {"type": "broadcast", "backend": "gloo", "master_port": 51217,
                   "master_addr": "127.0.0.1"}
    assert VLLMRewardClient(device=None).strategy_cfg is None  # follows the first sync's tensors
    assert VLLMRewardClient(strategy="cuda_ipc", bucket_size_mb=8).strategy_cfg == {
        "type": "cuda_ipc", "bucket_size_mb": 8}
    assert VLLMRewardClient(strategy="broadcast_gloo").strategy_cfg["backend"] == "gloo"
    assert VLLMRewardClient(strategy={"strategy": {"type": "packed_cuda_ipc"}}).strategy_cfg == {
        "type": "packed_cuda_ipc"}


def test_it_is_a_reward_client_and_a_chat_client():
    c = VLLMRewardClient()
    assert isinstance(c, RewardModelClient) and isinstance(c, ChatClient)
    with pytest.raises(NotImplementedError, match="cannot generate"):
        import asyncio

        asyncio.run(c.complete(ChatCompletionRequest(prompt="hi")))


def test_scoring_only_client_refuses_a_sync():
    with pytest.raises(WeightSyncError, match="enable_weight_updates=True"):
        VLLMRewardClient().sync_weights({"score.weight": torch.ones(1, 4)})


def test_weight_updates_connect_in_the_constructor():
    """As the reference's client: with weight updates on, the constructor waits for the server
    and builds the group; nothing listens on port 9, so it fails there, not at the first sync."""
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="not reachable within 1s"):
        VLLMRewardClient(port=9, enable_weight_updates=True, connection_timeout_s=1.0)
    assert time.monotonic() - t0 < 30


def test_a_tokenizer_is_checked_in_the_constructor():
    """The plan: the tokenizer is validated at client init (fail fast), so a scoring-only
    client given one contacts the server in its constructor; nothing listens on port 9."""
    with pytest.raises(WeightSyncError, match="not reachable within 1s"):
        VLLMRewardClient(port=9, tokenizer="unused: never loaded", connection_timeout_s=1.0)
    VLLMRewardClient(port=9).close_sync()  # without a tokenizer: no contact yet


def test_the_reference_options_are_checked_in_the_constructor():
    c = VLLMRewardClient(port=9, unmerged_lora="skip", head_only_extra="drop")
    assert (c.unmerged_lora, c.head_only_extra, c.max_retries) == ("skip", "drop", 3)
    d = VLLMRewardClient()
    assert (d.unmerged_lora, d.head_only_extra) == ("refuse", "send")  # ours, the reference's
    with pytest.raises(ValueError, match="unmerged_lora must be one of"):
        VLLMRewardClient(unmerged_lora="drop")
