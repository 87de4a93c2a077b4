"""``examples/reward_model/``: each script runs as written, in short mode, against the session's
shared reward / policy servers (``--reward-url`` / ``--policy-url``), and its ``REPORT`` holds
what the example claims: versions rise by one per sync, served scores equal the trainer's
forward, training helped. Each test puts the base weights back afterwards (``restore()``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "reward_model"


def run_example(script: str, *args: str, timeout: float = 600) -> dict:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--short", *args],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, f"{script} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("REPORT "), out.stdout[-2000:]
    return json.loads(last[len("REPORT "):])


def reward_args(server) -> list[str]:
    return ["--reward-url", server.url, "--reward-model", server.model_dir,
            "--api-key", server.api_key]


@pytest.fixture
def restored_reward(reward_server):
    reward_server.restore()
    yield reward_server
    reward_server.restore()


def check_rounds(report: dict, mode: str) -> list[dict]:
    rounds = report["rounds"]
    assert report["mode"] == mode and len(rounds) == 2
    assert rounds[1]["version"] == rounds[0]["version"] + 1
    for r in rounds:
        assert r["max_abs_err_vs_hf"] <= 1e-4, r
    return rounds


def test_train_rm_head_only(restored_reward):
    report = run_example("train_rm_head_only.py", *reward_args(restored_reward))
    rounds = check_rounds(report, "head_only")
    assert all(r["bytes"] == 64 * 4 and r["tensors"] == 1 for r in rounds)  # the head only
    assert rounds[-1]["served_accuracy"] > report["accuracy_before"]
    assert rounds[-1]["served_accuracy"] >= 0.9


def test_train_rm_lora(restored_reward):
    report = run_example("train_rm_lora.py", *reward_args(restored_reward))
    rounds = check_rounds(report, "lora")
    assert report["trainable"] > 0 and report["lora_tensors_still_in_model"] > 0
    assert all(r["tensors"] == 27 for r in rounds)  # merged: the base model's tensors
    assert rounds[-1]["served_accuracy"] > report["accuracy_before"]


def test_train_rm_full(restored_reward):
    report = run_example("train_rm_full.py", *reward_args(restored_reward))
    rounds = check_rounds(report, "full")
    assert all(r["tensors"] == 27 for r in rounds)
    assert rounds[-1]["served_accuracy"] > report["accuracy_before"]


def test_cold_start_rlhf(restored_reward, policy_server):
    policy_server.restore()
    try:
        report = run_example(
            "cold_start_rlhf.py", *reward_args(restored_reward),
            "--policy-url", policy_server.url, "--policy-model", policy_server.model_dir)
    finally:
        policy_server.restore()
    assert report["rm_version_after"] == report["rm_version_before"] + 1
    steps = report["steps"]
    assert len(steps) == 3
    first = steps[0]["policy_version"]
    assert [s["policy_version"] for s in steps] == [first, first + 1, first + 2]
    assert [s["sampled_version"] for s in steps] == [first - 1, first, first + 1]
    assert all(s["rm_version"] == report["rm_version_after"] for s in steps)
    assert all(s["logprob_gap"] <= 1e-3 for s in steps)  # sampled with the pushed weights
