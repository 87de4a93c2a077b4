"""The reward server on real vLLM (CPU) over real HTTP, synced through real strategies.

One server for the whole session (``reward_server`` in conftest). Reference scores come from a
transformers forward of the same weights.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time

import httpx
import pytest
import torch

import weightsync as ws
from weightsync.errors import UpdateIncompleteError, WeightMismatchError, WeightSyncError
from weightsync.reward import RewardModelTrainingMode, ScoringRequest, VLLMRewardClient
from weightsync.types import WeightChunk

pytestmark = pytest.mark.slow

TEXTS = [
    "The model is helpful today.",
    "hi",
    "A policy was rude according to the judge!",
    "Question: what is 2 + 2? Answer: 4.",
    "def add(a, b):\n    return a + b",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(reward_server):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_server.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_server.model_dir).eval()
    return tok, model


def hf_scores(tok, model, texts, *, batched=True) -> list[list[float]]:
    with torch.no_grad():
        if batched:
            enc = tok(texts, padding=True, return_tensors="pt")
            return model(**enc).logits.tolist()
        return [model(**tok(t, return_tensors="pt")).logits[0].tolist() for t in texts]


def flat(scores):
    return [s if isinstance(s, float) else s[0] for s in scores]


def max_err(served, ref) -> float:
    return max(abs(a - b[0]) for a, b in zip(flat(served), ref, strict=True))


def perturbed(model, seed: int, *, head_only: bool = False) -> dict[str, torch.Tensor]:
    """New weights: every parameter (or only the head) moved by seeded noise, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if head_only and not name.startswith("score."):
                continue
            p.add_(torch.randn(p.shape, generator=g) * (0.5 if name.startswith("score.") else 0.02))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(coro):
    return asyncio.run(coro)


async def push(client, params, **kwargs):
    """``sync_weights_async`` and the ``SyncStats`` of that update (the call returns what the
    reference returns: the version given, else ``"rm-<unix time>"``; the stats say what moved
    and which version the server serves)."""
    returned = await client.sync_weights_async(params, **kwargs)
    stats = client.last_sync_stats
    if kwargs.get("version"):
        assert returned == str(kwargs["version"]) == str(stats.versions[0])
    else:
        assert returned.startswith("rm-") and abs(int(returned[3:]) - time.time()) < 600
    return stats


@pytest.fixture(scope="module")
def restored(reward_server):
    reward_server.restore()
    return reward_server


# --------------------------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------------------------


def test_health_exact(reward_server):
    r = httpx.get(reward_server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "type": "reward_model"}


def test_the_server_warmed_up_before_it_served(reward_server):
    """``--warmup`` (on by default): one text scored before the server answers, logged."""
    import re

    if reward_server.process is None:
        pytest.skip("a server started outside the tests: its log is not here")
    assert re.search(r"warm-up \(one text scored\) took [\d.]+s", reward_server.log_text())


