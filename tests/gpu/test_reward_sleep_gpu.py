"""Colocate mode on GPU: the reward server (``--enable-sleep-mode``, GPU 1) sleeps at level 1
and at level 2, frees its GPU memory, takes a push from a trainer on GPU 0 while asleep, and
then scores what transformers computes for the new weights; a request wakes it. Measured: the
seconds a sleep and a wake take and the GiB freed (the device's free memory seen from this
process). Records go to ``$WEIGHTSYNC_GPU_OUT/reward_sleep_level<N>.json`` when that variable
is set; the numbers are printed either way."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(560)]

API_KEY = "gpu-test-token"
GPU1 = {"CUDA_VISIBLE_DEVICES": "1"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _free_gib(device: int) -> float:
    import torch

    return torch.cuda.mem_get_info(device)[0] / 2**30


def _scores(url: str) -> list[float]:
    from _vllm_helpers import TEXTS

    r = httpx.post(url + "/score", json={"input": TEXTS, "normalize": False}, timeout=120)
    r.raise_for_status()
    return [d["score"] for d in r.json()["data"]]


def _push(url: str, model) -> object:
    from _vllm_helpers import push_broadcast

    return push_broadcast(url, model, API_KEY)


@pytest.mark.parametrize("level", [1, 2])
def test_reward_server_sleeps_takes_a_push_asleep_and_wakes_to_score(tmp_path, level):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the trainer's NCCL rank and the server's)")
    from _vllm_helpers import close_scores, hf_scores
    from transformers import AutoModelForSequenceClassification

    from weightsync.testing.servers import RewardServerProcess
    from weightsync.testing.tiny_models import build_tiny_reward_model

    base = build_tiny_reward_model(tmp_path / "base", seed=0, head_std=1.0)
    new = build_tiny_reward_model(tmp_path / "new", seed=5, head_std=1.0)
    server = RewardServerProcess(
        base, log_path=str(tmp_path / "reward.log"), env=GPU1,
        extra_args=["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "256",
                    "--gpu-memory-utilization", "0.3", "--enforce-eager",
                    "--enable-sleep-mode"],
    ).start_healthy()
    record: dict = {"level": level, "device": torch.cuda.get_device_name(1)}
    try:
        url = server.url
        assert close_scores(_scores(url), hf_scores(base))
        torch.cuda.synchronize(1)
        awake_free = _free_gib(1)
        r = httpx.post(url + "/sleep", json={"level": level}, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        record["sleep_s"] = r.json()["sleep_s"]
        record["freed_gib"] = _free_gib(1) - awake_free
        state = httpx.get(url + "/is_sleeping", timeout=30).json()
        assert state["is_sleeping"] and state["level"] == level
        assert record["freed_gib"] > 1.0, record  # the KV cache of 30 % of a GPU, at least

        # a push while asleep lands (the weights are woken for it, the KV cache stays freed)
        torch.cuda.set_device(0)
        model = AutoModelForSequenceClassification.from_pretrained(
            new, dtype=torch.bfloat16).cuda(0)
        t0 = time.perf_counter()
        stats = _push(url, model)
        record["push_asleep_s"] = time.perf_counter() - t0
        assert stats.versions == [1]
        state = httpx.get(url + "/is_sleeping", timeout=30).json()
        assert not state["weights_asleep"] and state["kv_cache_asleep"]
        assert state["weights_valid"]

        # the next request wakes the KV cache and scores with the pushed weights
        t0 = time.perf_counter()
        assert close_scores(_scores(url), hf_scores(new))
        record["first_score_after_push_s"] = time.perf_counter() - t0
        assert not httpx.get(url + "/is_sleeping", timeout=30).json()["is_sleeping"]

        # a full cycle: sleep, an explicit wake, then a score
        assert httpx.post(url + "/sleep", json={"level": level}, headers=AUTH,
                          timeout=300).status_code == 200
        woke = httpx.post(url + "/wake_up", json={}, headers=AUTH, timeout=300)
        assert woke.status_code == 200, woke.text
        record["wake_s"] = woke.json()["wake_s"]
        if level == 1:  # the weights came back from host memory
            assert close_scores(_scores(url), hf_scores(new))
        else:  # level 2 dropped them: scoring is refused until a full push lands
            refused = httpx.post(url + "/score", json={"input": ["x"]}, timeout=60)
            assert refused.status_code == 409 and "level-2 sleep" in refused.json()["detail"]
            assert _push(url, model).versions == [2]
            assert close_scores(_scores(url), hf_scores(new))
    finally:
        server.stop()
    print("reward_sleep", json.dumps(record))
    out = os.environ.get("WEIGHTSYNC_GPU_OUT")
    if out:
        with open(os.path.join(out, f"reward_sleep_level{level}.json"), "w") as f:
            json.dump(record, f, indent=2)
