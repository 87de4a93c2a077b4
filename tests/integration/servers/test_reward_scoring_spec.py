"""``POST /score`` speaks the reward design's request fields, and scores process-reward steps on
the server (vLLM's token pooler), on the shared session reward server (1 label, token pooling
ALL: this server picks the step-tag positions).

* Every field of the design's request does what the server says (or is refused naming it).
* A trainer written from the design documents alone (plain HTTP + a vLLM stateless gloo group,
  no weightsync client) pushes weights through ``{host, port, world_size}`` /
  ``{metadata, version, training_mode}`` and scores with the design's fields; the served scores
  equal transformers' for the pushed weights.
* ``pooling_type="step"``: the score at each step tag equals the score of the prefix up to it
  (one request per text instead of one per prefix), and ``RewardModelScorer(step_tag=...)``
  writes the same step scores as the prefix path with one text per rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch

from weightsync.reward import RewardModelScorer, Rollout, ScoringRequest, Step
from weightsync.testing.tiny_models import STEP_TOKEN

pytestmark = pytest.mark.slow

TEXTS = ["The model is helpful today.", "hi", "Question: what is 2 + 2? Answer: 4."]
TOL = 1e-4
STEPPED = [
    f"Question: 2 + 2?{STEP_TOKEN}\nThink: two and two.{STEP_TOKEN}\nAnswer: 4.{STEP_TOKEN}",
    f"hi{STEP_TOKEN}",
    "no tag at all",
]


@pytest.fixture(scope="module")
def restored(reward_server):
    reward_server.restore()
    return reward_server


@pytest.fixture(scope="module")
def hf(reward_server):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_server.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_server.model_dir).eval()
    return tok, model


def hf_logits(tok, model, texts, state_dict=None) -> list[float]:
    if state_dict is not None:
        model = type(model)(model.config).eval()
        model.load_state_dict(state_dict)
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def hf_token_logits(tok, model, text) -> tuple[list[int], list[float]]:
    """Per-token head outputs of one text (what the token pooler returns), and its ids."""
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model.model(**enc).last_hidden_state
        per_token = model.score(hidden)[0, :, 0]
    return enc.input_ids[0].tolist(), per_token.tolist()


def post(url, body):
    return httpx.post(url + "/score", json=body, timeout=60)


# --------------------------------------------------------------------------------------------
# the design's request fields
# --------------------------------------------------------------------------------------------


def test_designs_request_fields_and_defaults(restored, hf):
    ref = hf_logits(*hf, TEXTS)
    spec = {"model": "reward-model", "input": TEXTS, "pooling_type": "last", "normalize": True}
    r = post(restored.url, spec)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    sig = [1 / (1 + math.exp(-x)) for x in ref]
    assert max(abs(d["score"] - s) for d, s in zip(body["data"], sig, strict=True)) <= 1e-5
    assert int(r.headers["x-weight-version"]) == body["version"]
    # only model + input (the design's table): normalize defaults to true
    assert post(restored.url, {"model": "reward-model", "input": TEXTS}).json()["data"] == body["data"]
    raw = post(restored.url, {**spec, "normalize": False, "return_hidden_states": False,
                              "n_labels": 1}).json()
    assert max(abs(d["score"] - x) for d, x in zip(raw["data"], ref, strict=True)) <= TOL
    served = post(restored.url, {"input": TEXTS[0], "model": body["model"], "normalize": False})
    assert abs(served.json()["data"][0]["score"] - ref[0]) <= TOL  # the served name works too


def test_pooling_per_request_and_hidden_states_flag_as_the_reference(restored, hf):
    """The reference's client sends ``pooling_type`` with every request and its server takes
    ``return_hidden_states``: a sequence pooling other than the engine's (LAST here) is pooled
    over the head's per-token outputs, equal to transformers' (the head is linear), with the
    activation after pooling; the hidden-states flag is accepted (no hidden states come back)."""
    tok, model = hf
    for text in TEXTS:
        _, per_token = hf_token_logits(tok, model, text)
        want = {"last": per_token[-1], "mean": sum(per_token) / len(per_token),
                "cls": per_token[0]}
        for pooling, logit in want.items():
            raw = post(restored.url, {"input": text, "pooling_type": pooling, "normalize": False})
            assert raw.status_code == 200, raw.text
            assert raw.json()["pooling_type"] == pooling
            assert raw.json()["data"][0]["score"] == pytest.approx(logit, abs=TOL), pooling
            act = post(restored.url, {"input": text, "pooling_type": pooling,
                                      "return_hidden_states": True}).json()
            assert act["data"][0]["score"] == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-5)
            assert "hidden_states" not in act
    assert want["mean"] != pytest.approx(want["last"], abs=1e-3)  # the poolings do differ


@pytest.mark.parametrize(
    "extra, status, needle",
    [
        ({"pooling_type": "max"}, 400, "pooling_type must be one of"),
        ({"n_labels": 3}, 400, "n_labels: the request expects 3, the served model has 1"),
        ({"normalize": True, "use_activation": False}, 400, "disagree"),
        ({"model": "another-model"}, 404, "also answering to 'reward-model'"),
        ({"pooling_type": "step"}, 400, "needs a step tag"),
        ({"pooling_type": "step", "step_tag": "two tokens"}, 400, "must be exactly one token"),
        ({"pooling_type": "step", "step_tag": STEP_TOKEN, "step_tag_id": 5}, 400, "send one"),
        ({"step_tag": STEP_TOKEN}, 400, "only with pooling_type='step'"),
    ],
)
def test_fields_this_server_cannot_honour_are_refused_by_name(restored, extra, status, needle):
    v = httpx.get(restored.url + "/runtime_version").json()["version"]
    r = post(restored.url, {"input": TEXTS, **extra})
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert httpx.get(restored.url + "/runtime_version").json()["version"] == v


# --------------------------------------------------------------------------------------------
# step / token pooling
# --------------------------------------------------------------------------------------------


def test_step_pooling_equals_the_prefix_scores_and_transformers(restored, hf):
    tok, model = hf
    tag_id = tok.convert_tokens_to_ids(STEP_TOKEN)
    r = post(restored.url, {"input": STEPPED, "pooling_type": "step", "step_tag": STEP_TOKEN,
                            "normalize": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pooling_type"] == "step"
    steps = [d["score"] for d in body["data"]]
    assert [len(s) for s in steps] == [3, 1, 0]  # one per tag; none without a tag

    # the same numbers from one sequence request per prefix (what the scorer used to send)
    prefixes = [STEPPED[0][: i + len(STEP_TOKEN)] for i in range(len(STEPPED[0]))
                if STEPPED[0].startswith(STEP_TOKEN, i)]
    one_by_one = post(restored.url, {"input": prefixes, "normalize": False}).json()["data"]
    assert max(abs(a - b["score"]) for a, b in zip(steps[0], one_by_one, strict=True)) <= 1e-5
    # and from transformers' per-token head outputs at the tag positions
    ids, per_token = hf_token_logits(tok, model, STEPPED[0])
    at_tags = [x for i, x in zip(ids, per_token, strict=True) if i == tag_id]
    assert max(abs(a - b) for a, b in zip(steps[0], at_tags, strict=True)) <= TOL

    by_id = post(restored.url, {"input": STEPPED, "pooling_type": "step", "step_tag_id": tag_id,
                                "normalize": False}).json()
    assert [d["score"] for d in by_id["data"]] == steps
    normalized = post(restored.url, {"input": STEPPED[:1], "pooling_type": "step",
                                     "step_tag": STEP_TOKEN}).json()["data"][0]["score"]
    assert normalized == pytest.approx([1 / (1 + math.exp(-x)) for x in steps[0]], abs=1e-5)


def test_all_pooling_gives_every_token(restored, hf):
    tok, model = hf
    body = post(restored.url, {"input": TEXTS[0], "pooling_type": "all",
                               "normalize": False}).json()
    ids, per_token = hf_token_logits(tok, model, TEXTS[0])
    served = body["data"][0]["score"]
    assert len(served) == len(ids) == body["usage"]["prompt_tokens"]
    assert max(abs(a - b) for a, b in zip(served, per_token, strict=True)) <= TOL


def multi_step_rollouts() -> list[Rollout]:
    prompts = ["Question: 2 + 2?", "Write a haiku about rain.", "Name a prime number."]
    actions = [["Think: two and two.", "Answer: 4."], ["Rain falls softly down"],
               ["7", "or 11", "or 13"]]
    return [Rollout(f"r{i}", [Step(j, prompts[i] if j == 0 else "", a)
                              for j, a in enumerate(acts)])
            for i, acts in enumerate(actions)]


def test_scorer_step_tag_one_text_per_rollout_equals_prefix_path(restored):
    from weightsync.reward.scorer import tagged_rollout_text

    tagged = tagged_rollout_text(STEP_TOKEN)

    async def go():
        async with restored.client() as c:
            pooled = multi_step_rollouts()
            scorer = RewardModelScorer(c, score_level="step", step_tag=STEP_TOKEN, batch_size=2)
            await scorer.score(pooled)
            n_pooled = scorer.last_stats.num_texts
            prefixed = multi_step_rollouts()  # the prefix path, texts = the tagged prefixes
            prefix_scorer = RewardModelScorer(c, score_level="step", text_fn=tagged)
            await prefix_scorer.score(prefixed)
            return pooled, n_pooled, prefixed, prefix_scorer.last_stats.num_texts

    pooled, n_pooled, prefixed, n_prefixed = asyncio.run(go())
    assert (n_pooled, n_prefixed) == (3, 6)  # one text per rollout vs one per step
    for a, b in zip(pooled, prefixed, strict=True):
        for sa, sb in zip(a.steps, b.steps, strict=True):
            assert abs(sa.meta["rm_score"] - sb.meta["rm_score"]) <= 1e-5
            assert sa.meta["rm_score_version"] == sb.meta["rm_score_version"] is not None


def test_scorer_step_tag_refuses_a_tag_inside_a_step(restored):
    bad = [Rollout("r0", [Step(0, "p", f"an action with {STEP_TOKEN} inside")])]

    async def go():
        async with restored.client() as c:
            await RewardModelScorer(c, score_level="step", step_tag=STEP_TOKEN).score(bad)

    with pytest.raises(ValueError, match="occurs 2 times in its text, expected once per step"):
        asyncio.run(go())
    assert "rm_score" not in bad[0].steps[0].meta


# --------------------------------------------------------------------------------------------
# a trainer that knows only the design documents
# --------------------------------------------------------------------------------------------

SPEC_TRAINER = textwrap.dedent('''
    """A trainer written from the reward design alone: requests for the control plane, a vLLM
    stateless gloo group for the data plane, the design's field names. Prints JSON."""
    import json, os, sys, time

    import httpx
    import torch
    from safetensors.torch import load_file
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    url, token, weights, group_port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    h = {"Authorization": f"Bearer {token}"}
    params = load_file(weights)
    world = httpx.get(url + "/get_world_size", headers=h).json()["world_size"] + 1
    r = httpx.post(url + "/init_communicator", headers=h,
                   json={"host": "127.0.0.1", "port": group_port, "world_size": world})
    assert r.json() == {"status": "ok"}, r.text
    pg = stateless_init_torch_distributed_process_group(
        "127.0.0.1", group_port, world - 1, world, backend="gloo")
    version = httpx.get(url + "/runtime_version").json()["version"] + 5
    names = sorted(params)
    metadata = [{"name": n, "dtype": str(params[n].dtype), "shape": list(params[n].shape)}
                for n in names]
    r = httpx.post(url + "/update_param_batch", headers=h, timeout=120,
                   json={"metadata": metadata, "version": version, "training_mode": "full"})
    assert r.status_code == 200, r.text
    for n in names:
        pg.broadcast(params[n].contiguous(), root=world - 1).wait()
    pg.barrier().wait()
    deadline = time.time() + 120
    while httpx.post(url + "/get_num_background_tasks", headers=h).json()["num_background_tasks"]:
        assert time.time() < deadline, "the server did not finish the batch"
        time.sleep(0.2)
    served = httpx.get(url + "/runtime_version").json()["version"]
    scores = httpx.post(url + "/score", timeout=60, json={
        "model": "reward-model", "input": json.loads(sys.argv[5]), "pooling_type": "last",
        "normalize": False}).json()
    httpx.post(url + "/close_communicator", headers=h)
    print(json.dumps({"version": version, "served": served,
                      "scores": [d["score"] for d in scores["data"]],
                      "score_version": scores["version"]}), flush=True)
    os._exit(0)  # a process holding a gloo group may hang at exit
