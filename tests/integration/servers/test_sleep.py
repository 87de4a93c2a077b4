"""Sleep mode on a CPU reward server: vLLM has none there, so the routes answer 501 naming the
flag and the device, and the server keeps scoring; ``--enable-sleep-mode`` on CPU is refused
before any engine starts. (Sleeping, waking and a push while asleep: tests/gpu.)"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_sleep_routes_answer_501_on_cpu_and_scoring_goes_on(reward_server):
    auth = {"Authorization": f"Bearer {reward_server.api_key}"}
    for method, path, body in (("POST", "/sleep", {"level": 1}), ("POST", "/wake_up", {}),
                               ("GET", "/is_sleeping", None)):
        r = httpx.request(method, reward_server.url + path, json=body, headers=auth, timeout=30)
        assert r.status_code == 501, (path, r.text)
        assert "--enable-sleep-mode" in r.json()["detail"] and "cpu" in r.json()["detail"]
    r = httpx.post(reward_server.url + "/score", json={"input": ["still here"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    # the control plane's token guards sleep like every other control route
    assert httpx.post(reward_server.url + "/sleep", json={"level": 1},
                      timeout=30).status_code == 401


def test_enable_sleep_mode_on_cpu_is_refused_before_the_engine_starts():
    from weightsync.servers.reward import RewardServerConfig, engine_args

    with pytest.raises(ValueError, match="enable_sleep_mode: vLLM's sleep mode needs CUDA or ROCm; "
                                         "this server runs on cpu"):
        engine_args(RewardServerConfig(model="/x", device="cpu", enable_sleep_mode=True))
