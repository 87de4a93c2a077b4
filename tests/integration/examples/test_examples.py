"""Every example in ``examples/`` that shows the front door runs as written (short mode), and
the README's sync example is, character for character, ``examples/push_to_server.py``, which
runs against a real policy server started for it on a free port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


def _run(script: str, *args: str, env: dict | None = None, timeout: float = 240) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, f"{script} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_readme_sync_example_is_the_example_file():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert (EXAMPLES / "push_to_server.py").read_text() in blocks


def test_write_your_own_example():
    """docs/architecture.md's recipes: a registered extractor, loader and strategy of one's own
    carry two updates."""
    out = _run("write_your_own.py")
    assert out.count("weights equal: True") == 2 and "version 2" in out


def test_push_in_process_example():
    out = _run("push_in_process.py", "--steps", "2")
    assert "step 2:" in out and out.count("weights equal: True") == 2


@pytest.mark.slow
def test_push_to_local_processes_example():
    out = _run("push_to_local_processes.py", "--steps", "1")
    assert "versions {'engine0': 1, 'engine1': 1}; weights equal: [True, True]" in out


@pytest.mark.slow
def test_push_to_ray_actors_example():
    out = _run("push_to_ray_actors.py", "--steps", "1")
    assert "versions [1, 1]; weights equal: [True, True]" in out


@pytest.mark.slow
def test_readme_example_runs_again_and_again_against_one_server(policy_server):
    """The session's policy server, at whatever version earlier tests left it: the README's
    loop goes on from the served version, twice in a row; afterwards the server serves the last
    pushed version and its completions say so. (That its step changes greedy answers is
    ``tests/integration/docs/test_docs_quickstart.py``'s check, on the quickstart's model.)"""
    env = {"WEIGHTSYNC_URL": policy_server.url, "WEIGHTSYNC_API_KEY": policy_server.api_key,
           "WEIGHTSYNC_MODEL": policy_server.model_dir}
    try:
        for run in range(2):
            v0 = policy_server.version()
            out = _run("push_to_server.py", env=env)
            assert [f"step {v0 + i}:" in out for i in (1, 2, 3)] == [True] * 3, (run, out)
            assert f"the server now serves version {v0 + 3}" in out
            assert policy_server.version() == v0 + 3
        r = httpx.post(policy_server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-policy", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-weight-version"] == str(v0 + 3)
    finally:
        policy_server.restore()  # the base weights back for the tests after this one