def test_scores_equal_transformers_single_and_batched(restored, hf):
    tok, model = hf
    ref = hf_scores(tok, model, TEXTS, batched=False)
    assert max_err([r[0] for r in ref], hf_scores(tok, model, TEXTS, batched=True)) <= 1e-5

    r = httpx.post(restored.url + "/score", json={"input": TEXTS, "normalize": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model", "data", "usage", "version", "pooling_type"}
    assert body["pooling_type"] == "last"
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert all(isinstance(d["score"], float) for d in body["data"])  # one label: a float
    assert max_err([d["score"] for d in body["data"]], ref) <= TOL
    assert body["usage"]["prompt_tokens"] == sum(len(tok(t).input_ids) for t in TEXTS)

    for i, text in enumerate(TEXTS[:2]):  # single string input
        r = httpx.post(restored.url + "/score", json={"input": text, "normalize": False})
        assert r.status_code == 200
        (d,) = r.json()["data"]
        assert abs(d["score"] - ref[i][0]) <= TOL


def test_normalize_by_default_raw_logits_on_request(restored):
    """The design's default ``normalize=True`` is the sigmoid of the raw logit; ``false`` (or
    vLLM's ``use_activation: false``) gives the logit."""
    raw = httpx.post(restored.url + "/score", json={"input": TEXTS[:3], "normalize": False}).json()
    also_raw = httpx.post(restored.url + "/score",
                          json={"input": TEXTS[:3], "use_activation": False}).json()
    act = httpx.post(restored.url + "/score", json={"input": TEXTS[:3]}).json()
    assert also_raw["data"] == raw["data"]
    for a, b in zip(raw["data"], act["data"], strict=True):
        assert b["score"] == pytest.approx(1 / (1 + math.exp(-a["score"])), abs=1e-5)
        assert a["score"] != pytest.approx(b["score"], abs=1e-3)


def test_client_score_and_batch(restored, hf):
    tok, model = hf
    ref = hf_scores(tok, model, TEXTS)

    async def go():
        async with restored.client(max_batch_size=2) as c:
            resp, info = await c.score(ScoringRequest(inputs=TEXTS, normalize=False))
            batch = await c.score_batch(TEXTS, normalize=False)
            activated = await c.score_batch(TEXTS)  # the design's default: the activation
            return resp, info, batch, activated, await c.get_model_version()

    resp, info, batch, activated, version = run(go())
    assert resp.version == version and info["status"] == 200 and info["latency_s"] > 0
    assert info["raw_response"]["version"] == version and info["request"]["normalize"] is False
    assert max_err(resp.scores, ref) <= TOL and max_err(batch, ref) <= TOL
    assert max(abs(a - 1 / (1 + math.exp(-r[0]))) for a, r in zip(activated, ref, strict=True)
               ) <= 1e-5

    c = restored.client()
    try:
        assert max_err(c.score_batch_sync(TEXTS, normalize=False), ref) <= TOL
    finally:
        c.close_sync()


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"input": []}, 400, "input: empty list"),
        ({"input": ["ok", 3]}, 400, "items must be strings"),
        ({"input": 7}, 400, "input: must be a string or a list"),
        ({"input": "x", "use_activation": "yes"}, 400, "use_activation"),
        ({"input": ["x", ""]}, 400, "empty strings"),
        ({"inputz": ["x"]}, 400, "unknown field"),
        ({"input": "x", "model": "someone-else"}, 404, "not served here"),
        ({"input": "x " * 400}, 400, "input[0]"),  # longer than max_model_len
    ],
)
def test_bad_score_input_is_4xx_and_changes_nothing(restored, body, status, needle):
    before = httpx.get(restored.url + "/runtime_version").json()["version"]
    r = httpx.post(restored.url + "/score", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert httpx.get(restored.url + "/runtime_version").json()["version"] == before
    assert httpx.post(restored.url + "/score", json={"input": "still fine"}).status_code == 200


def test_score_body_not_json(restored):
    r = httpx.post(restored.url + "/score", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]


# --------------------------------------------------------------------------------------------
# auth
# --------------------------------------------------------------------------------------------

GUARDED = [
    ("GET", "/get_world_size", None),
    ("POST", "/init_communicator", {"strategy": {}, "sync_info": {}}),
    ("POST", "/update_param_batch", {"metadata": {"type": "start", "update_id": "x"}}),
    ("POST", "/close_communicator", {}),
    ("POST", "/get_num_background_tasks", {}),
    ("POST", "/reset_prefix_cache", {}),
]


@pytest.mark.parametrize("method, path, body", GUARDED)
def test_control_endpoints_need_the_token(reward_server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}):
        r = httpx.request(method, reward_server.url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
    assert httpx.get(reward_server.url + "/runtime_version").status_code == 200  # open


def test_token_opens_the_harmless_endpoints(reward_server):
    h = {"Authorization": f"Bearer {reward_server.api_key}"}
    assert httpx.get(reward_server.url + "/get_world_size", headers=h).json() == {"world_size": 1}
    r = httpx.post(reward_server.url + "/get_num_background_tasks", headers={"X-API-Key": reward_server.api_key})
    assert r.status_code == 200 and r.json()["num_background_tasks"] >= 0
    assert httpx.post(reward_server.url + "/reset_prefix_cache", headers=h).json()["ok"] is True


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"metadata": "start"}, "metadata: expected an object"),
        ({"metadata": {"update_id": "x"}}, "metadata.type"),
        ({"metadata": {"type": "start", "update_id": "x"}, "training_mode": "partial"}, "training_mode"),
        ({"metadata": {"type": "start", "update_id": "x"}, "version": "3"}, "version: expected an integer"),
        ({"metadata": {"type": "start", "update_id": "x"}, "extra": 1}, "unknown field"),
        ({"metadata": {"type": "start", "update_id": "x", "manifest": [{"name": "score.weight"}]}},
         "metadata"),
        ({"metadata": {"type": "broadcast", "update_id": "nope", "names": [], "dtypes": [], "shapes": []}},
         "without its start"),
    ],
)
def test_bad_update_fields_are_4xx(restored, body, needle):
    h = {"Authorization": f"Bearer {restored.api_key}"}
    before = httpx.get(restored.url + "/runtime_version").json()
    r = httpx.post(restored.url + "/update_param_batch", json=body, headers=h)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["detail"], r.json()
    assert httpx.get(restored.url + "/runtime_version").json() == before


