"""`weightsync demo` end to end: real reward server (vLLM CPU) subprocess, real HTTP, real
strategies. Each run takes about a minute here, so they are marked slow.

Runs the demo as a subprocess (as a user would: ``python -m weightsync.demo``) so its signal
handlers, threads and exit code are the real ones.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def _run_demo(args: list[str], tmp_path, timeout: int = 300) -> tuple[int, str, dict]:
    out_json = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.demo", "--json", str(out_json),
         "--workdir", str(tmp_path / "work"), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    record = json.loads(out_json.read_text()) if out_json.exists() else {}
    return proc.returncode, output, record


def _server_pid(output: str, label: str = "reward server") -> int:
    m = re.search(label + r" starting \(pid (\d+)", output)
    assert m, output
    return int(m.group(1))


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """True when neither the process nor its process group exists any more."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _tensor_bytes(model_dir, names=None) -> int:
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    return sum(
        t.numel() * t.element_size() for n, t in tensors.items() if names is None or n in names
    )


def test_demo_head_only_gloo_broadcast(tmp_path):
    code, output, r = _run_demo(["--mode", "head_only"], tmp_path)
    assert code == 0, output
    assert r["strategy"] == "broadcast/gloo" and r["mode"] == "head_only"
    assert r["accuracy_after"] > r["accuracy_before"], r
    assert r["accuracy_after"] >= 0.9, r
    assert r["version_after"] == r["version_before"] + 1, r
    assert r["max_abs_err_vs_hf"] <= 1e-4, r
    assert r["max_abs_err_before"] <= 1e-4, r
    # only the head travelled: hidden 64 x 1 label x fp32, as stored in the checkpoint
    head_bytes = _tensor_bytes(tmp_path / "work" / "tiny-reward-model", {"score.weight"})
    assert head_bytes == 64 * 4
    assert r["bytes_synced"] == head_bytes and r["num_tensors_synced"] == 1, r
    assert r["sync_seconds"] > 0 and r["passed"] is True
    # progress lines while it ran and the summary table at the end
    assert "reward server healthy" in output and "PASS" in output
    assert _gone(_server_pid(output)), "reward server still running after the demo"


def test_demo_full_mode_through_shared_memory(tmp_path):
    code, output, r = _run_demo(["--strategy", "packed_cuda_ipc", "--mode", "full"], tmp_path)
    assert code == 0, output
    assert r["strategy"] == "packed_cuda_ipc" and r["mode"] == "full"
    assert r["accuracy_after"] > r["accuracy_before"], r
    assert r["version_after"] == r["version_before"] + 1, r
    assert r["max_abs_err_vs_hf"] <= 1e-4, r
    assert r["bytes_synced"] == _tensor_bytes(tmp_path / "work" / "tiny-reward-model"), r
    assert _gone(_server_pid(output))


def test_demo_sigterm_takes_the_servers_down(tmp_path):
    """SIGTERM to the (RLHF) demo mid-start-up: it exits non-zero and both servers' process
    groups are gone."""
    out_json = tmp_path / "demo.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.demo", "--json", str(out_json),
         "--workdir", str(tmp_path / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "policy server starting" in line:
                break
        pids = [_server_pid("".join(lines), label) for label in ("reward server", "policy server")]
        # on a machine with 2+ cores the two engines get cores of their own (cpu_core_slots)
        cores = re.findall(r"server starting \(.*worker cores ([0-9-]+)\)", "".join(lines))
        if len(os.sched_getaffinity(0)) >= 2 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            assert len(cores) == 2 and cores[0] != cores[1], "".join(lines)
        time.sleep(2.0)  # let them get into vLLM start-up
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "".join(lines) + rest
    for pid in pids:
        assert _gone(pid, wait_s=20), "a server survived SIGTERM to the demo"
    record = json.loads(out_json.read_text())
    assert record["passed"] is False and record["failures"], record


def test_demo_rlhf_reward_rises_and_both_versions_advance(tmp_path):
    """The main job as the README runs it (``weightsync demo``, no arguments, in a clean clone
    of the repository): the mean reward rises over the steps, the reward server's version rises
    once (the trained reward model), the policy server's once per step, the servers sample and
    score with exactly the pushed weights; the record and the PNG (or the note saying why not)
    land in ``results/``, which git ignores: the clone stays clean."""
    if not (ROOT / ".git").exists():
        pytest.skip("the repository is not a git checkout here: no clone to check")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    proc = subprocess.run([sys.executable, "-m", "weightsync.cli", "demo"], cwd=clone,
                          capture_output=True, text=True, timeout=900)
    code, output = proc.returncode, proc.stdout + proc.stderr
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", f"the demo left files in the clone:\n{status}"
    record = clone / "results" / "weightsync-demo.json"
    assert "wrote results/weightsync-demo.json" in output
    r = json.loads(record.read_text())
    plot = clone / "results" / "weightsync-demo.png"
    assert code == 0, output[-5000:]
    assert r["mode"] == "rlhf" and r["passed"] is True, r["failures"]
    steps = r["steps"]
    assert [s["step"] for s in steps] == list(range(10))
    for s in steps:
        assert {"step", "mean_reward", "sync_seconds", "policy_version", "rm_version"} <= set(s)
        assert s["sync_seconds"] > 0 and s["logprob_gap"] <= 1e-3
    rewards = [s["mean_reward"] for s in steps]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.5, rewards
    judge = [s["judge_score"] for s in steps]
    assert sum(judge[-2:]) > sum(judge[:2]), judge  # the hidden rule agrees: a real gain
    assert [s["policy_version"] for s in steps] == list(range(1, 11))
    assert [s["sampled_version"] for s in steps] == list(range(10))
    assert r["rm_version_after"] == r["rm_version_before"] + 1
    assert all(s["rm_version"] == r["rm_version_after"] for s in steps)
    assert r["rm_max_abs_err_vs_hf"] <= 1e-4 and r["rm_served_accuracy"] > 0.7
    if r["plot_path"]:
        assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib" in r["plot_note"]
    assert "step [####################] 10/10" in output and "PASS" in output
    for label in ("reward server", "policy server"):
        assert _gone(_server_pid(output, label)), f"{label} still running after the demo"
