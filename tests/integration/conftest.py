"""Shared integration fixtures: ONE real reward server and ONE real policy server per test
session (vLLM CPU, ~25 s and ~2.4 GB each; each starts when a test first asks for it).

``reward_server`` starts ``python -m weightsync.servers.reward`` on a tiny 1-label Qwen2 reward
model on 127.0.0.1 (a free port, an API key) and yields a ``RewardServerHandle``:

* ``url``, ``port``, ``api_key``, ``model_dir`` (the base weights), ``process`` (its
  ``weightsync.testing.servers.ServerProcess``);
* ``client(**kw)``: a ``VLLMRewardClient`` for it (close it, or use ``async with``);
* ``restore()``: sync the base weights back (FULL) and return the new version.

It runs with our update rules, ``--monotonic-versions --strict-training-mode`` (``OUR_RULES``;
the defaults are the reward spec's, tested in ``servers/test_reward_server_spec_launch.py``).
Rules for tests that share it: weights may have been changed by earlier tests (call
``restore()`` before comparing against the base model); versions only rise, so compare relative
to what you read; close your clients (a new client's ``init_communicator`` takes the server's
receivers from an older one, which then re-joins on its next sync).

``policy_server`` starts ``python -m weightsync.servers.policy`` (vLLM's OpenAI server plus our
control plane, with ``--monotonic-versions``) on a tiny tied-embedding Llama causal LM, fp32, with the chat template every tiny
model carries (``weightsync.testing.tiny_models.CHAT_TEMPLATE``), on a free
port with an API key, and yields a ``PolicyServerHandle``: ``url``, ``port``, ``api_key``,
``model_dir``, ``headers`` (the token), ``push(weights, version=None)`` (our dialect, through
the front door ``ws.connect(...).push``), ``restore()`` (push the base weights back). The
same sharing rules hold.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import pytest

from weightsync.testing.servers import (
    PolicyServerProcess,
    RewardServerProcess,
    ServerProcess,
    cpu_core_slots,
)

API_KEY = "test-token"
#: what every test server gets: a short context and a small KV cache (2 cores, 24 GiB shared);
#: weightsync's own log lines (the warm-up, each update started / landed / refused) at info
SMALL_SERVER = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
                "--log-level", "info"]
#: the shared reward server's update rules: a version must rise (409), the training mode is
#: the update's name policy (400); the servers' defaults take both as given, as the reward spec
OUR_RULES = ["--monotonic-versions", "--strict-training-mode"]


@dataclass
class ServerHandle:
    """A server the tests share: where it is, its token, the weights it started on, and its
    process (None: a server started outside the tests, see the fixtures)."""

    url: str
    port: int
    api_key: str
    model_dir: str
    process: ServerProcess | None

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.process.log_tail(n_chars) if self.process is not None else ""

    def log_text(self) -> str:
        """The server's whole log so far ("" for a server started outside the tests)."""
        if self.process is None:
            return ""
        with open(self.process.log_path, errors="replace") as f:
            return f.read()


@dataclass
class RewardServerHandle(ServerHandle):
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
            client.sync_weights(weights)
            return int(client.last_sync_stats.versions[0])
        finally:
            client.close_sync()


# policy servers' workers on the first slot, reward servers' on the second: the tests run both
# at once (the load test drives both at full speed), and vLLM alone would bind both to core 0
POLICY_CORES, REWARD_CORES = cpu_core_slots(2)


def start_server(server_cls: type[ServerProcess], model_dir: str, log_path: str, *,
                 api_key: str | None, args: list[str], timeout_s: float = 180.0,
                 cpu_cores: str | None = None, env: dict[str, str] | None = None
                 ) -> ServerProcess:
    """Start ``server_cls`` on ``model_dir`` (its output to ``log_path``; ``env`` added to its
    environment) and wait until /health answers 200 (or fail with its log)."""
    token = ["--api-key", api_key] if api_key else []
    return server_cls(model_dir, log_path=log_path, extra_args=[*args, *token],
                      cpu_cores=cpu_cores, env=env).start_healthy(timeout_s=timeout_s)


def start_reward_server(
    model_dir: str, log_path: str, *, api_key: str | None = API_KEY, extra: list[str] | None = None,
    timeout_s: float = 600.0,
) -> RewardServerHandle:
    """Start a reward server subprocess and wait until /health answers (or fail with its log)."""
    server = start_server(RewardServerProcess, model_dir, log_path, api_key=api_key,
                          timeout_s=timeout_s, args=[*SMALL_SERVER, *(extra or [])],
                          cpu_cores=REWARD_CORES)
    return RewardServerHandle(server.url, server.port, api_key or "", model_dir, server)


