"""Algorithm presets (scorer settings + assigner + loss) and the policy-gradient losses, by hand."""

from __future__ import annotations

import math

import pytest

from weightsync.reward.advantages import GRPOAssigner, ScaleRLAssigner
from weightsync.reward.credit import RewardModelCreditAssigner
from weightsync.reward.losses import PolicyLoss
from weightsync.reward.presets import (
    RLAlgorithm,
    ScorerSettings,
    make_grpo_with_rm,
    make_reward_rl,
    make_scalerl_with_rm,
)
from weightsync.reward.rollout import Rollout, Step

torch = pytest.importorskip("torch")


def test_presets_pair_assigner_loss_and_scorer_settings():
    rl = make_reward_rl()
    assert isinstance(rl, RLAlgorithm) and rl.name == "reward_rl"
    assert rl.credit_assigner.mode == "replace" and rl.credit_assigner.inner_assigner is None
    assert rl.loss == PolicyLoss("reinforce")

    grpo = make_grpo_with_rm(4, rm_coeff=0.1, rm_score_key="rm", score_level="step",
                             batch_size=16)
    ca = grpo.credit_assigner
    assert isinstance(ca, RewardModelCreditAssigner)
    assert (ca.mode, ca.rm_coeff, ca.rm_score_key, ca.score_level) == ("bonus", 0.1, "rm", "step")
    assert isinstance(ca.inner_assigner, GRPOAssigner) and ca.inner_assigner.group_size == 4
    assert ca.inner_assigner.eps == 1e-8 and ca.inner_assigner.group_key == "initial_obs"
    assert grpo.loss == PolicyLoss("clipped_surrogate", 0.2, 0.2)
    assert grpo.scorer == ScorerSettings("rm", "step", 16)  # the scorer writes what ca reads

    srl = make_scalerl_with_rm(8, mode="weighted", alpha=0.3)
    assert isinstance(srl.credit_assigner.inner_assigner, ScaleRLAssigner)
    assert (srl.credit_assigner.mode, srl.credit_assigner.alpha) == ("weighted", 0.3)
    assert srl.loss == PolicyLoss("cispo", 1.0, 3.0, aggregation="sequence_mean")

    with pytest.raises(ValueError, match="alpha=0.3 has no effect in mode 'bonus'"):
        make_grpo_with_rm(4, alpha=0.3)


def test_make_reward_rl_takes_the_reward_client_first():
    """The plan's contract: ``make_reward_rl(reward_client, mode, ...)``; the scorer over that
    client comes with the algorithm, its keys the assigner's."""

    class Client:
        async def score_batch(self, texts, *, normalize=True):
            return [float(len(t)) for t in texts]

    client = Client()
    algo = make_reward_rl(client, "add", rm_score_key="r")
    assert algo.credit_assigner.mode == "add"
    assert algo.reward_scorer.client is client and algo.reward_scorer.score_key == "r"
    assert make_reward_rl().reward_scorer is None  # no client: score the rollouts yourself
    assert make_grpo_with_rm(2, reward_client=client).reward_scorer.client is client
    with pytest.raises(TypeError, match="the reward client comes first"):
        make_reward_rl("replace")  # the old order reads the mode as the client: refused


def test_make_scorer_uses_the_settings():
    class Client:
        async def score_batch(self, texts, *, normalize=True):
            return [float(len(t)) for t in texts]

    scorer = make_grpo_with_rm(2, rm_score_key="r", batch_size=3).make_scorer(
        Client(), max_concurrency=2)
    assert (scorer.score_key, scorer.score_level, scorer.batch_size, scorer.max_concurrency) == (
        "r", "sequence", 3, 2)
    with pytest.raises(ValueError, match=r"\['score_key'\] are fixed by the algorithm"):
        make_grpo_with_rm(2).make_scorer(Client(), score_key="other")


def test_a_preset_end_to_end_on_hand_numbers():
    """Score -> credit -> loss for two groups of two single-step rollouts."""
    algo = make_grpo_with_rm(2, mode="replace")
    batch = [Rollout(f"{g}{i}", [Step(0, g, f"a{i}")], {"initial_obs": g, "rm_score": s})
             for g, scores in (("p", (1.0, 3.0)), ("q", (5.0, 5.0))) for i, s in enumerate(scores)]
    credit = algo.credit_assigner.compute(batch)
    # p: scores 1, 3 -> mean 2, pop std 1 -> -1, +1 (over 1 + 1e-8); q: equal -> 0
    assert credit == pytest.approx({("p0", 0): -1.0, ("p1", 0): 1.0, ("q0", 0): 0.0,
                                    ("q1", 0): 0.0}, rel=1e-7)
    logp = torch.tensor([[-1.0], [-2.0], [-0.5], [-0.1]], requires_grad=True)
    loss = algo.loss(logp, [credit[(r.id, 0)] for r in batch])
    # on-policy: ratio 1, objective = A * 1 per token (clipped surrogate value), mean over 4
    assert loss.item() == pytest.approx(-(-1 + 1 + 0 + 0) / 4, abs=1e-6)
    loss.backward()
    # gradient of -min(r A, clip(r) A) / 4 at r = 1 is -A / 4 per token (d r / d logp = 1)
    assert logp.grad.reshape(-1).tolist() == pytest.approx([0.25, -0.25, 0.0, 0.0], rel=1e-6)