''')


def test_a_trainer_knowing_only_the_design_pushes_and_scores(restored, hf, tmp_path):
    from safetensors.torch import save_file

    from weightsync.testing.servers import free_port

    tok, model = hf
    g = torch.Generator().manual_seed(11)
    new = {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).contiguous()
           for n, p in model.state_dict().items()}
    save_file(new, str(tmp_path / "new.safetensors"))
    script = tmp_path / "spec_trainer.py"
    script.write_text(SPEC_TRAINER)
    out = subprocess.run(
        [sys.executable, str(script), restored.url, restored.api_key,
         str(tmp_path / "new.safetensors"), str(free_port()), json.dumps(TEXTS)],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    try:
        assert got["served"] == got["version"] == got["score_version"]
        ref = hf_logits(tok, model, TEXTS, state_dict=new)
        assert max(abs(a - b) for a, b in zip(got["scores"], ref, strict=True)) <= TOL
    finally:
        restored.restore()


def test_the_client_sends_the_designs_fields(restored, hf):
    """``VLLMRewardClient.score`` with the design's request: model name default accepted."""
    ref = hf_logits(*hf, TEXTS)

    async def go():
        async with restored.client(model_name="reward-model") as c:
            return await c.score(ScoringRequest(inputs=TEXTS, normalize=False, pooling_type="last"))

    resp, _ = asyncio.run(go())
    assert resp.pooling_type.value == "last" and resp.n_labels == 1
    assert max(abs(a - b) for a, b in zip(resp.scores, ref, strict=True)) <= TOL
