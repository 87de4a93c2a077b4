"""``weightsync serve-reward`` started with the Ludic reward spec's launch line, with its rules:

* ``--model M --task reward --port P --pooler-config '{"pooling_type": "LAST", "normalize":
  true}'`` and the spec's worker extension name (``RewardWeightSyncExtension``) start a server
  that scores as transformers does;
* by default a forced version that is not newer is taken as given (served, reported by
  ``/runtime_version`` and every answer), and ``training_mode`` is information (a head_only
  batch with backbone tensors lands); the shared server, started with ``--monotonic-versions
  --strict-training-mode``, refuses both (409, 400) and changes nothing.

The trainer is the Ludic-style sample of ``docs/policy_server.md`` (plain HTTP and a gloo group).
One server is started here, on the shared tiny reward model, and stopped at the end.
"""

from __future__ import annotations

import math
import os
import re

import httpx
import pytest
import torch
from _hf_reward import HFReward

from weightsync.testing.servers import free_port

pytestmark = pytest.mark.slow

TEXTS = ["The model is helpful today.", "hi", "Question: what is 2 + 2? Answer: 4."]
POOLER = '{"pooling_type": "LAST", "normalize": true}'
EXTENSION = "weightsync.loaders.vllm_worker.RewardWeightSyncExtension"
TOL = 1e-4
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "policy_server.md")


@pytest.fixture(scope="module")
def spec_server(reward_server_launcher, tiny_reward_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("spec-launch") / "server.log")
    handle = reward_server_launcher(tiny_reward_model_dir, log, api_key=None, extra=[
        "--task", "reward", "--pooler-config", POOLER, "--worker-extension-cls", EXTENSION,
        "--dtype", "float32"])
    try:
        yield handle
    finally:
        reward_server_launcher.stop(handle)


@pytest.fixture(scope="module")
def trainer_cls():
    with open(DOC) as f:
        block = re.search(r"<!-- ludic-trainer-sample -->\s*```python\n(.*?)```", f.read(), re.S)
    assert block, "docs/policy_server.md lost its ludic-trainer-sample block"
    namespace: dict = {}
    exec(compile(block.group(1), "docs/policy_server.md (ludic-trainer-sample)", "exec"), namespace)
    return namespace["LudicStyleTrainer"]


def perturbed(model_dir: str, seed: int) -> HFReward:
    ref = HFReward(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return ref


def scored(url: str) -> tuple[list[float], int, str]:
    r = httpx.post(url + "/score", json={"model": "reward-model", "input": TEXTS,
                                         "normalize": False}, timeout=60)
    r.raise_for_status()
    body = r.json()
    return [d["score"] for d in body["data"]], body["version"], r.headers["x-weight-version"]


def version_of(url: str) -> int:
    return int(httpx.get(url + "/runtime_version", timeout=10).json()["version"])


def test_the_spec_options_reach_vllms_engine_args(tiny_reward_model_dir):
    from weightsync.servers.reward import engine_args, parse_args

    cfg = parse_args(["--model", tiny_reward_model_dir, "--task", "reward", "--pooler-config",
                      POOLER, "--worker-extension-cls", EXTENSION, "--device", "cpu"])
    args = engine_args(cfg)
    assert args.runner == "pooling" and args.worker_extension_cls == EXTENSION
    assert (args.pooler_config.seq_pooling_type, args.pooler_config.use_activation) == ("LAST", True)


def test_the_spec_launch_line_starts_and_scores(spec_server):
    assert httpx.get(spec_server.url + "/health").json() == {"status": "ok",
                                                             "type": "reward_model"}
    r = httpx.post(spec_server.url + "/score", json={"model": "reward-model", "input": TEXTS})
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    raw = HFReward(spec_server.model_dir).scores(TEXTS)  # normalize true: the model's sigmoid
    assert max(abs(d["score"] - 1 / (1 + math.exp(-x))) for d, x in zip(data, raw, strict=True)) <= TOL
    assert "--task reward" in " ".join(spec_server.process.cmd)
    assert f"Injected <class '{EXTENSION}'>" in spec_server.log_text()  # vLLM's workers took it


def test_a_forced_older_version_is_taken_by_default(spec_server, reward_server, trainer_cls):
    """A trainer that resumes from an older checkpoint: the spec's server publishes the lower
    version and serves it; with ``--monotonic-versions`` (the shared server) it is a 409."""
    high, low = version_of(spec_server.url) + 5, 1
    a, b = perturbed(spec_server.model_dir, seed=21), perturbed(spec_server.model_dir, seed=22)
    trainer = trainer_cls(spec_server.url, "127.0.0.1", free_port())
    try:
        assert trainer.push(dict(a.model.state_dict()), version=high) == high
        assert scored(spec_server.url)[1:] == (high, str(high))
        assert trainer.push(dict(b.model.state_dict()), version=low) == low
    finally:
        trainer.close()
    scores, version, header = scored(spec_server.url)
    assert version_of(spec_server.url) == version == low and header == str(low)
    assert max(abs(s - e) for s, e in zip(scores, b.scores(TEXTS), strict=True)) <= TOL

    v = version_of(reward_server.url) + 2
    ours = trainer_cls(reward_server.url, "127.0.0.1", free_port(),
                       headers={"Authorization": f"Bearer {reward_server.api_key}"})
    try:
        assert ours.push(dict(b.model.state_dict()), version=v) == v
        with pytest.raises(RuntimeError, match=r"refused \(409\).*not newer"):
            ours.push(dict(a.model.state_dict()), version=v - 1)
    finally:
        ours.close()
    assert scored(reward_server.url)[1:] == (v, str(v))
    reward_server.restore()


def test_training_mode_is_information_by_default(spec_server, reward_server, trainer_cls):
    """A head_only batch that carries a backbone tensor lands on the spec's server (the mode is
    logged, not enforced); ``--strict-training-mode`` (the shared server) refuses it (400)."""
    ref = perturbed(spec_server.model_dir, seed=23)
    norm = {"model.norm.weight": ref.model.model.norm.weight.detach().clone()}
    v0 = version_of(spec_server.url)
    trainer = trainer_cls(spec_server.url, "127.0.0.1", free_port())
    try:
        assert trainer.push(norm, training_mode="head_only") == v0 + 1
        assert trainer.push(dict(ref.model.state_dict()), training_mode="head_only") == v0 + 2
    finally:
        trainer.close()
    scores, version, _ = scored(spec_server.url)
    assert version == v0 + 2
    assert max(abs(s - e) for s, e in zip(scores, ref.scores(TEXTS), strict=True)) <= TOL
    assert "mode head_only (information only)" in spec_server.log_text()

    v = version_of(reward_server.url)
    before = scored(reward_server.url)[0]
    ours = trainer_cls(reward_server.url, "127.0.0.1", free_port(),
                       headers={"Authorization": f"Bearer {reward_server.api_key}"})
    try:
        with pytest.raises(RuntimeError, match=r"refused \(400\).*model\.norm\.weight.*not a head"):
            ours.push(norm, training_mode="head_only")
    finally:
        ours.close()
    assert version_of(reward_server.url) == v and scored(reward_server.url)[0] == before