LOGP = [[-1.0, -2.0], [-0.5, 0.0]]
MASK = [[1.0, 1.0], [1.0, 0.0]]
W = [2.0, -1.0]


def test_reinforce_token_and_sequence_mean_by_hand():
    logp = torch.tensor(LOGP, requires_grad=True)
    # objective w * logp on action tokens: [-2, -4], [0.5, masked] -> sum -5.5 over 3 tokens
    loss = PolicyLoss("reinforce")(logp, W, mask=torch.tensor(MASK))
    assert loss.item() == pytest.approx(5.5 / 3)
    loss.backward()
    assert logp.grad.reshape(-1).tolist() == pytest.approx([-2 / 3, -2 / 3, 1 / 3, 0.0])
    # per sequence: (-2 - 4) / 2 = -3, 0.5 / 1 = 0.5 -> mean -1.25
    seq = PolicyLoss("reinforce", aggregation="sequence_mean")
    assert seq(torch.tensor(LOGP), torch.tensor(W), mask=torch.tensor(MASK)).item() == 1.25
    # [B] summed log-probs: one token per sample: (2 * -3 + -1 * -0.5) / 2 = -2.75
    assert PolicyLoss()(torch.tensor([-3.0, -0.5]), W).item() == pytest.approx(2.75)


def test_clipped_surrogate_and_cispo_by_hand():
    # ratio exp(log 1.5 - 0) = 1.5 on both tokens; clip 0.2 -> 1.2
    old = torch.zeros(2, 1)
    for w, clipped_obj, grad in ((1.0, 1.2, 0.0), (-1.0, -1.5, 1.5)):
        logp = torch.full((2, 1), math.log(1.5), requires_grad=True)
        loss = PolicyLoss("clipped_surrogate")(logp, [w, w], old_logprobs=old)
        # A > 0: min(1.5, 1.2) = 1.2 (clipped, no gradient); A < 0: min(-1.5, -1.2) = -1.5
        assert loss.item() == pytest.approx(-clipped_obj)
        loss.backward()
        # unclipped: d(-r A / 2)/d logp = -A r / 2 = 0.75 for A = -1
        assert logp.grad.reshape(-1).tolist() == pytest.approx([grad / 2, grad / 2])
    # CISPO: sg(clip(1.5, 0, 4)) * A * logp, gradient 1.5 * A on every token (never zeroed)
    logp = torch.full((2, 1), math.log(1.5), requires_grad=True)
    loss = PolicyLoss("cispo", 1.0, 3.0)(logp, [1.0, 1.0], old_logprobs=old)
    assert loss.item() == pytest.approx(-1.5 * math.log(1.5))
    loss.backward()
    assert logp.grad.reshape(-1).tolist() == pytest.approx([-0.75, -0.75])
    # ratio 10 is capped at 1 + 3 = 4
    big = torch.full((1, 1), math.log(10.0))
    assert PolicyLoss("cispo", 1.0, 3.0)(big, [1.0], old_logprobs=torch.zeros(1, 1)).item() == (
        pytest.approx(-4 * math.log(10.0)))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: PolicyLoss("ppo"), "unknown loss 'ppo'"),
        (lambda: PolicyLoss(aggregation="sum"), "aggregation must be one of"),
        (lambda: PolicyLoss(clip_low=2.0), "clip_low"),
        (lambda: PolicyLoss()(torch.zeros(2, 3), [1.0]), "weights: 1 values for 2 samples"),
        (lambda: PolicyLoss()(torch.zeros(2, 3), [1.0, 1.0], mask=torch.ones(3, 2)),
         r"mask: shape \[3, 2\] does not match logprobs \[2, 3\]"),
        (lambda: PolicyLoss()(torch.zeros(2, 3, 1), [1.0, 1.0]), r"expected \[B, T\] or \[B\]"),
    ],
)
def test_loss_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
