"""Shared integration fixtures: ONE real reward server and ONE real policy server per test
session (vLLM CPU, ~25 s and ~2.4 GB each; each starts when a test first asks for it).

``reward_server`` starts ``python -m weightsync.servers.reward`` on a tiny 1-label Qwen2 reward
model on 127.0.0.1 (a free port, an API key) and yields a ``RewardServerHandle``:

* ``url``, ``port``, ``api_key``, ``model_dir`` (the base weights), ``proc``;
* ``client(**kw)``: a ``VLLMRewardClient`` for it (close it, or use ``async with``);
* ``restore()``: sync the base weights back (FULL) and return the new version.

Rules for tests that share it: weights may have been changed by earlier tests (call
``restore()`` before comparing against the base model); versions only rise, so compare relative
to what you read; close your clients (a new client's ``init_communicator`` takes the server's
receivers from an older one, which then re-joins on its next sync).

``policy_server`` starts ``python -m weightsync.servers.policy`` (vLLM's OpenAI server plus our
control plane) on a tiny tied-embedding Llama causal LM, fp32, with a chat template, on a free
port with an API key, and yields a ``PolicyServerHandle``: ``url``, ``port``, ``api_key``,
``model_dir``, ``headers`` (the token), ``push(weights, version=None)`` (our dialect: a
strategy sender + ``FanOutClient`` over the URL), ``restore()`` (push the base weights back). The
same sharing rules hold.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

API_KEY = "test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RewardServerHandle:
    url: str
    port: int
    api_key: str
    model_dir: str
    proc: subprocess.Popen | None  # None: a server started outside the tests (see below)
    log_path: str
    _clients: list[Any] = field(default_factory=list)

    def client(self, **kwargs: Any) -> Any:
        from weightsync.reward import VLLMRewardClient

        kwargs.setdefault("api_key", self.api_key)
        kwargs.setdefault("connection_timeout_s", 30.0)
        kwargs.setdefault("enable_weight_updates", True)  # the tests push weights
        return VLLMRewardClient(port=self.port, **kwargs)

    def restore(self) -> int:
        """Sync the base weights back into the server (FULL); returns the new version."""
        from safetensors.torch import load_file

        weights = load_file(os.path.join(self.model_dir, "model.safetensors"))

        client = self.client()
        try:
            return int(client.sync_weights(weights))
        finally:
            client.close_sync()

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def start_server(
    module: str, model_dir: str, log_path: str, *, api_key: str | None, args: list[str],
    timeout_s: float = 180.0,
) -> tuple[subprocess.Popen, int]:
    """Start ``python -m module --model DIR --port P ...`` and wait until /health answers 200
    (or fail with its log)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", module, "--model", model_dir, "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{module} exited ({proc.returncode}):\n{_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"{module} not up in {timeout_s:g}s:\n{_tail(log_path)}")
        time.sleep(0.5)


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def start_reward_server(
    model_dir: str, log_path: str, *, api_key: str | None = API_KEY, extra: list[str] | None = None,
    timeout_s: float = 180.0,
) -> RewardServerHandle:
    """Start a reward server subprocess and wait until /health answers (or fail with its log)."""
    proc, port = start_server(
        "weightsync.servers.reward", model_dir, log_path, api_key=api_key, timeout_s=timeout_s,
        args=["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
              "--log-level", "warning", *(extra or [])],
    )
    return RewardServerHandle(f"http://127.0.0.1:{port}", port, api_key or "", model_dir,
                              proc, log_path)


