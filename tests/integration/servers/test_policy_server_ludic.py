"""A trainer written from the Ludic endpoint documentation alone (plain HTTP and a gloo group; no
weightsync code on its side) pushes weights into the policy server and into the reward server.

The trainer is the code sample of ``docs/policy_server.md`` (between the
``ludic-trainer-sample`` markers), executed as it stands. Afterwards the served logprobs / scores
equal transformers' for the pushed weights; a refused push names the tensor, changes nothing and
leaves the trainer's group usable.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest
import torch
from _policy_ref import PROMPTS, TOL, Reference, check_against, prompt_lps, served

from weightsync.testing.servers import free_port

pytestmark = pytest.mark.slow

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "policy_server.md")


@pytest.fixture(scope="module")
def sample():
    with open(DOC) as f:
        text = f.read()
    block = re.search(r"<!-- ludic-trainer-sample -->\s*```python\n(.*?)```", text, re.S)
    assert block, "docs/policy_server.md lost its ludic-trainer-sample block"
    namespace: dict = {}
    exec(compile(block.group(1), "docs/policy_server.md (ludic-trainer-sample)", "exec"), namespace)
    return namespace["LudicStyleTrainer"]


def test_ludic_trainer_pushes_into_the_policy_server(policy_server, sample):
    server = policy_server
    ref = Reference(server.model_dir)
    server.restore()
    v0 = server.version()
    before, _ = served(server, PROMPTS[0])
    trainer = sample(server.url, "127.0.0.1", free_port(), headers=server.headers)
    try:
        # refused before any byte: 4xx naming the tensor, nothing changed, trainer not hung
        bad = {**ref.model.state_dict(), "model.norm.weight": torch.zeros(65)}
        with pytest.raises(RuntimeError, match=r"refused \(400\).*model\.norm\.weight.*\[65\]"):
            trainer.push(bad)
        assert server.version() == v0
        after, _ = served(server, PROMPTS[0])
        assert prompt_lps(after) == prompt_lps(before)
        with pytest.raises(RuntimeError, match=r"refused \(409\).*not newer"):
            trainer.push(ref.model.state_dict(), version=v0)

        ref.perturb(seed=7)  # the trainer sends state_dict(): tied lm_head.weight included
        assert trainer.push(ref.model.state_dict()) == v0 + 1
        for p in PROMPTS:
            assert check_against(server, ref, p) == v0 + 1

        ref.perturb(seed=8)  # same group, an explicit version
        assert trainer.push(ref.model.state_dict(), version=v0 + 10) == v0 + 10
        assert check_against(server, ref, PROMPTS[1]) == v0 + 10
    finally:
        trainer.close()
    state = httpx.get(server.url + "/runtime_version").json()
    assert state["state"] == "ready" and state["version"] == v0 + 10
    server.restore()


def test_ludic_trainer_pushes_into_the_reward_server(reward_server, sample):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server = reward_server
    server.restore()
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(server.model_dir).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    texts = ["The model is helpful today.", "hi", "A policy was rude!"]
    with torch.no_grad():
        expected = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    headers = {"Authorization": f"Bearer {server.api_key}"}
    v0 = httpx.get(server.url + "/runtime_version").json()["version"]
    trainer = sample(server.url, "127.0.0.1", free_port(), headers=headers)
    try:
        with pytest.raises(RuntimeError, match=r"refused \(400\).*model\.norm\.weight.*not a head"):
            trainer.push({"model.norm.weight": model.model.norm.weight.detach()},
                         training_mode="head_only")
        # the reference's rule: version 0 (falsy) asks for the next version, not a 409
        version = trainer.push(dict(model.state_dict()), version=0, training_mode="full")
    finally:
        trainer.close()
    assert version == v0 + 1
    body = httpx.post(server.url + "/score", json={"input": texts, "normalize": False}).json()
    assert body["version"] == v0 + 1
    assert max(abs(d["score"] - e) for d, e in zip(body["data"], expected, strict=True)) <= TOL
    server.restore()
    base = load_file(os.path.join(server.model_dir, "model.safetensors"))
    assert set(base) <= set(model.state_dict())
