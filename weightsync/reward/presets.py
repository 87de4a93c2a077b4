"""Algorithm presets for RL with a reward model: scorer settings + credit assigner + loss.

Who calls: the RL loop, once, when it is set up::

    algo = make_grpo_with_rm(group_size=4, reward_client=reward_client)
    scorer = algo.reward_scorer                         # RewardModelScorer, matching keys
    ...                                                 # every step:
    await scorer.score(rollouts)                        # rollout.meta["rm_score"]
    credit = algo.credit_assigner.compute(rollouts)     # {(rollout.id, step.index): weight}
    loss = algo.loss(logprobs, [credit[k] for k in keys], mask=mask, old_logprobs=old)

The scorer settings and the assigner share ``rm_score_key`` and ``score_level``, so the assigner
reads what the scorer wrote.

===========================  ==================================  =============================
preset                       credit                              loss
===========================  ==================================  =============================
``make_reward_rl``           combined reward, no baseline        ``reinforce``
                             (mode ``replace`` by default)
``make_grpo_with_rm``        combined reward, GRPO advantages    ``clipped_surrogate``
                             (mode ``bonus``)                    (PPO clip 0.2 / 0.2)
``make_scalerl_with_rm``     combined reward, ScaleRL            ``cispo`` (ratio capped at 4,
                             advantages (mode ``bonus``)         sequence-mean aggregation)
===========================  ==================================  =============================

``make_reward_rl(reward_client, mode, ...)`` takes the reward client first (the reward plan's
contract); the other two take it as ``reward_client=``. Given a client, ``algo.reward_scorer``
is the ``RewardModelScorer`` over it (what ``RolloutEngine.generate_batch(...,
reward_scorer=)`` runs before credit assignment); ``algo.make_scorer(client, **options)`` builds
one with other options. ``make_rm_grpo_assigner`` / ``make_rm_scalerl_assigner`` (in
``weightsync.reward.credit``) build just the assigners. Modes, ``rm_coeff`` and ``alpha``: see
``RewardModelCreditAssigner``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.reward._checks import GroupKey
from weightsync.reward.advantages import DEFAULT_GROUP_KEY
from weightsync.reward.credit import (
    DEFAULT_ALPHA,
    DEFAULT_RM_COEFF,
    RewardModelCreditAssigner,
    make_rm_grpo_assigner,
    make_rm_scalerl_assigner,
)
from weightsync.reward.losses import PolicyLoss
from weightsync.reward.rollout import CreditAssigner


@dataclass(frozen=True)
class ScorerSettings:
    """How the rollouts must be scored for the assigner to find the scores."""

    score_key: str = "rm_score"
    score_level: str = "sequence"
    batch_size: int = 64

    def build(self, client: Any, **options: Any) -> Any:
        """A ``RewardModelScorer`` over ``client`` with these settings; ``options`` are its
        other keyword options (``max_concurrency``, ``text_fn``, ``aggregate``, ...) and may
        override ``batch_size``, but not where the scores go (the assigner reads them there)."""
        from weightsync.reward.scorer import RewardModelScorer

        fixed = sorted({"score_key", "score_level"} & set(options))
        if fixed:
            raise ValueError(
                f"{fixed} are fixed by the algorithm (its assigner reads the scores there); set "
                f"rm_score_key= / score_level= on the preset instead"
            )
        options.setdefault("batch_size", self.batch_size)
        return RewardModelScorer(client, self.score_key, self.score_level, **options)


@dataclass(frozen=True)
class RLAlgorithm:
    """One algorithm: its name, how to score, how to assign credit, which loss to minimise;
    ``reward_scorer``: the scorer over the reward client the preset was given (None without)."""

    name: str
    credit_assigner: CreditAssigner
    loss: PolicyLoss
    scorer: ScorerSettings = field(default_factory=ScorerSettings)
    reward_scorer: Any = None

    def make_scorer(self, client: Any, **options: Any) -> Any:
        return self.scorer.build(client, **options)


def _algorithm(name: str, assigner: CreditAssigner, loss: PolicyLoss, settings: ScorerSettings,
               reward_client: Any) -> RLAlgorithm:
    if isinstance(reward_client, str):
        raise TypeError(
            f"reward_client: got the string {reward_client!r}; the reward client comes first "
            f"(make_reward_rl(reward_client, mode, ...), the reward plan's order), pass None "
            f"to score the rollouts yourself and mode= by name")
    scorer = settings.build(reward_client) if reward_client is not None else None
    return RLAlgorithm(name, assigner, loss, settings, scorer)


def make_reward_rl(
    reward_client: Any = None,
    mode: str = "replace",
    rm_coeff: float = DEFAULT_RM_COEFF,
    alpha: float = DEFAULT_ALPHA,
    rm_score_key: str = "rm_score",
    score_level: str = "sequence",
    *,
    inner_assigner: CreditAssigner | None = None,
    batch_size: int = 64,
    name: str = "reward_rl",
) -> RLAlgorithm:
    """REINFORCE on the combined reward (no group baseline unless ``inner_assigner`` adds one);
    ``reward_client`` first, as the reward plan's contract writes it (None: no scorer built)."""
    assigner = RewardModelCreditAssigner(mode, rm_coeff, alpha, rm_score_key, score_level,
                                         inner_assigner)
    return _algorithm(name, assigner, PolicyLoss("reinforce"),
                      ScorerSettings(rm_score_key, score_level, batch_size), reward_client)


def make_grpo_with_rm(
    group_size: int,
    mode: str = "bonus",
    rm_coeff: float = DEFAULT_RM_COEFF,
    alpha: float = DEFAULT_ALPHA,
    rm_score_key: str = "rm_score",
    score_level: str = "sequence",
    *,
    reward_client: Any = None,
    group_key: GroupKey = DEFAULT_GROUP_KEY,
    scale_by_std: bool = True,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    batch_size: int = 64,
    name: str = "grpo_rm",
) -> RLAlgorithm:
    """GRPO with a reward model: ``group_size`` completions per prompt, combined returns
    normalised within each prompt group (per step at step level), PPO-clipped surrogate loss."""
    assigner = make_rm_grpo_assigner(group_size, mode, rm_coeff, alpha, rm_score_key,
                                     score_level, group_key=group_key, scale_by_std=scale_by_std)
    return _algorithm(name, assigner, PolicyLoss("clipped_surrogate", clip_low, clip_high),
                      ScorerSettings(rm_score_key, score_level, batch_size), reward_client)


def make_scalerl_with_rm(
    group_size: int,
    mode: str = "bonus",
    rm_coeff: float = DEFAULT_RM_COEFF,
    alpha: float = DEFAULT_ALPHA,
    rm_score_key: str = "rm_score",
    score_level: str = "sequence",
    *,
    reward_client: Any = None,
    group_key: GroupKey = DEFAULT_GROUP_KEY,
    clip_high: float = 3.0,
    batch_size: int = 64,
    name: str = "scalerl_rm",
) -> RLAlgorithm:
    """ScaleRL with a reward model: group-mean centring, batch-std scaling, CISPO loss
    (importance weight capped at ``1 + clip_high``, no lower cap), sequence-mean aggregation."""
    assigner = make_rm_scalerl_assigner(group_size, mode, rm_coeff, alpha, rm_score_key,
                                        score_level, group_key=group_key)
    return _algorithm(name, assigner,
                      PolicyLoss("cispo", 1.0, clip_high, aggregation="sequence_mean"),
                      ScorerSettings(rm_score_key, score_level, batch_size), reward_client)
