"""``examples/reward_loop/grpo_step.py`` against the session's servers: verl's reward loop (two
Ray workers, verl's GSM8K rule weighted 1.0 plus the reward server's score weighted 0.5), GRPO
advantages per question, one policy-gradient step and its push."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]


def test_grpo_step_combines_rule_and_model(reward_server, policy_server):
    reward_server.restore()
    policy_server.restore()
    v0 = policy_server.version()
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples/reward_loop/grpo_step.py"),
             "--reward-url", reward_server.url, "--reward-model", reward_server.model_dir,
             "--policy-url", policy_server.url, "--policy-model", policy_server.model_dir,
             "--api-key", policy_server.api_key],
            capture_output=True, text=True, timeout=540, cwd=ROOT, env=dict(os.environ))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        policy_server.restore()
    report = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("REPORT "))
    for right in report["right_answers"]:  # the rule fires on a right answer
        info = right["reward_extra_info"]
        assert info["function_score"] == 1.0
        assert right["reward_score"] == pytest.approx(1.0 + 0.5 * info["rm_score"])
    (step,) = report["steps"]
    rows = step["rows"]
    assert len(rows) == 16
    for r in rows:
        assert r["reward"] == pytest.approx(1.0 * r["rule"] + 0.5 * r["rm"])
    for g in range(4):  # GRPO: advantages of each question's group have mean 0
        group = rows[4 * g:4 * g + 4]
        assert abs(sum(r["advantage"] for r in group)) < 1e-6
    assert step["sampled_version"] == v0 and step["policy_version"] == v0 + 1
    assert "policy server now at version" in out.stdout
