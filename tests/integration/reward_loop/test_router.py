"""The reward router over two real reward servers on CPU (``RewardModelManager``).

Server A is the session's shared reward server; server B is started once for this module on the
same weights served another way: the checkpoint relabelled as a causal LM (``Qwen2ForCausalLM``
with its ``score.weight``) under ``--convert classify``, so B also shows that conversion scoring
exactly like A. Both get the base weights in one ``weightsync.connect`` fan-out first. B is
killed (SIGKILL to its process group) by the last test, mid-batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time

import httpx
import pytest
import torch

import weightsync as ws
from weightsync.reward_loop.model_manager import RewardModelManager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TEXTS = [f"Sample {i}: the answer is {i * 7} because {'very ' * (i % 5)}careful work."
         for i in range(64)]


@pytest.fixture(scope="module")
def servers(reward_server, reward_server_launcher, tiny_reward_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    causal = str(root / "as-causal-lm")
    shutil.copytree(tiny_reward_model_dir, causal)
    with open(os.path.join(causal, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["Qwen2ForCausalLM"]
    with open(os.path.join(causal, "config.json"), "w") as f:
        json.dump(config, f)
    b = reward_server_launcher(causal, str(root / "b.log"), extra=["--convert", "classify"])
    try:
        yield reward_server, b
    finally:
        reward_server_launcher.stop(b)


@pytest.fixture(scope="module")
def hf(tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_reward_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in TEXTS]
    return want


def _base_weights(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def manager(servers, tiny_reward_model_dir):
    a, b = servers
    rmm = RewardModelManager({"server_urls": [a.url, b.url],
                              "router": {"health_check_interval_s": 1.0}}, api_key=a.api_key)
    stats = rmm.push(_base_weights(tiny_reward_model_dir))  # one fan-out: both, one version
    assert len(set(stats.versions)) == 1
    yield rmm
    rmm.shutdown()


async def _classify_all(address, texts, model, *, concurrency=64, headers=None):
    """One /classify per text through the router; -> (scores, serving server per text)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(text):
            async with sem:
                body = {"input": text, "use_activation": False}
                if model:
                    body["model"] = model
                r = await client.post(f"http://{address}/classify", headers=headers, json=body)
                r.raise_for_status()
                return r.json()["data"][0]["probs"][0], r.headers["x-weightsync-server"]

        return [list(x) for x in zip(*await asyncio.gather(*(one(t) for t in TEXTS)), strict=True)]


def test_load_spreads_over_both_servers_with_transformers_scores(manager, servers, hf):
    a, b = servers
    assert manager.kind == "discriminative"
    versions = manager.versions()
    assert len(set(versions.values())) == 1, versions
    before = {u: s["served"] for u, s in manager.stats().items()}
    # the model name is each server's own (their paths differ), so send none: vLLM's default
    scores, served_by = asyncio.run(_classify_all(manager.get_router_address(), TEXTS, None))
    assert scores == pytest.approx(hf, abs=1e-4)  # B (converted) scores exactly like A
    counts = {u: served_by.count(u) for u in (a.url, b.url)}
    assert min(counts.values()) >= 16, counts  # least outstanding requests: both take a share
    after = manager.stats()
    assert {u: after[u]["served"] - before[u] for u in after} == counts
    assert all(s["outstanding"] == 0 and s["healthy"] for s in after.values())
    # OpenRLHF's /get_reward and our /score go through the router as well
    r = httpx.post(f"http://{manager.get_router_address()}/get_reward",
                   json={"query": TEXTS[:3]}, timeout=60)
    assert r.json()["rewards"] == pytest.approx(hf[:3], abs=1e-4)


def test_the_control_plane_is_not_forwarded(manager):
    r = httpx.post(f"http://{manager.get_router_address()}/update_param_batch", json={},
                   timeout=30)
    assert r.status_code == 404 and "weightsync.connect" in r.json()["detail"]