# --------------------------------------------------------------------------------------------
# weight sync
# --------------------------------------------------------------------------------------------


def test_sync_full_then_head_only_matches_transformers(restored, hf):
    from transformers import AutoModelForSequenceClassification

    tok, _ = hf
    model = AutoModelForSequenceClassification.from_pretrained(restored.model_dir).eval()

    async def go():
        async with restored.client() as c:
            v0 = await c.get_model_version()
            full = perturbed(model, seed=1)
            stats = await push(c, full)  # FULL is the default
            r1, _ = await c.score(ScoringRequest(inputs=TEXTS, normalize=False))
            head = perturbed(model, seed=2, head_only=True)
            stats2 = await push(c, {"score.weight": head["score.weight"]},
                                          training_mode=RewardModelTrainingMode.HEAD_ONLY)
            r2, _ = await c.score(ScoringRequest(inputs=TEXTS, normalize=False))
            return v0, stats, r1, stats2, r2

    v0, stats, r1, stats2, r2 = run(go())
    assert stats.versions == [v0 + 1] and r1.version == v0 + 1
    assert stats2.versions == [v0 + 2] and r2.version == v0 + 2
    assert stats.num_tensors == len(dict(model.named_parameters())) and stats2.num_tensors == 1
    ref = hf_scores(tok, model, TEXTS)
    assert max_err(r2.scores, ref) <= TOL
    # the full sync already moved the scores away from the base model
    assert max(abs(a - b) for a, b in zip(flat(r1.scores), flat(r2.scores), strict=True)) > 1e-3


@pytest.mark.parametrize(
    "strategy",
    [
        {"type": "broadcast", "backend": "gloo", "bucket_size_mb": 0.01},
        {"type": "cuda_ipc", "bucket_size_mb": 0.01},
        {"type": "packed_cuda_ipc", "bucket_size_mb": 0.02},
    ],
    ids=["broadcast-gloo", "shm-ipc", "packed-shm-ipc"],
)
def test_every_strategy_small_buckets(restored, hf, strategy):
    """Tiny buckets split q/k/v and gate/up across chunks: the loader keeps vLLM layers whole."""
    from transformers import AutoModelForSequenceClassification

    tok, _ = hf
    model = AutoModelForSequenceClassification.from_pretrained(restored.model_dir).eval()
    new = perturbed(model, seed=11)

    async def go():
        async with restored.client(strategy=strategy) as c:
            stats = await push(c, new)
            return stats, (await c.score(ScoringRequest(inputs=TEXTS, normalize=False)))[0]

    stats, resp = run(go())
    assert stats.num_chunks > 5
    assert resp.version == stats.versions[0]
    assert max_err(resp.scores, hf_scores(tok, model, TEXTS)) <= TOL


