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
def test_readme_example_pushes_into_a_real_policy_server(tiny_policy_model_dir, tmp_path):
    """A policy server of its own (versions start at 0, as in a fresh deployment): the README's
    loop pushes steps 1..3; afterwards the server serves version 3 and its completions say so."""
    from conftest import start_policy_server, stop_server

    server = start_policy_server(tiny_policy_model_dir, str(tmp_path / "server.log"))
    try:
        out = _run("push_to_server.py", env={
            "WEIGHTSYNC_URL": server.url, "WEIGHTSYNC_API_KEY": server.api_key,
            "WEIGHTSYNC_MODEL": tiny_policy_model_dir,
        })
        assert [f"step {i}:" in out for i in (1, 2, 3)] == [True] * 3
        assert "the server now serves version 3" in out
        assert httpx.get(server.url + "/runtime_version").json()["version"] == 3
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-policy", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-weight-version"] == "3"
    finally:
        stop_server(server)
