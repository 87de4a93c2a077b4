"""The policy server (vLLM's OpenAI server + our control plane) on real vLLM (CPU) over real HTTP.

One server for the whole session (``policy_server`` in conftest: a tiny Llama causal LM with
tied embeddings, fp32). References come from transformers forwards of the same weights:
prompt logprobs (vLLM's ``prompt_logprobs`` extension of ``/v1/completions``) and greedy tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from _policy_ref import (
    N_NEW,
    PROMPTS,
    TOL,
    Reference,
    check_against,
    completion_lps,
    max_diff,
    prompt_lps,
    served,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref(policy_server):
    return Reference(policy_server.model_dir)


@pytest.fixture(scope="module")
def restored(policy_server, ref):
    policy_server.restore()
    return policy_server


# --------------------------------------------------------------------------------------------
# the acceptance (first in the session's order, while the server's version is below 5)
# --------------------------------------------------------------------------------------------


def test_front_door_push_of_a_new_model_gives_its_logprobs_and_version_5(
    policy_server, tmp_path
):
    """``await ws.connect(url, ...).push(new_model, version=5)`` with a model the tests never
    saw: the server answers with its logprobs and ``/runtime_version`` says 5."""
    import weightsync as ws
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    new_dir = build_tiny_causal_lm(tmp_path / "unseen", family="llama", tie_word_embeddings=True,
                                   seed=1234)
    unseen = Reference(new_dir)
    v0 = policy_server.version()
    target = 5 if v0 < 5 else v0 + 5  # 5 in the session's order (this test runs first)

    async def go():
        sync = await ws.connect([policy_server.url], strategy="broadcast",
                                api_key=policy_server.api_key)
        try:
            return await sync.push(unseen.model, version=target)
        finally:
            await sync.close()

    from weightsync._runtime import trace

    trace.flush()
    trace.configure(tmp_path / "trace")  # the trainer's side of the push: which calls it made
    try:
        stats = asyncio.run(go())
    finally:
        trace.flush()
        trace.configure(None)
    assert stats.versions == [target]
    labels = [json.loads(line)["label"] for f in (tmp_path / "trace").glob("trace-*.jsonl")
              for line in f.read_text().splitlines()]
    # one server: one POST of the update (start, the streamed request and its finish)
    assert labels.count("rpc.apply.begin") == 1 and labels.count("rpc.apply.end") == 1, labels
    assert not {"rpc.start.end", "rpc.request.end", "rpc.finish.end"} & set(labels), labels
    assert httpx.get(policy_server.url + "/runtime_version").json()["version"] == target
    for p in PROMPTS:
        assert check_against(policy_server, unseen, p) == target
    base = Reference(policy_server.model_dir)
    body, _ = served(policy_server, PROMPTS[0])
    assert max_diff(prompt_lps(body), base.logprobs(body["choices"][0]["prompt_token_ids"])) > 1e-2


# --------------------------------------------------------------------------------------------
# vLLM's own app: health, models, completions, chat, streaming, the openai client
# --------------------------------------------------------------------------------------------


def test_health_models_and_runtime_version(policy_server):
    assert httpx.get(policy_server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(policy_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-policy"]
    rv = httpx.get(policy_server.url + "/runtime_version").json()
    assert isinstance(rv["version"], int) and rv["state"] == "ready"
    tok = httpx.post(policy_server.url + "/tokenize", json={"model": "tiny-policy", "prompt": "hi"})
    assert tok.status_code == 200 and tok.json()["tokens"]


def test_base_weights_equal_transformers(restored, ref):
    for p in PROMPTS:
        check_against(restored, ref, p)


def test_openai_client_completions_chat_and_streams(restored):
    import openai

    client = openai.OpenAI(base_url=restored.url + "/v1", api_key="unused")
    version = restored.version()
    c = client.completions.create(model="tiny-policy", prompt="The model is", max_tokens=4,
                                  temperature=0)
    assert c.choices[0].text and c.model_extra["weight_version"] == version
    chat = client.chat.completions.create(
        model="tiny-policy", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0)
    assert chat.choices[0].message.content is not None
    assert chat.model_extra["weight_version"] == version
    raw = client.completions.with_raw_response.create(model="tiny-policy", prompt="hi",
                                                      max_tokens=2)
    assert raw.headers["x-weight-version"] == str(version)
    chunks = list(client.chat.completions.create(
        model="tiny-policy", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0, stream=True))
    assert len(chunks) >= 2
    assert all(ch.model_extra["weight_version"] == version for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny-policy", prompt="The model is", max_tokens=4, temperature=0, stream=True))
    assert streamed == c.choices[0].text


# --------------------------------------------------------------------------------------------
# pushes through our dialect
# --------------------------------------------------------------------------------------------


def test_push_changes_outputs_version_and_header(restored, ref):
    v0 = restored.version()
    state = ref.perturb(seed=1)
    stats = restored.push(state)
    assert stats.versions == [v0 + 1] and restored.version() == v0 + 1
    for p in PROMPTS:
        assert check_against(restored, ref, p) == v0 + 1
    stats = restored.push(state, version=v0 + 10)
    assert stats.versions == [v0 + 10]
    assert check_against(restored, ref, PROMPTS[0]) == v0 + 10


def test_a_trainer_pushing_its_model_step_after_step_is_replayed_and_served_exactly(restored,
                                                                                   ref):
    """One session pushes the same model after each of four in-place steps: from its third
    push on, the update is replayed (the request refers to the layout the server's worker
    keeps, the start to the manifest it keeps), and every version serves the model's own prompt
    logprobs and greedy tokens (transformers, fp32)."""
    import copy

    import weightsync as ws

    model = copy.deepcopy(ref.model)
    now = Reference(restored.model_dir)
    now.model = model
    g = torch.Generator().manual_seed(7)

    async def go():
        versions = []
        async with ws.connect([restored.url], "broadcast", api_key=restored.api_key) as sync:
            for _ in range(4):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 1e-2)
                stats = await sync.push(model)
                versions.append(stats.versions[0])
                served_version = await asyncio.to_thread(check_against, restored, now, PROMPTS[0])
                assert served_version == versions[-1]
            return versions, sync.sender.replayed

    versions, replayed = asyncio.run(go())
    assert replayed == 2 and versions == list(range(versions[0], versions[0] + 4))
    restored.restore()  # the base weights again, for the module's later tests


BAD_PUSHES = [
    ({"model.norm.weight": torch.zeros(65)}, "model.norm.weight", "shape [65] but target has [64]"),
    ({"model.layers.0.mlp.down_projj.weight": torch.zeros(64, 128)}, "down_projj",
     "not a parameter"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.float16)}, "model.norm.weight",
     "dtype float16"),
]


@pytest.mark.parametrize("weights, name, needle", BAD_PUSHES)
def test_mismatched_push_is_4xx_naming_the_tensor_and_changes_nothing(
    restored, ref, weights, name, needle
):
    from weightsync.errors import WeightMismatchError

    v0 = restored.version()
    before, _ = served(restored, PROMPTS[0])
    manifest = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                for n, t in weights.items()]
    r = httpx.post(restored.url + "/update_param_batch", headers=restored.headers, json={
        "metadata": {"type": "start", "update_id": "bad", "manifest": manifest}})
    assert r.status_code == 400, r.text
    assert any(name in o and needle in o for o in r.json()["offenders"]), r.json()
    with pytest.raises(WeightMismatchError) as ei:  # the same through a sender
        restored.push(weights)
    assert any(name in o for o in ei.value.offenders)
    after, resp = served(restored, PROMPTS[0])
    assert restored.version() == v0 and resp.headers["x-weight-version"] == str(v0)
    assert prompt_lps(after) == prompt_lps(before)
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_torn_engine_answers_503_on_openai_routes_until_a_complete_push(restored, ref):
    """A sender that dies after a chunk landed leaves the weights torn: completions and chats
    answer 503 (never a silent mix) until the next complete push."""
    from weightsync import WeightChunk, build_strategy
    from weightsync.clients import FanOutClient

    state = ref.perturb(seed=3)
    names = sorted(state)

    async def dying():
        yield WeightChunk(names[:2], [state[n] for n in names[:2]])
        yield WeightChunk(names[2:4], [state[n] for n in names[2:4]])
        await asyncio.sleep(2)
        raise RuntimeError("trainer died")

    async def go():
        client = FanOutClient([restored.url], api_key=restored.api_key)
        strat = build_strategy({"type": "cuda_ipc"})
        sender = await strat.create_sender(None, client, await strat.create_sync_info(None, client))
        try:
            with pytest.raises(RuntimeError, match="trainer died"):
                await sender.send_chunks(dying(), client)
        finally:
            await sender.close()
            await client.aclose()

    v0 = restored.version()
    asyncio.run(go())
    assert httpx.get(restored.url + "/runtime_version").json()["state"] == "torn"
    r = httpx.post(restored.url + "/v1/completions", json={"model": "tiny-policy", "prompt": "hi"})
    assert r.status_code == 503 and "trainer died" in r.json()["detail"]
    r = httpx.post(restored.url + "/v1/chat/completions", json={
        "model": "tiny-policy", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503
    from weightsync.errors import UpdateIncompleteError
    from weightsync.policy import ChatCompletionRequest, VLLMChatClient

    with pytest.raises(UpdateIncompleteError, match="trainer died"):  # the client's view
        asyncio.run(VLLMChatClient("127.0.0.1", restored.port).complete(
            ChatCompletionRequest(prompt="hi")))
    assert httpx.get(restored.url + "/health").status_code == 200  # the process is fine
    assert restored.push(state).versions == [v0 + 1]
    assert check_against(restored, ref, PROMPTS[1]) == v0 + 1


def test_completions_during_syncs_each_come_from_one_version(restored, ref):
    """Threads send completions while the trainer alternates two weight sets: every response
    succeeds and equals transformers (prompt and every generated token) on exactly the weight
    set of the version it reports."""
    sets, expected = [], []
    for seed in (41, 42):
        sets.append(ref.perturb(seed=seed))
        per_prompt = {}
        for p in PROMPTS:
            ids = ref.ids(p)
            gen = ref.greedy(ids)
            per_prompt[p] = (gen, ref.logprobs(ids + gen))
        expected.append(per_prompt)

    seen, errors = [], []
    stop = threading.Event()

    def generator(prompt: str) -> None:
        with httpx.Client(timeout=120) as h:
            while not stop.is_set():
                r = h.post(restored.url + "/v1/completions", json={
                    "model": "tiny-policy", "prompt": prompt, "max_tokens": N_NEW,
                    "temperature": 0, "prompt_logprobs": 0, "logprobs": 0,
                    "return_token_ids": True, "ignore_eos": True})
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                seen.append((prompt, r.json()))

    threads = [threading.Thread(target=generator, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    versions = {}
    try:
        for i in range(6):
            target = len(seen) + 2
            stats = restored.push(sets[i % 2])
            versions[stats.versions[0]] = i % 2
            deadline = time.monotonic() + 60
            while len(seen) < target and not errors and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors[:3]
    checked = 0
    for prompt, body in seen:
        v = body["weight_version"]
        if v not in versions:
            continue
        gen, lps = expected[versions[v]][prompt]
        other_gen, other_lps = expected[1 - versions[v]][prompt]
        assert body["choices"][0]["token_ids"] == gen, (v, prompt)
        both = prompt_lps(body) + completion_lps(body)
        assert max_diff(both, lps) <= TOL, (v, prompt)
        assert max_diff(both, other_lps) > 1e-2
        checked += 1
    assert checked >= 6 and {b["weight_version"] for _, b in seen} >= set(versions)


# --------------------------------------------------------------------------------------------
# security
# --------------------------------------------------------------------------------------------

GUARDED = [
    ("GET", "/get_world_size", None),
    ("POST", "/init_communicator", {"host": "127.0.0.1", "port": 1, "world_size": 2}),
    ("POST", "/update_param_batch", {"metadata": [{"name": "x", "dtype": "float32", "shape": [1]}]}),
    ("POST", "/close_communicator", {}),
    ("POST", "/get_num_background_tasks", {}),
    ("POST", "/reset_prefix_cache", {}),
    ("GET", "/batch_ready/x", None),
]


@pytest.mark.parametrize("method, path, body", GUARDED)
def test_control_routes_need_the_token(policy_server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}):
        r = httpx.request(method, policy_server.url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
    assert httpx.get(policy_server.url + "/runtime_version").status_code == 200  # open


def test_token_opens_control_routes_and_body_limit(policy_server):
    h = policy_server.headers
    assert httpx.get(policy_server.url + "/get_world_size", headers=h).json() == {"world_size": 1}
    r = httpx.post(policy_server.url + "/reset_prefix_cache", headers={"X-API-Key": policy_server.api_key})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    big = b'{"metadata": [' + b" " * (17 << 20) + b"]}"
    r = httpx.post(policy_server.url + "/update_param_batch", content=big,
                   headers={**h, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def listening_addresses(port: int) -> set[str]:
    """The local addresses on which a socket LISTENs on ``port`` (from /proc/net/tcp{,6})."""
    import ipaddress

    out = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            if len(raw) == 4:
                out.add(str(ipaddress.IPv4Address(raw[::-1])))
            else:
                words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                out.add(str(ipaddress.IPv6Address(b"".join(words))))
    return out


def test_binds_loopback_only(policy_server):
    assert listening_addresses(policy_server.port) == {"127.0.0.1"}


def test_restore_base_weights_for_other_tests(restored):
    restored.restore()
    check_against(restored, Reference(restored.model_dir), PROMPTS[0])


def test_an_update_in_one_call_refused_at_start_or_malformed_is_4xx_and_changes_nothing(restored):
    """``{metadata: {type: apply, start, requests, finish}}``: a start the engine refuses is 400
    naming the tensor, a malformed body 400 naming the field; the served version stays and the
    next update lands."""
    v0 = restored.version()
    finish = {"type": "finish", "update_id": "one-call", "version": None, "num_chunks": 1,
              "ok": True, "error": ""}
    start = {"type": "start", "update_id": "one-call", "manifest": [
        {"name": "model.norm.weight", "dtype": "float32", "shape": [65]}]}
    r = httpx.post(restored.url + "/update_param_batch", headers=restored.headers, json={
        "metadata": {"type": "apply", "start": start, "requests": [], "finish": finish}})
    assert r.status_code == 400 and "model.norm.weight" in r.text, r.text
    for bad, field_name in (({"requests": {}}, "metadata.requests"),
                            ({"finish": None}, "metadata.finish"),
                            ({"start": "yes"}, "metadata.start")):
        body = {"type": "apply", "start": None, "requests": [], "finish": finish, **bad}
        r = httpx.post(restored.url + "/update_param_batch", headers=restored.headers,
                       json={"metadata": body})
        assert r.status_code == 400 and field_name in r.text, (bad, r.text)
    assert restored.version() == v0
    state = httpx.get(restored.url + "/runtime_version").json()
    assert state["state"] == "ready" and not state["update_in_progress"], state


def test_the_log_says_what_each_update_did_and_vllm_partial_reload_noise_is_gone(restored, ref):
    """weightsync's own lines (at --log-level info): the warm-up before serving, then per update
    "started" (versions, tensors, bytes), "landed" (version, chunks, bytes, seconds) or
    "refused" (why). vLLM's reload warnings about the layers a chunk did not carry ("Failed to
    load weights", "Following weights were not loaded from checkpoint") never appear, though
    each chunk of this push reloads only some layers."""
    import re

    if restored.process is None:
        pytest.skip("a server started outside the tests: its log is not here")
    assert re.search(r"warm-up \(one request with logprobs\) took [\d.]+s",
                     restored.log_text()), restored.log_tail()
    seen = len(restored.log_text())
    v0 = restored.version()
    stats = restored.push(ref.model.state_dict(), strategy={
        "type": "packed_cuda_ipc", "bucket_size_mb": 0.05})  # many chunks, some layers each
    assert stats.versions == [v0 + 1]
    r = httpx.post(restored.url + "/update_param_batch", headers=restored.headers, json={
        "metadata": {"type": "start", "update_id": "refused-one", "manifest": [
            {"name": "model.norm.weight", "dtype": "float32", "shape": [65]}]}})
    assert r.status_code == 400
    log = restored.log_text()[seen:]
    started = re.search(rf"update (\w+) started: version {v0} -> {v0 + 1}, (\d+) tensors, "
                        rf"[\d.]+ MB", log)
    assert started, log[-3000:]
    landed = re.search(rf"update {started.group(1)} landed: version {v0 + 1}, (\d+) chunk\(s\), "
                       rf"[\d.]+ MB in [\d.]+s", log)
    assert landed and int(landed.group(1)) > 3, log[-3000:]
    assert re.search(r"update refused-one refused: .*model\.norm\.weight", log), log[-3000:]
    whole = restored.log_text()
    assert "Failed to load weights" not in whole
    assert "were not loaded from checkpoint" not in whole
