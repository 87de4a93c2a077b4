"""The code examples of the Ludic reward-model spec and plan, run as they are written against
this package and its servers (CPU): the client, the publisher (composed from the spec's control
plane and tensor communicator), the scorer, the credit assigner, the presets and the rollout
engine's ``generate_batch(..., reward_scorer=)``. Filled in only where the documents elide
(imports, the model, the texts, a token for our test servers) and checked against transformers.

Uses the session's shared reward server (and, for the rollout engine, the policy server).
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest
import torch

from weightsync.reward import (
    RewardModelCreditAssigner,
    RewardModelScorer,
    RewardModelTrainingMode,
    Rollout,
    ScoringRequest,
    Step,
    VLLMRewardClient,
    make_grpo_with_rm,
    make_reward_rl,
    make_rm_grpo_assigner,
    make_rm_scalerl_assigner,
    make_scalerl_with_rm,
)

pytestmark = pytest.mark.slow

TEXTS = ["The model is helpful today.", "hi", "A policy was rude according to the judge!"]
TOL = 1e-4


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def rm(reward_server):
    """The base reward model in transformers (the shared server restored to it)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_server.restore()
    tok = AutoTokenizer.from_pretrained(reward_server.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_server.model_dir).eval()
    return tok, model


def logits(tok, model, texts) -> list[float]:
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_spec_client_code(reward_server, rm):
    """Spec 6.1-6.2 / plan C.3: the client's calls and return values."""
    tok, model = rm

    async def go():
        client = VLLMRewardClient(
            host="0.0.0.0",  # the spec's default host (as a destination: this machine)
            port=reward_server.port,
            enable_weight_updates=True,
            api_key=reward_server.api_key,  # ours: the test server guards its control plane
        )
        try:
            request = ScoringRequest(model="reward-model", inputs=TEXTS, normalize=True)
            response, info = await client.score(request)
            batch = await client.score_batch(TEXTS)  # normalize=True: the spec's default
            version = await client.get_model_version()

            merged = {n: p.detach().clone() for n, p in model.named_parameters()}
            merged["score.weight"] = merged["score.weight"] * 2.0
            ts = client.sync_weights(merged, training_mode=RewardModelTrainingMode.FULL)
            forced = client.sync_weights(merged, version=version + 5,
                                         training_mode=RewardModelTrainingMode.FULL)
            after = await client.score_batch(TEXTS, normalize=False)
            return response, info, batch, version, ts, forced, after
        finally:
            await client.close()

    response, info, batch, version, ts, forced, after = asyncio.run(go())
    ref = logits(tok, model, TEXTS)
    assert response.scores == pytest.approx([sigmoid(x) for x in ref], abs=1e-5)
    assert response.hidden_states is None and response.metadata["model"]
    assert response.metadata["usage"]["prompt_tokens"] == sum(len(tok(t).input_ids) for t in TEXTS)
    assert [r.score for r in response.results] == response.scores
    assert info["request"] == {"model": "reward-model", "input": TEXTS, "pooling_type": "last",
                               "normalize": True}
    assert [d["score"] for d in info["raw_response"]["data"]] == response.scores
    assert batch == pytest.approx(response.scores, abs=1e-6)
    assert ts.startswith("rm-") and abs(int(ts[3:]) - time.time()) < 600
    assert forced == str(version + 5)
    assert after == pytest.approx([2 * x for x in ref], abs=TOL)  # a linear head, doubled
    reward_server.restore()


def test_spec_publisher_code_with_lora_merge(reward_server, rm):
    """Spec 6.4 / 7.2 / 8.4: ``create_reward_publisher(client)`` and the explicit composition
    ``RewardModelPublisher(control, comm, src_rank=comm.rank, head_name_patterns=...)``; a LoRA
    model merged before publishing, a head-only update."""
    from peft import LoraConfig, get_peft_model

    from weightsync.distributed import VllmControlPlane, VllmTensorCommunicator
    from weightsync.reward.publisher import RewardModelPublisher, create_reward_publisher

    tok, base = rm
    model = type(base)(base.config)
    model.load_state_dict(base.state_dict())
    reward_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    client = reward_server.client()
    try:
        step = client.sync_loop.run(client.get_model_version()) + 1
        reward_publisher = create_reward_publisher(client)

        # Before syncing, merge LoRA into backbone
        merged_model = reward_model.merge_and_unload()

        # Now sync the merged weights
        reward_publisher.publish(
            merged_model.state_dict(),
            version=step,
            training_mode=RewardModelTrainingMode.LORA,
        )
        served_lora = client.score_batch_sync(TEXTS, normalize=False)

        control = VllmControlPlane(client)
        comm = VllmTensorCommunicator(client)
        publisher = RewardModelPublisher(control, comm, src_rank=comm.rank,
                                         head_name_patterns=["score.", "classifier."])
        with torch.no_grad():
            merged_model.score.weight.mul_(-1.0)
        stats = publisher.publish({"score.weight": merged_model.score.weight}, step + 1,
                                  training_mode=RewardModelTrainingMode.HEAD_ONLY)
        served_head = client.score_batch_sync(TEXTS, normalize=False)
    finally:
        client.close_sync()
    assert client.last_sync_stats.versions == stats.versions == [step + 1]
    assert stats.num_tensors == 1
    assert served_head == pytest.approx(logits(tok, merged_model, TEXTS), abs=TOL)
    assert served_lora == pytest.approx([-x for x in served_head], abs=TOL)
    reward_server.restore()


