"""vLLM's own OpenAI app on the reward server: ``/classify`` exactly as vLLM defines it (what
verl's discriminative reward-model client calls), ``/pooling``, ``/v1/models``, sent by plain
HTTP clients; scores equal transformers' (float32); every model route carries the weight
version; routes the model cannot serve are absent."""

from __future__ import annotations

import math

import httpx
import pytest
from _hf_reward import HFReward

pytestmark = pytest.mark.slow

TEXTS = ["user: What is 3 + 4?\nassistant: #### 7\n", "The model is helpful today.", "hi"]


@pytest.fixture(scope="module")
def server(reward_server):
    version = reward_server.restore()
    return reward_server, version, HFReward(reward_server.model_dir)


def test_classify_in_vllms_shape_equals_transformers(server):
    srv, version, hf = server
    want = hf.scores(TEXTS)
    body = {"model": srv.model_dir, "input": TEXTS, "use_activation": False}
    r = httpx.post(srv.url + "/classify", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    assert [d["probs"][0] for d in out["data"]] == pytest.approx(want, abs=1e-4)
    assert all(d["num_classes"] == 1 for d in out["data"])
    assert r.headers["x-weight-version"] == str(version) and out["weight_version"] == version
    # verl's reward loop: one text per request, the score is data[-1].probs[-1]
    one = httpx.post(srv.url + "/classify", timeout=60, json={
        "model": srv.model_dir, "input": TEXTS[0], "use_activation": False}).json()
    assert one["data"][-1]["probs"][-1] == pytest.approx(want[0], abs=1e-4)
    # vLLM's default (and verl's older "activation": false, a field vLLM 0.32 no longer
    # reads): the model's activation, a sigmoid for one label
    old = httpx.post(srv.url + "/classify", timeout=60, json={
        "model": srv.model_dir, "input": TEXTS[0], "activation": False}).json()
    assert old["data"][0]["probs"][0] == pytest.approx(1 / (1 + math.exp(-want[0])), abs=1e-4)


def test_pooling_and_models_routes(server):
    srv, version, hf = server
    models = httpx.get(srv.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [srv.model_dir]
    r = httpx.post(srv.url + "/pooling", timeout=60, json={
        "model": srv.model_dir, "input": TEXTS[1], "task": "classify", "use_activation": False})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["data"][0] == pytest.approx(hf.scores(TEXTS[1:2])[0], abs=1e-4)
    assert r.headers["x-weight-version"] == str(version)
    # a classification model has no embedding task: the route is not served
    assert httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=30).status_code == 404
    # vLLM answers bad input itself, with its own error shape
    bad = httpx.post(srv.url + "/classify", json={"model": srv.model_dir}, timeout=30)
    assert bad.status_code in (400, 422)
    wrong = httpx.post(srv.url + "/classify", json={"model": "no-such-model", "input": "x"},
                       timeout=30)
    assert wrong.status_code == 404 and "no-such-model" in wrong.text


def test_vllm_routes_hold_the_update_gate(server, reward_server):
    """A push publishes a new version; vLLM's routes then answer with it (they ran behind the
    gate, so never with a mix)."""
    srv, _, hf = server
    after = reward_server.restore()  # same weights, next version
    r = httpx.post(srv.url + "/classify", timeout=60, json={
        "model": srv.model_dir, "input": TEXTS[2], "use_activation": False})
    assert r.headers["x-weight-version"] == str(after)
    assert r.json()["data"][0]["probs"][0] == pytest.approx(hf.scores(TEXTS[2:])[0], abs=1e-4)