def stop_reward_server(handle: Any) -> None:
    """SIGTERM the server's process group (it shuts vLLM down), SIGKILL if it lingers."""
    if handle.proc is not None:
        _stop(handle.proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the group; let its last members (vLLM's engine core, Python's resource tracker,
    which unlinks the engine's /dev/shm segments once the others are gone) leave by themselves;
    SIGKILL only what is still there after the grace (a SIGKILL before the tracker ran leaks
    the segments)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone left in the group?
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.2)
    try:  # the engine core / worker children share the process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from weightsync.testing.tiny_models import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm") / "model", seed=0)


@pytest.fixture(scope="session")
def reward_server(tiny_reward_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """The shared server. For quick local iteration, ``WEIGHTSYNC_TEST_REWARD_SERVER=PORT:DIR``
    reuses a server you started yourself (``--api-key test-token`` on a model built by
    ``build_tiny_reward_model(DIR, seed=0)``)."""
    external = os.environ.get("WEIGHTSYNC_TEST_REWARD_SERVER")
    if external:
        port, _, model_dir = external.partition(":")
        yield RewardServerHandle(f"http://127.0.0.1:{port}", int(port), API_KEY, model_dir,
                                 None, "")
        return
    log_path = str(tmp_path_factory.mktemp("reward-server") / "server.log")
    handle = start_reward_server(tiny_reward_model_dir, log_path)
    try:
        yield handle
    finally:
        stop_reward_server(handle)


@pytest.fixture(scope="session")
def reward_server_launcher():
    """``launch(model_dir, log_path, **kw) -> handle`` for tests that need a server of their own
    (another model); ``launch.stop(handle)`` stops it early, the rest stop at session end."""
    started: list[RewardServerHandle] = []

    def launch(model_dir: str, log_path: str, **kwargs: Any) -> RewardServerHandle:
        handle = start_reward_server(model_dir, log_path, **kwargs)
        started.append(handle)
        return handle

    launch.stop = stop_reward_server  # type: ignore[attr-defined]
    try:
        yield launch
    finally:
        for h in started:
            stop_reward_server(h)


# --------------------------------------------------------------------------------------------
# the policy server
# --------------------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class PolicyServerHandle:
    url: str
    port: int
    api_key: str
    model_dir: str
    proc: subprocess.Popen | None
    log_path: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def version(self) -> int:
        import httpx

        return int(httpx.get(self.url + "/runtime_version", timeout=10).json()["version"])

    def push(self, weights: dict, *, version: int | None = None,
             strategy: dict | None = None) -> Any:
        """Push ``weights`` (a model or a state dict) through our dialect with the front door
        (``ws.connect(...).push``); returns the ``SyncStats``."""
        return asyncio.run(push_over_http(self.url, self.api_key, weights, version=version,
                                          strategy=strategy))

    def restore(self) -> int:
        from safetensors.torch import load_file

        stats = self.push(load_file(os.path.join(self.model_dir, "model.safetensors")))
        return int(stats.versions[0])

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log_path, n)


async def push_over_http(url: str, api_key: str, weights: Any, *, version: int | None = None,
                         strategy: Any = None) -> Any:
    """One push through the front door (``ws.connect(...).push``); returns the ``SyncStats``."""
    import weightsync as ws

    strategy = strategy or {"type": "broadcast", "backend": "gloo", "timeout_s": 60}
    async with ws.connect([url], strategy=strategy, api_key=api_key, timeout_s=120) as sync:
        return await sync.push(weights, version=version)


def start_policy_server(model_dir: str, log_path: str, *, api_key: str | None = API_KEY,
                        extra: list[str] | None = None) -> PolicyServerHandle:
    template = os.path.join(os.path.dirname(log_path), "chat_template.jinja")
    with open(template, "w") as f:
        f.write(CHAT_TEMPLATE)
    proc, port = start_server(
        "weightsync.servers.policy", model_dir, log_path, api_key=api_key,
        args=["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
              "--log-level", "warning", "--seed", "0", "--chat-template", template,
              "--served-model-name", "tiny-policy", *(extra or [])],
    )
    return PolicyServerHandle(f"http://127.0.0.1:{port}", port, api_key or "", model_dir,
                              proc, log_path)


@pytest.fixture(scope="session")
def tiny_policy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-policy") / "model", family="llama",
                                tie_word_embeddings=True, seed=0)


@pytest.fixture(scope="session")
def policy_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The shared policy server. ``WEIGHTSYNC_TEST_POLICY_SERVER=PORT:DIR`` reuses one you
    started yourself (``--api-key test-token --served-model-name tiny-policy``)."""
    external = os.environ.get("WEIGHTSYNC_TEST_POLICY_SERVER")
    if external:
        port, _, model_dir = external.partition(":")
        yield PolicyServerHandle(f"http://127.0.0.1:{port}", int(port), API_KEY, model_dir,
                                 None, "")
        return
    log_path = str(tmp_path_factory.mktemp("policy-server") / "server.log")
    handle = start_policy_server(request.getfixturevalue("tiny_policy_model_dir"), log_path)
    try:
        yield handle
    finally:
        stop_reward_server(handle)