def test_plan_scorer_credit_and_presets_code(reward_server, rm):
    """Plan C.4: ``RewardModelScorer`` writes ``rollout.meta[score_key]``,
    ``RewardModelCreditAssigner(mode, rm_coeff, alpha, ...)`` reads it, the factories and the
    presets (``make_reward_rl(reward_client, ...)`` with the client first)."""
    tok, model = rm
    prompts = ["Q: be kind.", "Q: be brief."]
    completions = [["thanks, friend", "no."], ["ok", "a very long and rambling answer"]]
    rollouts = [Rollout(steps=[Step(0, p, c, reward=float(len(c) % 3))],
                        meta={"initial_obs": p})
                for p, cs in zip(prompts, completions, strict=True) for c in cs]

    async def go():
        async with reward_server.client() as client:
            scorer = RewardModelScorer(client, score_key="rm_score", score_level="sequence",
                                       batch_size=64)
            await scorer.score(rollouts)  # rollout.meta["rm_score"] = float
            algo = make_reward_rl(client, mode="replace")
            return algo, await client.get_model_version()

    algo, version = asyncio.run(go())
    texts = [f"{r.steps[0].prev_obs}\n{r.steps[0].action}" for r in rollouts]
    ref = logits(tok, model, texts)  # our scorer's default: raw scores
    assert [r.meta["rm_score"] for r in rollouts] == pytest.approx(ref, abs=TOL)
    assert {r.meta["rm_score_version"] for r in rollouts} == {version}

    assigner = RewardModelCreditAssigner(mode="bonus", rm_coeff=1.0, alpha=0.5,
                                         rm_score_key="rm_score", score_level="sequence",
                                         inner_assigner=None)
    weights = assigner.compute(rollouts)
    assert [weights[(r.id, 0)] for r in rollouts] == pytest.approx(
        [r.steps[0].reward + r.meta["rm_score"] for r in rollouts])
    grpo = make_rm_grpo_assigner(2, "replace").compute(rollouts)
    for group in (rollouts[:2], rollouts[2:]):
        a, b = (r.meta["rm_score"] for r in group)
        assert grpo[(group[0].id, 0)] == pytest.approx(math.copysign(1.0, a - b), abs=1e-6)
    assert make_rm_scalerl_assigner(2, "replace").compute(rollouts).keys() == weights.keys()
    for preset in (make_grpo_with_rm(2, mode="bonus", rm_coeff=1.0), make_scalerl_with_rm(2),
                   algo):
        assert preset.credit_assigner.compute(rollouts).keys() == weights.keys()
    assert algo.reward_scorer.client.server_url == f"http://127.0.0.1:{reward_server.port}"


def test_plan_rollout_engine_generate_batch(reward_server, policy_server, rm):
    """Plan C.4: ``generate_batch(requests=, credit_assigner=, reward_scorer=)`` scores the
    rollouts before credit assignment and returns a ``SAWBatch`` of the sampled tokens."""
    from weightsync.policy import VLLMChatClient
    from weightsync.reward import RolloutEngine, RolloutRequest, SAWBatch

    tok, model = rm
    policy = VLLMChatClient(port=policy_server.port, api_key=policy_server.api_key)

    async def go():
        async with reward_server.client() as reward_client:
            algo = make_grpo_with_rm(group_size=3, mode="replace", reward_client=reward_client)
            engine = RolloutEngine(policy)
            requests = [RolloutRequest(prompt=p, num_episodes=3,
                                       sampling={"max_tokens": 6, "temperature": 1.0, "seed": 7})
                        for p in ("Hello", "The weights")]
            batch = await engine.generate_batch(requests=requests,
                                                credit_assigner=algo.credit_assigner,
                                                reward_scorer=algo.reward_scorer)
            return batch, algo

    try:
        batch, algo = asyncio.run(go())
    finally:
        asyncio.run(policy.aclose())
    assert isinstance(batch, SAWBatch) and len(batch.items) == 6
    rollouts = batch.meta["rollouts"]
    texts = [f"{r.steps[0].prev_obs}\n{r.steps[0].action}" for r in rollouts]
    assert [r.meta["rm_score"] for r in rollouts] == pytest.approx(logits(tok, model, texts),
                                                                   abs=TOL)
    weights = algo.credit_assigner.compute(rollouts)  # what generate_batch assigned
    v = httpx.get(policy_server.url + "/runtime_version").json()["version"]
    assert batch.meta["policy_versions"] == [v]
    for item, r in zip(batch.items, rollouts, strict=True):
        assert item.weight == weights[(r.id, 0)]
        prompt_len = item.action_mask.index(1)
        assert item.input_ids[prompt_len:] == r.steps[0].info["completion_token_ids"]
        assert len(item.actor_logps) == item.num_action_tokens == 6
    for group in (batch.items[:3], batch.items[3:]):  # GRPO: each prompt's weights centre on 0
        assert sum(i.weight for i in group) == pytest.approx(0.0, abs=1e-6)
