"""``docs/quickstart.md``'s GPU section followed as a user on one GPU follows it: in the
environment this test runs in (``scripts/gpu_first_hour.sh`` runs it with ``env -i`` in a fresh
environment holding only the GPU extra's wheels, so nothing a test harness sets reaches the
commands), with the ``weightsync`` command on ``PATH``. The install block is the one step not run
here: that machine reaches no registry, so the script installs the same wheels from a staged
copy. Then: ``weightsync demo --device cuda`` prints PASS; both servers start side by side on
the GPU through the command line, print the ready lines the page shows, answer a score and a
completion, stop on Ctrl-C, and hand the card's memory back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from weightsync.testing.servers import CALLER_ONLY_ENV, free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"


def _gpu_steps() -> list[tuple[str, str | None, str]]:
    from _markdown import blocks  # tests/integration/docs: on the path the stage gives

    found = blocks(PAGE.read_text())
    steps = []
    for i, b in enumerate(found):
        if b.lang == "bash" and (b.marker or "").startswith("gpu"):
            after = found[i + 1] if i + 1 < len(found) and found[i + 1].lang == "text" else None
            steps.append((b.body, after.body if after else None, b.marker))
    return steps


def _free_gib() -> float:
    from weightsync._runtime.gpu import gpu_memory

    memory = gpu_memory()
    assert memory is not None, "NVML cannot read the GPU's memory"
    return memory.free / float(1 << 30)


def test_quickstart_gpu_section(tmp_path):
    import httpx
    from _markdown import assert_shape, blocks, wait_for_line, with_ports

    from weightsync._runtime.gpu import cuda_device_count

    if cuda_device_count() < 1:
        pytest.skip("needs a GPU")
    weightsync = shutil.which("weightsync")
    assert weightsync, "the weightsync command is not on PATH (install weightsync first)"
    assert not set(CALLER_ONLY_ENV) & set(os.environ), "run it in a user's environment"
    steps = _gpu_steps()
    assert [m for _, _, m in steps] == ["gpu-install", "gpu", "gpu-server", "gpu-server"]
    ports = {"8000": str(free_port()), "8001": str(free_port())}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # this test's helpers
    free_before = _free_gib()
    # step 1 of the page: the policy model the servers block serves
    first = next(b for b in blocks(PAGE.read_text()) if b.lang == "bash")
    subprocess.run(["bash", "-c", first.body], cwd=tmp_path, env=env, check=True, timeout=120)
    servers: list[subprocess.Popen] = []
    try:
        for block, expected, marker in steps[1:]:
            block = with_ports(block, ports)
            if marker == "gpu":
                out = subprocess.run(["bash", "-c", block], cwd=tmp_path, env=env, text=True,
                                     capture_output=True, timeout=600)
                text = out.stdout + out.stderr
                assert out.returncode == 0, f"{block}\n{text[-4000:]}"
                assert expected and "PASS" in expected
                assert_shape(expected, text)
                continue
            log = tmp_path / f"server-{len(servers)}.log"
            with open(log, "w") as f:
                servers.append(subprocess.Popen(["bash", "-c", block], cwd=tmp_path, env=env,
                                                stdout=f, stderr=subprocess.STDOUT,
                                                start_new_session=True))
            what = "reward" if "serve-reward" in block else "policy"
            ready = wait_for_line(log, f"weightsync {what} server ready", servers[-1], 300)
            assert expected
            assert_shape(with_ports(expected, ports), ready)
        reward, policy = (f"http://127.0.0.1:{ports[p]}" for p in ("8001", "8000"))
        scored = httpx.post(reward + "/score", json={"input": ["a tiny test"]}, timeout=60)
        assert scored.status_code == 200, scored.text
        assert scored.headers["x-weight-version"] == "0"
        done = httpx.post(policy + "/v1/completions", timeout=60, json={
            "model": "models/tiny-policy", "prompt": "Hello", "max_tokens": 4,
            "temperature": 0})
        assert done.status_code == 200 and done.headers["x-weight-version"] == "0", done.text
    finally:
        for proc in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in each terminal
        for proc in servers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
    deadline = time.monotonic() + 30
    while _free_gib() < free_before - 1.0 and time.monotonic() < deadline:
        time.sleep(1)
    assert _free_gib() >= free_before - 1.0, "the servers left GPU memory held"