BAD_UPDATES = [
    ({"model.layers.0.mlp.up_proj.weightz": torch.zeros(128, 64)}, "full", "not a parameter"),
    ({"model.norm.weight": torch.zeros(65)}, "full", "shape [65] but target has [64]"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.float16)}, "full", "dtype float16"),
    ({"model.norm.weight": torch.zeros(64)}, "head_only", "not a head parameter"),
    ({"score.weight": torch.zeros(1, 64)}, "full", "full mode requires backbone"),
    ({"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(8, 64)}, "lora",
     "unmerged LoRA"),
    ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, "full",
     "loads a layer whole"),
]


@pytest.mark.parametrize("params, mode, needle", BAD_UPDATES)
def test_bad_updates_refused_before_any_byte(restored, params, mode, needle):
    """Refused by the server (the client-side mode check is bypassed) with the offender named;
    model and version untouched."""
    h = {"Authorization": f"Bearer {restored.api_key}"}
    before_v = httpx.get(restored.url + "/runtime_version").json()["version"]
    before = httpx.post(restored.url + "/score", json={"input": TEXTS, "normalize": False}).json()["data"]
    manifest = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                for n, t in params.items()]
    r = httpx.post(restored.url + "/update_param_batch", headers=h, json={
        "metadata": {"type": "start", "update_id": f"bad-{mode}", "manifest": manifest},
        "training_mode": mode,
    })
    assert r.status_code == 400, r.text
    assert any(needle in o for o in r.json()["offenders"]), r.json()

    async def through_client():  # the same refusal through the framework (client check off)
        async with restored.client() as c:
            import weightsync.reward.client as client_mod

            orig = client_mod.select_params
            client_mod.select_params = lambda p, *a, **k: list(p.items())  # server must refuse
            try:
                await push(c, params, training_mode=mode)
            finally:
                client_mod.select_params = orig

    with pytest.raises(WeightMismatchError) as ei:
        run(through_client())
    assert any(needle in o for o in ei.value.offenders)
    assert httpx.get(restored.url + "/runtime_version").json()["version"] == before_v
    assert httpx.post(restored.url + "/score", json={"input": TEXTS, "normalize": False}).json()["data"] == before


def test_client_refuses_mode_violations_locally(reward_server):
    c = reward_server.client()
    try:
        with pytest.raises(WeightMismatchError, match="not a head parameter"):
            c.sync_weights({"model.norm.weight": torch.zeros(64)}, training_mode="head_only")
        with pytest.raises(WeightMismatchError, match="unmerged LoRA tensor; publish the PEFT"):
            c.sync_weights({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default"
                            ".weight": torch.zeros(8, 64)}, training_mode="lora")
        with pytest.raises(ValueError, match="nothing to send"):
            c.sync_weights({})
    finally:
        c.close_sync()
    off = VLLMRewardClient(port=reward_server.port)  # the design's default: scoring only
    with pytest.raises(WeightSyncError, match="enable_weight_updates=True"):
        off.sync_weights({"score.weight": torch.zeros(1, 64)})


