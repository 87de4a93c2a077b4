"""What ``launch`` decides without a cluster: the server's command line from
``reward_model.rollout`` and the pool forms it takes (the launch itself runs on a real Ray
cluster in tests/integration/reward_loop/test_launch_on_pool.py)."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.config import RewardLoopConfig
from weightsync.reward_loop.launch import pool_bundles, server_args


def _section(**rollout):
    return RewardLoopConfig.from_any({"reward_model": {
        "enable": True, "model": {"path": "/models/rm", "served_model_name": "rm"},
        "rollout": rollout}}).reward_model


def test_the_command_line_follows_the_rollout_section():
    section = _section(dtype="float32", max_model_len=256, enforce_eager=True,
                       gpu_memory_utilization=0.4, free_cache_engine=True,
                       server_args=["--kv-cache-memory-bytes", 1024])
    cpu = server_args(section, 1, on_gpu=False, api_key="k")
    assert cpu == ["--api-key", "k", "--served-model-name", "rm", "--dtype", "float32",
                   "--max-model-len", "256", "--enforce-eager",
                   "--kv-cache-memory-bytes", "1024"]
    gpu = server_args(section, 2, on_gpu=True, api_key="k")
    assert gpu[gpu.index("--tensor-parallel-size") + 1] == "2"
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.4"
    assert "--enable-sleep-mode" in gpu


def test_an_unknown_pool_is_named():
    pytest.importorskip("ray")
    with pytest.raises(TypeError, match="resource_pool: a verl RayResourcePool"):
        pool_bundles({"GPU": 8})