def stop_server(handle: ServerHandle) -> None:
    """Stop a server the tests started (its whole process group; see ``ServerProcess.stop``)."""
    if handle.process is not None:
        handle.process.stop()


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from weightsync.testing.tiny_models import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm") / "model", seed=0)


@pytest.fixture(scope="session")
def reward_server(tiny_reward_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """The shared server. For quick local iteration, ``WEIGHTSYNC_TEST_REWARD_SERVER=PORT:DIR``
    reuses a server you started yourself (``--api-key test-token --monotonic-versions
    --strict-training-mode`` on a model built by ``build_tiny_reward_model(DIR, seed=0)``)."""
    external = os.environ.get("WEIGHTSYNC_TEST_REWARD_SERVER")
    if external:
        port, _, model_dir = external.partition(":")
        yield RewardServerHandle(f"http://127.0.0.1:{port}", int(port), API_KEY, model_dir,
                                 None)
        return
    log_path = str(tmp_path_factory.mktemp("reward-server") / "server.log")
    handle = start_reward_server(tiny_reward_model_dir, log_path, extra=OUR_RULES)
    try:
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="session")
def reward_server_launcher():
    """``launch(model_dir, log_path, **kw) -> handle`` for tests that need a server of their own
    (another model); ``launch.stop(handle)`` stops it early, the rest stop at session end."""
    started: list[RewardServerHandle] = []

    def launch(model_dir: str, log_path: str, **kwargs: Any) -> RewardServerHandle:
        handle = start_reward_server(model_dir, log_path, **kwargs)
        started.append(handle)
        return handle

    launch.stop = stop_server  # type: ignore[attr-defined]
    try:
        yield launch
    finally:
        for h in started:
            stop_server(h)


# --------------------------------------------------------------------------------------------
# the policy server
# --------------------------------------------------------------------------------------------

@dataclass
class PolicyServerHandle(ServerHandle):
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


async def push_over_http(url: str, api_key: str, weights: Any, *, version: int | None = None,
                         strategy: Any = None) -> Any:
    """One push through the front door (``ws.connect(...).push``); returns the ``SyncStats``."""
    import weightsync as ws

    strategy = strategy or {"type": "broadcast", "backend": "gloo", "timeout_s": 60}
    async with ws.connect([url], strategy=strategy, api_key=api_key, timeout_s=120) as sync:
        return await sync.push(weights, version=version)


def start_policy_server(model_dir: str, log_path: str, *, api_key: str | None = API_KEY,
                        extra: list[str] | None = None,
                        env: dict[str, str] | None = None) -> PolicyServerHandle:
    """The server warms itself up before it answers /health (``--warmup``, on by default: vLLM
    compiles its logprobs kernel then, which has taken minutes on a loaded 2-core box), so no
    test's first request or push waits for that compile; hence the long start limit."""
    server = start_server(
        PolicyServerProcess, model_dir, log_path, api_key=api_key, timeout_s=600.0,
        args=[*SMALL_SERVER, "--seed", "0", "--served-model-name", "tiny-policy", *(extra or [])],
        cpu_cores=POLICY_CORES, env=env,
    )
    return PolicyServerHandle(server.url, server.port, api_key or "", model_dir, server)


@pytest.fixture(scope="session")
def tiny_policy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-policy") / "model", family="llama",
                                tie_word_embeddings=True, seed=0)


@pytest.fixture(scope="session")
def policy_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The shared policy server. ``WEIGHTSYNC_TEST_POLICY_SERVER=PORT:DIR`` reuses one you
    started yourself (``--api-key test-token --served-model-name tiny-policy
    --monotonic-versions``)."""
    external = os.environ.get("WEIGHTSYNC_TEST_POLICY_SERVER")
    if external:
        port, _, model_dir = external.partition(":")
        yield PolicyServerHandle(f"http://127.0.0.1:{port}", int(port), API_KEY, model_dir,
                                 None)
        return
    log_path = str(tmp_path_factory.mktemp("policy-server") / "server.log")
    handle = start_policy_server(request.getfixturevalue("tiny_policy_model_dir"), log_path,
                                 extra=["--monotonic-versions"])
    try:
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of 2 CPUs for one test module (the Ray trainer's tests), shut down after."""
    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
        log_to_driver=False, configure_logging=False,
    )
    yield
    ray.shutdown()