def test_sync_is_blocking_returns_the_references_answer_and_normalises_names(restored, hf):
    """The blocking ``sync_weights``: FSDP / DDP / PEFT wrapper names become engine names; a
    HEAD_ONLY sync of a whole state dict sends it all (the reference client's) and warns."""
    from transformers import AutoModelForSequenceClassification

    from weightsync.reward.selection import TrainingModeWarning

    tok, _ = hf
    model = AutoModelForSequenceClassification.from_pretrained(restored.model_dir).eval()
    new = perturbed(model, seed=41)
    wrapped = {}
    for i, (n, t) in enumerate(new.items()):  # the names three kinds of trainer would hold
        prefix = ("module.", "base_model.model.", "_fsdp_wrapped_module.")[i % 3]
        wrapped[prefix + n] = t
    c = restored.client()
    try:
        v0 = int(httpx.get(restored.url + "/runtime_version").json()["version"])
        assert c.sync_weights(wrapped).startswith("rm-")  # no version: the reference's answer
        assert c.last_sync_stats.versions == [v0 + 1]
        assert c.last_sync_stats.num_tensors == len(new)
        ref = hf_scores(tok, model, TEXTS)
        assert max_err(c.score_batch_sync(TEXTS, normalize=False), ref) <= TOL
        head = perturbed(model, seed=42, head_only=True)  # the whole state dict, head moved
        with pytest.warns(TrainingModeWarning, match=r"sent the 1 head tensor\(s\) .* sent "
                                                     r"\d+ other\(s\) as well \(a full update\): "
                                                     r"model\.embed_tokens"):
            assert c.sync_weights(head, training_mode="head_only", version=v0 + 2) == str(v0 + 2)
        assert c.last_sync_stats.num_tensors == len(head)
        assert c.last_sync_stats.versions == [v0 + 2]
        assert max_err(c.score_batch_sync(TEXTS, normalize=False),
                       hf_scores(tok, model, TEXTS)) <= TOL
    finally:
        c.close_sync()


def test_torn_update_answers_503_until_a_complete_one_lands(restored, hf):
    """A sender that dies after the first chunk landed: the server refuses to score (no silent
    mix of old and new weights) and serves again after the next complete sync."""
    from transformers import AutoModelForSequenceClassification

    tok, _ = hf
    model = AutoModelForSequenceClassification.from_pretrained(restored.model_dir).eval()
    new = perturbed(model, seed=21)
    names = list(new)

    chunks = [WeightChunk(names[:3], [new[n] for n in names[:3]]),
              WeightChunk(names[3:6], [new[n] for n in names[3:6]])]
    whole = WeightChunk(names, [new[n] for n in names])  # the update's manifest: every tensor

    async def dying_chunks():
        for chunk in chunks:
            yield chunk
        await asyncio.sleep(2)  # the pipeline prefetches: let the first chunk land first
        raise RuntimeError("trainer died")

    async def go():
        async with restored.client(strategy={"type": "cuda_ipc"}) as c:
            v0 = await c.get_model_version()
            async with ws.connect([restored.url], "cuda_ipc", api_key=restored.api_key) as sync:
                with pytest.raises(RuntimeError, match="trainer died"):
                    await sync.push_chunks(dying_chunks(), whole.metas())  # dies part-way
            state = httpx.get(restored.url + "/runtime_version").json()
            r = httpx.post(restored.url + "/score", json={"input": TEXTS, "normalize": False})
            with pytest.raises(UpdateIncompleteError, match="incomplete"):
                await c.score(ScoringRequest(inputs=TEXTS, normalize=False))
            stats = await push(c, new)
            resp, _ = await c.score(ScoringRequest(inputs=TEXTS, normalize=False))
            return v0, state, r, stats, resp

    v0, state, r, stats, resp = run(go())
    assert state["state"] == "torn" and state["version"] == v0
    assert r.status_code == 503 and "trainer died" in r.json()["detail"]
    assert stats.versions == [v0 + 1] and resp.version == v0 + 1
    assert max_err(resp.scores, hf_scores(tok, model, TEXTS)) <= TOL


