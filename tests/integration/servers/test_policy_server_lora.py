"""LoRA adapter-only updates into ``weightsync serve-policy --enable-lora`` (real vLLM CPU, real
HTTP): the trainer pushes only its adapter (``ws.connect(url, extractor="lora_adapter")``);
``/v1/models`` then lists it, requests with ``"model": <adapter>`` are served by its latest
version (prompt logprobs, greedy tokens and their logprobs equal the merged model in
transformers, fp32), requests naming the base model by the base weights; a refused adapter
changes nothing; an adapter update does not wait for a base-model request in flight."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import httpx
import pytest
import torch
from _policy_ref import PROMPTS, TOL, Reference, completion_lps, max_diff, prompt_lps, served

import weightsync as ws
from weightsync._runtime.cpu_binding import ENGINE_CORE_CPUS_ENV, FOLLOW_WORKERS
from weightsync.errors import UpdateRefusedError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_server(tiny_policy_model_dir, tmp_path_factory):
    from conftest import start_policy_server, stop_server

    log_path = str(tmp_path_factory.mktemp("policy-lora") / "server.log")
    handle = start_policy_server(tiny_policy_model_dir, log_path, extra=[
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--max-cpu-loras", "2"])
    try:
        yield handle
    finally:
        stop_server(handle)


def _policy(model_dir: str, *, r: int = 8, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    ref = Reference(model_dir)
    model = get_peft_model(copy.deepcopy(ref.model), LoraConfig(
        r=r, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    merged = Reference(model_dir)
    merged.model = copy.deepcopy(model).merge_and_unload().eval()
    return model, merged, ref


def _push(server, model, name: str = "policy"):
    async def go():
        async with ws.connect([server.url], "broadcast", api_key=server.api_key,
                              extractor={"type": "lora_adapter", "adapter_name": name}) as sync:
            return await sync.push(model)

    return asyncio.run(go())


def _check(server, ref: Reference, prompt: str, model: str) -> int:
    """The served prompt logprobs, greedy tokens and their logprobs equal ``ref``'s; returns
    the version the response reports."""
    return _verify(ref, *served(server, prompt, model=model))


def _verify(ref: Reference, body: dict, r: httpx.Response) -> int:
    """``body`` (a completion with ``return_token_ids``) equals ``ref``: the greedy tokens and
    their logprobs, and the prompt's logprobs when it asked for them. vLLM 0.26's CPU build
    kills its engine when a LoRA server computes prompt logprobs for a request batched with
    others (its LoRA logits use the batch's sampling mapping, one row per request, on the
    prompt's rows: vLLM issues 16668 and 29955), so a request sent while another runs asks for
    none."""
    ids = body["choices"][0]["prompt_token_ids"]
    if body["choices"][0].get("prompt_logprobs"):
        assert max_diff(prompt_lps(body), ref.logprobs(ids)) <= TOL
    gen = body["choices"][0]["token_ids"]
    assert gen == ref.greedy(ids)
    if body["choices"][0].get("logprobs"):
        assert max_diff(completion_lps(body), ref.logprobs(ids + gen)[len(ids) - 1:]) <= TOL
    return int(r.headers["x-weight-version"])


#: a long sampled base-model stream (``_stream``'s body; ``n`` added by each test)
BASE_STREAM = {"model": "tiny-policy", "prompt": PROMPTS[0], "max_tokens": 200,
               "temperature": 1.0, "seed": 0, "ignore_eos": True}


def _stream(url: str, body: dict, out: dict, first: threading.Event) -> None:
    """Stream ``body`` from ``/v1/completions`` (run it on a thread): ``out`` gets the status,
    the weight versions and token ids of the events and, once the last came, ``ended`` (this
    process's monotonic clock); ``first`` is set at the first event (and at the end)."""
    tokens, versions = [], set()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                versions.add(event.get("weight_version"))
                tokens += event["choices"][0].get("token_ids") or []
                first.set()
    out.update(tokens=tokens, versions=versions, ended=time.monotonic())
    first.set()


def _reading(url: str, body: dict) -> tuple[threading.Thread, dict, threading.Event]:
    """``_stream`` started on a thread: -> (the thread, its ``out``, its ``first``)."""
    out, first = {}, threading.Event()
    reader = threading.Thread(target=_stream, args=(url, body, out, first))
    reader.start()
    return reader, out, first


def test_requests_naming_the_adapter_get_its_latest_version(lora_server):
    model, merged, base = _policy(lora_server.model_dir, seed=1)
    stats = _push(lora_server, model)
    assert stats.num_tensors == 2 * 3 * 2  # A and B of 3 modules in 2 layers
    names = [m["id"] for m in httpx.get(lora_server.url + "/v1/models").json()["data"]]
    assert "policy" in names and "tiny-policy" in names
    for p in PROMPTS:
        version = _check(lora_server, merged, p, "policy")
        _check(lora_server, base, p, "tiny-policy")  # the base weights are untouched
    model2, merged2, _ = _policy(lora_server.model_dir, seed=2)
    stats2 = _push(lora_server, model2)
    assert stats2.versions == [version + 1]
    for p in PROMPTS:
        _check(lora_server, merged2, p, "policy")


def test_a_refused_adapter_changes_nothing(lora_server):
    model, merged, _ = _policy(lora_server.model_dir, seed=3)
    _push(lora_server, model)
    too_big, _, _ = _policy(lora_server.model_dir, r=32, seed=4)
    with pytest.raises(UpdateRefusedError, match="rank"):
        _push(lora_server, too_big)
    for p in PROMPTS:
        _check(lora_server, merged, p, "policy")
    state = httpx.get(lora_server.url + "/runtime_version").json()
    assert state["version"] >= 1


def test_a_relay_forwards_an_adapter_update_as_one(lora_server):
    """The ``remote`` loader in a relay endpoint forwards an adapter update as an adapter update
    (the server installs it; the relay never serves adapters itself)."""
    from weightsync.loaders.remote import RemoteLoaderConfig, RemoteWeightLoader

    model, merged, _ = _policy(lora_server.model_dir, seed=5)
    loader = RemoteWeightLoader(RemoteLoaderConfig(
        url=lora_server.url, api_key=lora_server.api_key, timeout_s=120,
        strategy={"type": "broadcast", "backend": "gloo", "timeout_s": 60}))
    relay = ws.WeightUpdateEndpoint(loader, name="relay")

    async def run():
        async with ws.connect([relay], {"type": "cuda_ipc", "bucket_size_mb": 0.05},
                              extractor={"type": "lora_adapter",
                                         "adapter_name": "relayed"}) as sync:
            stats = await sync.push(model)
        await loader.aclose()
        return stats

    stats = asyncio.run(run())
    assert loader.last_stats.num_tensors == stats.num_tensors == 12
    for p in PROMPTS:
        _check(lora_server, merged, p, "relayed")


def test_an_adapter_update_lands_while_a_base_model_stream_runs(lora_server):
    """An adapter-only update changes nothing a base-model request reads, so it does not wait
    for one to finish (``servers/_gate.py``'s scopes): the push returns while a long base-model
    stream is still running, the stream keeps its one version, and the adapter serves its new
    version at once. (The session connects and pushes once before the stream starts, so the
    timed push is the update alone.)"""
    model, _, _ = _policy(lora_server.model_dir, seed=6)
    model2, merged2, _ = _policy(lora_server.model_dir, seed=7)

    async def go():
        async with ws.connect([lora_server.url], "broadcast", api_key=lora_server.api_key,
                              extractor={"type": "lora_adapter", "adapter_name": "policy"}) as sync:
            await sync.push(model)
            reader, out, first = _reading(lora_server.url, {**BASE_STREAM, "n": 64})
            assert await asyncio.to_thread(first.wait, 120)
            assert "ended" not in out  # the base-model request is in flight
            t0 = time.monotonic()
            stats = await sync.push(model2)
            out["pushed"], out["push_s"] = time.monotonic(), time.monotonic() - t0
            await asyncio.to_thread(reader.join, 300)
            return stats, out

    stats, out = asyncio.run(go())
    print(f"adapter push {out['push_s']:.2f}s, returned {out['ended'] - out['pushed']:.2f}s "
          f"before the base stream ended")
    assert out["status"] == 200 and len(out["versions"]) == 1
    assert out["pushed"] < out["ended"], "the adapter update waited for the base-model stream"
    (v,) = out["versions"]
    assert stats.versions == [v + 1]
    for p in PROMPTS:
        _check(lora_server, merged2, p, "policy")


def test_an_adapter_update_under_a_base_stream_leaves_no_stale_prefix_cache(lora_server):
    """vLLM refuses to reset its prefix cache while requests hold KV blocks, so an adapter update
    that lands under a running base-model stream cannot clear the KV its adapter's old version
    computed. The adapter's next request on the same long prompt must still be served by the
    new version (greedy tokens and their logprobs equal transformers on the merged model), not
    from cached blocks of the old one. (No prompt logprobs asked: vLLM reads no cached prefix
    for a request that asks for them.)"""
    model_a, merged_a, _ = _policy(lora_server.model_dir, seed=8)
    model_b, merged_b, _ = _policy(lora_server.model_dir, seed=9)
    prompt = " ".join(["weights move from the trainer into the running engine"] * 10)

    def adapter_answer(ref: Reference) -> float:
        body, _ = served(lora_server, prompt, model="policy", prompt_logprobs=None)
        ids = body["choices"][0]["prompt_token_ids"]
        gen = body["choices"][0]["token_ids"]
        assert gen == ref.greedy(ids)
        return max_diff(completion_lps(body), ref.logprobs(ids + gen)[len(ids) - 1:])

    async def go():
        async with ws.connect([lora_server.url], "broadcast", api_key=lora_server.api_key,
                              extractor={"type": "lora_adapter", "adapter_name": "policy"}) as sync:
            await sync.push(model_a)
            assert await asyncio.to_thread(adapter_answer, merged_a) <= TOL  # now cached
            reader, out, first = _reading(lora_server.url, {**BASE_STREAM, "n": 64})
            assert await asyncio.to_thread(first.wait, 120)
            assert "ended" not in out  # the base-model request holds KV blocks
            await sync.push(model_b)
            diff = await asyncio.to_thread(adapter_answer, merged_b)
            await asyncio.to_thread(reader.join, 300)
            return diff

    assert asyncio.run(go()) <= TOL


@pytest.fixture(scope="module")
def slotted_server(tiny_policy_model_dir, tmp_path_factory):
    from conftest import start_policy_server, stop_server

    log_path = str(tmp_path_factory.mktemp("policy-lora-slots") / "server.log")
    handle = start_policy_server(tiny_policy_model_dir, log_path, extra=[
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "2",
        "--adapter-slots", "2", "--max-model-len", "512"],
        env={ENGINE_CORE_CPUS_ENV: FOLLOW_WORKERS})  # see the slots test's docstring
    try:
        yield handle
    finally:
        stop_server(handle)


def test_with_adapter_slots_a_stream_finishes_on_its_version_while_the_next_one_serves(
    slotted_server,
):
    """``--adapter-slots 2``: a greedy stream of the adapter runs while its next version is
    pushed; the push returns before the stream ends (it waits for no request of the adapter),
    every token of the stream is the old version's (transformers on the merged model: its
    greedy continuation), and a request sent meanwhile gets the new version (in the same
    batches as the stream). A third version goes into the first slot again once nothing runs
    on it.

    The times are this process's: when the push returned, when the new version's answer came
    and when the stream's last event came. They order the server's events only while this
    process gets the CPU when its sockets wake it. On a 2-core box that once failed 2 runs of
    3: vLLM's engine core, free to run on the core the worker does not use, busy-waits there
    for its worker's results and this process was left runnable but unscheduled for up to
    0.7 s, so the request sent "meanwhile" left only as the stream ended. This test's server
    binds its engine core to its workers' cores (``WEIGHTSYNC_ENGINE_CORE_CPUS=workers``,
    ``weightsync/_runtime/cpu_binding.py``)."""

    server = slotted_server
    models = [_policy(server.model_dir, seed=s) for s in (11, 12, 13)]
    new_tokens = 400

    async def under_a_stream(sync, model) -> tuple[dict, object]:
        """Push ``model`` while a stream of the adapter runs, then send a request of the
        adapter (greedy, no logprobs: ``_verify``) while the stream still runs."""
        reader, out, first = _reading(server.url, {
            "model": "policy", "prompt": PROMPTS[1], "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert await asyncio.to_thread(first.wait, 120)
        assert "ended" not in out  # the adapter's stream is in flight
        stats = await sync.push(model)
        out["pushed"] = time.monotonic()
        out["meanwhile"] = await asyncio.to_thread(
            served, server, PROMPTS[0], model="policy", prompt_logprobs=None, logprobs=None)
        out["meanwhile_at"] = time.monotonic()
        await asyncio.to_thread(reader.join, 300)
        return out, stats

    async def go():
        async with ws.connect([server.url], "broadcast", api_key=server.api_key,
                              extractor={"type": "lora_adapter", "adapter_name": "policy"}) as sync:
            # a warm-up round (both slots used once, two adapters in one batch once), so the
            # measured round runs on a warm engine
            await sync.push(models[2][0])
            await under_a_stream(sync, models[2][0])
            s1 = await sync.push(models[0][0])
            out, s2 = await under_a_stream(sync, models[1][0])
            s3 = await sync.push(models[2][0])  # the slot of s1 again: nothing runs on it now
            return out, s1, s2, s3

    out, s1, s2, s3 = asyncio.run(go())
    (v1,), (v2,), (v3,) = s1.versions, s2.versions, s3.versions
    print(f"push returned {out['ended'] - out['pushed']:.2f}s before the stream ended; the "
          f"new version answered {out['ended'] - out['meanwhile_at']:.2f}s before it ended")
    assert out["status"] == 200 and out["versions"] == {v1}
    assert out["pushed"] < out["ended"], "the adapter update waited for the adapter's stream"
    ids = models[0][1].ids(PROMPTS[1])
    assert out["tokens"] == models[0][1].greedy(ids, new_tokens)  # v1's, to the last token
    assert _verify(models[1][1], *out["meanwhile"]) == v2
    # both versions ran in one batch (the case that killed vLLM's engine while both slots had
    # one name: vLLM tells LoRA requests apart by name)
    assert out["meanwhile_at"] < out["ended"], "the new version's request did not overlap"
    assert (v2, v3) == (v1 + 1, v1 + 2)
    for p in PROMPTS:
        assert _check(server, models[2][1], p, "policy") == v3
    base = Reference(server.model_dir)
    _check(server, base, PROMPTS[0], "tiny-policy")


def test_a_prompt_logprobs_request_beside_a_stream_runs_alone_and_is_answered_exactly(
        lora_server):
    """vLLM's CPU build kills its engine when a LoRA model computes prompt logprobs beside
    other requests in one batch (vLLM issues 16668, 29955; with the guard off this request
    gets a 500 and the engine is gone). The server runs such a request alone
    (``--prompt-logprobs-alone``, on by default with ``--enable-lora`` on CPU): sent while a
    base-model stream runs (vLLM would batch it with the stream at once), it waits for the
    stream, is answered with the merged model's prompt logprobs and greedy tokens, and the
    engine keeps serving. When the answer came is not compared with when the stream's end was
    read: this process reads the stream's 3200 events behind the server, so its clock cannot
    order the two (the answer has been read 23-34 ms before the stream's last event was)."""
    model, merged, _ = _policy(lora_server.model_dir, seed=10)
    _push(lora_server, model)
    reader, out, first = _reading(lora_server.url, {**BASE_STREAM, "n": 16})
    assert first.wait(120) and "ended" not in out  # the stream is in flight
    answer = served(lora_server, PROMPTS[1], model="policy")  # asks for prompt logprobs
    reader.join(300)
    assert out["status"] == 200 and len(out["versions"]) == 1  # the stream ran on one version
    _verify(merged, *answer)  # prompt logprobs, greedy, exact
    assert httpx.get(lora_server.url + "/health", timeout=10).status_code == 200
    _check(lora_server, merged, PROMPTS[0], "policy")  # and it serves on
