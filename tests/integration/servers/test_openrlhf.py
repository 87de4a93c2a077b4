"""OpenRLHF's remote reward model protocol on the reward server: ``POST /get_reward`` sent the
way OpenRLHF's trainer sends it (a plain HTTP POST of ``{"query", "prompts", "labels"}``),
answered with ``{"rewards", "scores", "extra_logs"}`` equal to transformers' scores (float32);
malformed bodies get a 400 naming the field and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from _hf_reward import HFReward

pytestmark = pytest.mark.slow

QUERIES = ["Question: what is 2 + 2? Answer: 4.", "The model is helpful today.",
           "hi", "A policy was rude according to the judge!"]


@pytest.fixture(scope="module")
def server(reward_server):
    version = reward_server.restore()  # base weights: what transformers loads
    return reward_server, version, HFReward(reward_server.model_dir)


def test_get_reward_answers_openrlhf_with_transformers_scores(server):
    srv, version, hf = server
    body = {"query": QUERIES, "prompts": [q[:10] for q in QUERIES], "labels": ["", "", "", ""]}
    r = httpx.post(srv.url + "/get_reward", json=body, timeout=60)  # no token: like /score
    assert r.status_code == 200, r.text
    out = r.json()
    want = hf.scores(QUERIES)
    assert out["rewards"] == pytest.approx(want, abs=1e-4)
    assert out["scores"] == out["rewards"]
    assert out["extra_logs"] == {"weight_version": [version] * len(QUERIES)}
    assert out["version"] == version and r.headers["x-weight-version"] == str(version)
    only_query = httpx.post(srv.url + "/get_reward", json={"query": QUERIES[:1]}, timeout=60)
    assert only_query.json()["rewards"] == pytest.approx(want[:1], abs=1e-4)


@pytest.mark.parametrize(("body", "message"), [
    ({}, "query: missing"),
    ({"query": "one text"}, "query: must be a non-empty list of strings, got str"),
    ({"query": []}, "query: must be a non-empty list of strings, got an empty list"),
    ({"query": ["ok", 3, ""]}, r"query: items \[1, 2\] are not non-empty strings"),
    ({"query": ["a", "b"], "labels": ["x"]}, r"labels: must be a list with one entry per query \(2\), got 1 items"),
    ({"query": ["a"], "prompts": "a"}, r"prompts: must be a list with one entry per query \(1\), got str"),
    ({"query": ["a"], "querys": ["b"]}, r"unknown field\(s\) \['querys'\]; /get_reward takes query"),
])
def test_malformed_get_reward_bodies_are_named_and_the_server_keeps_serving(server, body, message):
    import re

    srv, _, hf = server
    r = httpx.post(srv.url + "/get_reward", json=body, timeout=60)
    assert r.status_code == 400 and re.search(message, r.json()["detail"]), r.text
    ok = httpx.post(srv.url + "/get_reward", json={"query": QUERIES[:2]}, timeout=60)
    assert ok.status_code == 200 and ok.json()["rewards"] == pytest.approx(hf.scores(QUERIES[:2]),
                                                                          abs=1e-4)


def test_get_reward_refuses_a_body_that_is_not_json(server):
    srv, _, _ = server
    r = httpx.post(srv.url + "/get_reward", content=b"{query: [", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