def test_abandoned_update_is_superseded_by_the_next_sync(restored):
    """A sender that started an update and vanished holds the update gate; the next sync
    aborts it (nothing had landed, so nothing is torn) and goes through."""
    from safetensors.torch import load_file

    base = load_file(os.path.join(restored.model_dir, "model.safetensors"))
    h = {"Authorization": f"Bearer {restored.api_key}"}
    v0 = httpx.get(restored.url + "/runtime_version").json()["version"]
    manifest = [{"name": "score.weight", "dtype": "float32", "shape": [1, 64]}]
    r = httpx.post(restored.url + "/update_param_batch", headers=h, json={
        "metadata": {"type": "start", "update_id": "abandoned", "manifest": manifest},
        "training_mode": "head_only"})
    assert r.status_code == 200, r.text
    state = httpx.get(restored.url + "/runtime_version").json()
    assert state["update_in_progress"] == "abandoned" and state["state"] == "updating"
    tasks = httpx.post(restored.url + "/get_num_background_tasks", headers=h).json()
    assert tasks["num_background_tasks"] >= 1

    async def go():
        async with restored.client() as c:
            return await push(c, {"score.weight": base["score.weight"]},
                                        training_mode="head_only")

    stats = run(go())
    assert stats.versions == [v0 + 1]
    state = httpx.get(restored.url + "/runtime_version").json()
    assert state == {"version": v0 + 1, "state": "ready", "update_in_progress": None}
    assert httpx.post(restored.url + "/score", json={"input": "ok"}).json()["version"] == v0 + 1


def test_explicit_versions_and_replaced_communicator(restored):
    """version= is published as given (and must rise); a client whose communicator was taken by
    another client re-joins on its next sync."""
    from safetensors.torch import load_file

    base = load_file(os.path.join(restored.model_dir, "model.safetensors"))
    head = {"score.weight": base["score.weight"]}

    async def go():
        a, b = restored.client(), restored.client()
        try:
            v = await a.get_model_version()
            sa = await push(a, head, version=v + 10, training_mode="head_only")
            with pytest.raises(Exception, match="not newer"):
                await push(b, head, version=v + 5, training_mode="head_only")
            sb = await push(b, head, training_mode="head_only")  # b took the receivers
            sa2 = await push(a, head, training_mode="head_only")  # a re-joins
            return v, sa, sb, sa2
        finally:
            await a.close()
            await b.close()

    v, sa, sb, sa2 = run(go())
    assert sa.versions == [v + 10] and sb.versions == [v + 11] and sa2.versions == [v + 12]


def test_scores_during_syncs_never_mix_versions(restored, hf):
    """A scorer thread hammers /score while the trainer alternates two weight sets: every
    response equals transformers on exactly the weight set of the version it reports."""
    from transformers import AutoModelForSequenceClassification

    tok, _ = hf
    model = AutoModelForSequenceClassification.from_pretrained(restored.model_dir).eval()
    sets, refs = [], []
    for seed in (31, 32):
        sets.append(perturbed(model, seed=seed))
        refs.append(hf_scores(tok, model, TEXTS))
    assert max_err(flat([r[0] for r in refs[0]]), refs[1]) > 1e-2

    seen: list[tuple[int, list[float]]] = []
    errors: list[str] = []
    stop = threading.Event()

    def scorer():
        with httpx.Client() as h:
            while not stop.is_set():
                r = h.post(restored.url + "/score", json={"input": TEXTS, "normalize": False}, timeout=60)
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                seen.append((r.json()["version"], [d["score"] for d in r.json()["data"]]))

    async def scored_twice_more() -> None:
        # the scorer is sequential, so the second response that ends after a sync was
        # started after it: every version gets at least one checked response, however slow
        # the machine (CI on 2 cores saw only 4 responses in 8 back-to-back syncs)
        target = len(seen) + 2
        deadline = time.monotonic() + 60
        while len(seen) < target and not errors and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def trainer():
        async with restored.client() as c:
            versions = {}
            for i in range(8):
                stats = await push(c, sets[i % 2])
                versions[stats.versions[0]] = i % 2
                await scored_twice_more()
            return versions

    t = threading.Thread(target=scorer)
    t.start()
    try:
        versions = run(trainer())
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors
    checked = 0
    for v, scores in seen:
        if v in versions:
            assert max_err(scores, refs[versions[v]]) <= TOL, (v, scores)
            checked += 1
    assert checked >= 8, (checked, len(seen))
    assert len({v for v, _ in seen} & set(versions)) == 8  # every synced version was served