def test_an_idle_connection_to_the_router_outlives_what_clients_keep(manager):
    """A client that reuses a connection idle for longer than uvicorn's 5 s default (httpx
    keeps one 5 s) still gets an answer: the router keeps idle connections as the servers do
    (``default_keep_alive_s``), so it never closes one under a client's next request (the
    race showed as ReadError in a reward worker, under load)."""
    import http.client

    host, port = manager.get_router_address().rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        answers = []
        for wait_s in (0.0, 5.5):
            time.sleep(wait_s)
            conn.request("POST", "/update_param_batch", body=b"{}",
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            answers.append((r.status, conn.sock is not None and conn.sock.fileno()))
            r.read()
        assert answers[0][0] == answers[1][0] == 404, answers
        assert answers[0][1] == answers[1][1], answers  # the same connection, still open
    finally:
        conn.close()


def test_servers_at_different_versions_are_refused_unless_allowed(manager, servers,
                                                                  tiny_reward_model_dir):
    from weightsync.reward_loop.router import RewardRouter, RouterConfig

    a, b = servers

    async def push_to_b_only():
        async with ws.connect([b.url], strategy="broadcast", api_key=b.api_key) as sync:
            return await sync.push(_base_weights(tiny_reward_model_dir),
                                   version=max(manager.versions().values()) + 1)

    asyncio.run(push_to_b_only())
    versions = manager.versions()
    assert versions[b.url] == versions[a.url] + 1
    r = httpx.post(f"http://{manager.get_router_address()}/classify", timeout=60,
                   json={"input": TEXTS[0], "use_activation": False})
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert f"{a.url} at version {versions[a.url]}" in detail
    assert f"{b.url} at version {versions[b.url]}" in detail and "allow_mixed_versions" in detail

    async def mixed_allowed():
        router = RewardRouter([a.url, b.url], RouterConfig(allow_mixed_versions=True))
        await router.start()
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                answers = await asyncio.gather(*(client.post(
                    f"http://{router.address}/classify",
                    json={"input": t, "use_activation": False}) for t in TEXTS[:16]))
            pinned = await client_pinned(router.address, versions[b.url])
            return answers, pinned
        finally:
            await router.stop()

    async def client_pinned(address, version):
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(
                f"http://{address}/classify", headers={"x-weight-version": str(version)},
                json={"input": t, "use_activation": False}) for t in TEXTS[:6]))

    answers, pinned = asyncio.run(mixed_allowed())
    assert all(r.status_code == 200 for r in answers)
    assert {int(r.headers["x-weight-version"]) for r in answers} == set(versions.values())
    # a request that names a version is served only by a server at that version
    assert {r.headers["x-weightsync-server"] for r in pinned} == {b.url}
    # one fan-out brings both to one version again
    manager.push(_base_weights(tiny_reward_model_dir))
    assert len(set(manager.versions().values())) == 1


def test_a_server_killed_mid_batch_fails_fast_or_is_retried(manager, servers, hf):
    """Two routers over A and B, each sending a batch of 200 requests, 8 at a time: B is killed
    once both have had an answer from it (40 requests in; the other 160 go out after the
    kill). The fail-fast router's batch fails with an error naming B; the retrying router's
    batch finishes on A with transformers' scores."""
    from weightsync.reward_loop.router import RewardRouter, RouterConfig

    a, b = servers
    texts = [TEXTS[i % len(TEXTS)] for i in range(200)]
    want = [hf[i % len(TEXTS)] for i in range(200)]

    async def batch(router, killed):
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i, text):
                if i >= 40:
                    await killed.wait()  # the rest of the batch goes out after the kill
                async with sem:
                    r = await client.post(f"http://{router.address}/classify",
                                          json={"input": text, "use_activation": False})
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.json()['detail']}")
                    return r.json()["data"][0]["probs"][0]

            return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)),
                                        return_exceptions=True)

    async def run():
        fast = RewardRouter([a.url, b.url], RouterConfig())
        retry = RewardRouter([a.url, b.url], RouterConfig(max_retries=2, retry_backoff_s=0.05))
        await fast.start()
        await retry.start()
        killed = asyncio.Event()
        jobs = [asyncio.ensure_future(batch(r, killed)) for r in (fast, retry)]
        try:
            deadline = time.monotonic() + 120
            while min(r.stats()[b.url]["served"] for r in (fast, retry)) < 1:
                if time.monotonic() > deadline:
                    raise AssertionError(f"B took none of the first 40 requests: "
                                         f"{fast.stats()} {retry.stats()}")
                await asyncio.sleep(0.01)
            os.killpg(b.process.pid, signal.SIGKILL)
            killed.set()
            return await asyncio.gather(*jobs), fast.stats(), retry.stats()
        finally:
            killed.set()
            await asyncio.gather(*jobs, return_exceptions=True)
            await fast.stop()
            await retry.stop()

    (fast_out, retry_out), fast_stats, retry_stats = asyncio.run(run())
    errors = [e for e in fast_out if isinstance(e, BaseException)]
    assert errors, "the fail-fast router's batch finished although B died"
    assert all(f"reward server {b.url} failed" in str(e) for e in errors), errors[:3]
    assert fast_stats[b.url]["healthy"] is False and fast_stats[b.url]["failures"] >= 1
    assert not [e for e in retry_out if isinstance(e, BaseException)]
    assert retry_out == pytest.approx(want, abs=1e-4)
    assert retry_stats[b.url]["healthy"] is False and retry_stats[a.url]["served"] > 100
