"""``docs/quickstart.md`` followed literally on CPU: each ``bash`` block runs as written (terminal
1's exports carry over from block to block, the block marked ``server`` runs in the background
as terminal 2), in a scratch folder where ``examples/`` is the repository's, with the ports 8000
and 8001 replaced by free ones (the only change). Every output the page shows must come out in
that shape (numbers and quoted strings may differ; a bench run's winner too). It ends with a
chat answer that changed after the push and an ``x-weight-version`` equal to the pushed version.

Sharing the quickstart's server (one vLLM start for all of it): the script run a second time
goes on from the served version; a bf16 push is refused with the one line the page shows and
the server keeps its weights; Ctrl-C (SIGINT to the server's process group, as a terminal sends
it) stops it without a leaked-shared-memory warning or a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from _markdown import assert_shape, blocks, wait_for_line, with_ports

from weightsync.testing.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "quickstart.md"


def _steps(text: str, ports: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """(bash block, the text block after it or None, its marker), ports replaced."""
    out = []
    found = blocks(text)
    for i, b in enumerate(found):
        if b.lang != "bash" or (b.marker or "").startswith("gpu"):
            continue  # the GPU section: tests/gpu/test_docs_quickstart_gpu.py
        after = found[i + 1] if i + 1 < len(found) and found[i + 1].lang == "text" else None
        out.append((with_ports(b.body, ports), with_ports(after.body, ports) if after else None,
                    b.marker))
    return out


def _exports(block: str) -> list[str]:
    return [ln for ln in block.splitlines() if ln.startswith("export ")]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """Runs the page; yields what the test below checks. The server is stopped at the end of
    the module (or here, if a step fails)."""
    work = tmp_path_factory.mktemp("quickstart")
    (work / "examples").symlink_to(ROOT / "examples")
    ports = {"8000": str(free_port()), "8001": str(free_port())}
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    steps = _steps(PAGE.read_text(), ports)
    assert [m for _, _, m in steps].count("server") == 1
    exports: list[str] = []
    outputs: list[tuple[str, str]] = []
    server = log = None
    try:
        for block, expected, marker in steps:
            if marker == "server":
                log = open(work / "server.log", "w+")  # noqa: SIM115 - closed below
                server = subprocess.Popen(["bash", "-c", block], cwd=work, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
                ready = wait_for_line(work / "server.log", "weightsync policy server ready",
                                       server, timeout_s=300)
                if expected:
                    assert_shape(expected, ready)
                continue
            script = "\n".join([*exports, block])
            out = subprocess.run(["bash", "-c", script], cwd=work, env=env, text=True,
                                 capture_output=True, timeout=300)
            text = out.stdout + out.stderr
            assert out.returncode == 0, f"{block}\n{text[-3000:]}"
            if expected:
                assert_shape(expected, text)
            outputs.append((block, text))
            exports += _exports(block)
        yield {"work": work, "env": env, "outputs": outputs, "ports": ports, "url": f"http://127.0.0.1:"
               f"{ports['8000']}", "server": server, "log": work / "server.log"}
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        if log is not None:
            log.close()


def _chats(outputs: list[tuple[str, str]]) -> list[tuple[int, str]]:
    found = []
    for block, text in outputs:
        if block.strip().endswith("python examples/chat.py"):
            m = re.search(r"^weight version (\d+): (.*)$", text, flags=re.M)
            assert m, text
            found.append((int(m.group(1)), m.group(2)))
    return found


def test_the_answer_changes_with_the_pushed_version(quickstart):
    chats = _chats(quickstart["outputs"])
    assert [v for v, _ in chats] == [0, 3]
    assert chats[0][1] != chats[1][1], chats  # greedy: other weights, another answer
    pushes = [t for b, t in quickstart["outputs"] if b.strip() == "python examples/push_to_server.py"]
    assert len(pushes) == 2  # the script twice in a row against one server: both exit 0
    assert "the server now serves version 3" in pushes[0]
    assert "step 4:" in pushes[1] and "the server now serves version 6" in pushes[1]
    # the header the page talks about, straight from the server
    r = httpx.post(quickstart["url"] + "/v1/chat/completions", timeout=60, json={
        "model": "models/tiny-policy", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello! Who are you?"}]})
    assert r.status_code == 200 and r.headers["x-weight-version"] == "6"
    assert r.json()["weight_version"] == 6


def test_a_bf16_push_is_refused_in_the_line_the_page_shows(quickstart):
    import torch
    from safetensors.torch import load_file

    import weightsync as ws

    weights = load_file(str(quickstart["work"] / "models/tiny-policy/model.safetensors"))
    bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    with ws.connect_sync([quickstart["url"]], strategy="broadcast", api_key="my-token") as sync:
        with pytest.raises(ws.WeightMismatchError) as ei:
            sync.push(bf16, version=7)
        shown = next(b for b in PAGE.read_text().split("\n\n")
                     if b.lstrip().startswith("WeightMismatchError:"))
        want = [ln.strip() for ln in with_ports(shown, quickstart["ports"]).splitlines()]
        got = [ln.strip() for ln in f"WeightMismatchError: {ei.value}".splitlines()]
        assert got == want
        assert httpx.get(quickstart["url"] + "/runtime_version").json()["version"] == 6
        stats = sync.push(weights, version=7, dtype="float32")  # the fix the message names
        assert stats.versions == [7]


def test_ctrl_c_stops_the_server_cleanly(quickstart):
    server = quickstart["server"]
    os.killpg(server.pid, signal.SIGINT)  # what Ctrl-C in terminal 2 sends
    assert server.wait(timeout=60) is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the engine's processes leave too
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the server's processes outlived it")
    log = quickstart["log"].read_text(errors="replace")
    after = log[log.index("weightsync policy server ready"):]
    assert "leaked" not in after and "resource_tracker" not in after, after[-3000:]
    assert "Traceback" not in after and "EngineDeadError" not in after, after[-3000:]