def test_restore_base_weights_for_other_tests(restored, hf):
    tok, model = hf
    restored.restore()
    r = httpx.post(restored.url + "/score", json={"input": TEXTS, "normalize": False}).json()
    assert max_err([d["score"] for d in r["data"]], hf_scores(tok, model, TEXTS)) <= TOL


# --------------------------------------------------------------------------------------------
# tokenizer check, scorer against the server
# --------------------------------------------------------------------------------------------


def test_tokenizer_check_passes_for_the_models_tokenizer_and_fails_fast_otherwise(restored, hf):
    from weightsync.reward.client import TokenizerMismatchError
    from weightsync.testing.tiny_models import build_tokenizer

    tok, model = hf
    good = restored.client(tokenizer=restored.model_dir)  # a path: loaded with AutoTokenizer
    try:
        assert max_err(good.score_batch_sync(TEXTS, normalize=False), hf_scores(tok, model, TEXTS)) <= TOL
    finally:
        good.close_sync()
    other = build_tokenizer(vocab_size=300)  # a real tokenizer, another vocabulary
    mismatch = r"probe 'The quick brown fox.*' is \d+ tokens .* on the server"
    with pytest.raises(TokenizerMismatchError, match=mismatch):
        restored.client(tokenizer=other)  # weight updates on: checked while it connects
    with pytest.raises(TokenizerMismatchError, match=mismatch):
        restored.client(tokenizer=other, enable_weight_updates=False)  # scoring-only: at init too
    assert httpx.get(restored.url + "/runtime_version").json()["state"] == "ready"


def test_scorer_keeps_requests_in_flight_and_order(restored, hf):
    """``RewardModelScorer`` over the real client: with 4 batches in flight the run takes well
    under the sum of its requests' latencies (they overlap), one at a time it does not; the
    scores land on the right rollouts. Latencies are read from the client's own ``info``
    (a recording wrapper; the requests are real)."""
    from weightsync.reward import RewardModelScorer, Rollout, Step, rollout_text

    tok, model = hf
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(8)]
    answers = [" It is four.", " no idea", " Answer: 8", " 42!"]

    def batch():
        return [Rollout(f"r{i}", [Step(0, prompts[i % 8], answers[i % 4])],
                        {"initial_obs": prompts[i % 8]}) for i in range(32)]

    async def run_scorer(concurrency):
        async with restored.client() as c:
            latencies = []
            real = c.score

            async def timed(request):
                resp, info = await real(request)
                latencies.append(info["latency_s"])
                return resp, info

            c.score = timed
            await c.wait_for_server()
            rollouts = batch()
            t0 = time.perf_counter()
            await RewardModelScorer(c, batch_size=4, max_concurrency=concurrency).score(rollouts)
            return rollouts, time.perf_counter() - t0, latencies

    rollouts, wall, lat = run(run_scorer(4))
    assert len(lat) == 8
    assert wall < 0.7 * sum(lat), (wall, lat)
    _, wall1, lat1 = run(run_scorer(1))
    assert wall1 >= 0.95 * sum(lat1), (wall1, lat1)  # sequential: no overlap to gain
    ref = hf_scores(tok, model, [rollout_text(r, r.steps) for r in rollouts])
    assert max_err([r.meta["rm_score"] for r in rollouts], ref) <= TOL
    assert len({r.meta["rm_score_version"] for r in rollouts}) == 1
