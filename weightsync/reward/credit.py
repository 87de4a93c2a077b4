"""``RewardModelCreditAssigner``: combine reward-model scores with environment rewards, then
assign per-step credit (optionally GRPO / ScaleRL normalised).

Who calls: the RL loop, in the trainer process, after ``RewardModelScorer.score(rollouts)`` wrote
the scores and before the loss. ``compute(rollouts)`` is synchronous, pure Python over floats,
deterministic, never modifies the rollouts, and returns a weight for every step of every
rollout (the ``CreditAssigner`` contract).

Modes (``env`` = environment reward, ``rm`` = reward-model score):

============  ==================================  =============================================
mode          combined reward                     typical use
============  ==================================  =============================================
``replace``   ``rm``                              RLHF: the reward model is the reward
``add``       ``env + rm``                        shaped reward on top of a verifier
``multiply``  ``env * rm``                        gate the model score by success (or back)
``weighted``  ``alpha * env + (1 - alpha) * rm``  interpolate, ``0 <= alpha <= 1``
``bonus``     ``env + rm_coeff * rm``             a scaled reward-model bonus (the default)
============  ==================================  =============================================

``rm_coeff`` scales the score in ``bonus`` only and ``alpha`` is used by ``weighted`` only, as the
design defines them; a non-default value given to a mode that does not use it is an error
rather than silently ignored. (``add`` is ``bonus`` with ``rm_coeff = 1``.)

Score levels:

- ``score_level="sequence"``: one score per rollout in ``rollout.meta[rm_score_key]``, combined
  with the rollout's return ``R`` (sum of step rewards) into ``combine(R, rm)``. With no inner
  assigner every step gets that value (outcome-level credit). With an inner assigner, the
  sequence score is credited at the rollout's final step (the last of ``rollout.steps``: where
  the outcome is known, as RLHF credits a reward model at the last token) and every step keeps
  its environment reward times the mode's env factor (1 for add/bonus, ``alpha`` for weighted,
  ``rm`` for multiply, 0 for replace), so the shaped return the inner assigner sees is exactly
  ``combine(R, rm)`` and per-step env rewards still reach return-to-go style assigners.
- ``score_level="step"``: one score per step in ``step.meta[rm_score_key]`` (a process reward
  model), combined per step: ``combine(step.reward, rm_step)``. With no inner assigner each step
  gets its own combined reward; an inner assigner sees the combined rewards as step rewards.

Inner assigner (``inner_assigner``): any ``CreditAssigner``. It receives copies of the rollouts
whose step rewards are the combined rewards above (ids, indices, observations and ``meta``
unchanged, so grouping by ``meta["initial_obs"]`` works), and its weights are the result.
``GRPOAssigner`` / ``ScaleRLAssigner`` (``weightsync.reward.advantages``) normalise the combined
returns within prompt groups; ``make_rm_grpo_assigner`` / ``make_rm_scalerl_assigner`` build
those pairs. ``replace`` never reads the environment rewards.

Bad input raises ``ValueError`` before any arithmetic, naming the rollout (and step): a missing
score ("run RewardModelScorer first"), a list of scores (reduce n_labels > 1 in the scorer with
``aggregate=``), a NaN or infinite score or reward (it would poison its group), duplicate
rollout ids or step indices, a rollout without steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from weightsync.reward._checks import (
    GroupKey,
    check_rollouts,
    check_weights,
    finite,
    step_reward,
)
from weightsync.reward.advantages import (
    DEFAULT_GROUP_KEY,
    EpisodicReturn,
    GRPOAssigner,
    PerStepReward,
    ScaleRLAssigner,
)
from weightsync.reward.rollout import CreditAssigner, Rollout, RolloutStepKey, Step

# mode -> (rm, rm_coeff, alpha) -> (env factor a, score term b); combined = a * env + b
_MODES: dict[str, Callable[[float, float, float], tuple[float, float]]] = {
    "replace": lambda rm, coeff, alpha: (0.0, rm),
    "add": lambda rm, coeff, alpha: (1.0, rm),
    "multiply": lambda rm, coeff, alpha: (rm, 0.0),
    "weighted": lambda rm, coeff, alpha: (alpha, (1.0 - alpha) * rm),
    "bonus": lambda rm, coeff, alpha: (1.0, coeff * rm),
}
MODES = tuple(_MODES)
SCORE_LEVELS = ("sequence", "step")
DEFAULT_RM_COEFF = 1.0
DEFAULT_ALPHA = 0.5


class RewardModelCreditAssigner:
    """See the module docstring. ``compute(rollouts) -> {(rollout.id, step.index): weight}``."""

    def __init__(
        self,
        mode: str = "bonus",
        rm_coeff: float = DEFAULT_RM_COEFF,
        alpha: float = DEFAULT_ALPHA,
        rm_score_key: str = "rm_score",
        score_level: str = "sequence",
        inner_assigner: CreditAssigner | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
        if score_level not in SCORE_LEVELS:
            raise ValueError(f"score_level must be one of {SCORE_LEVELS}, got {score_level!r}")
        rm_coeff = finite(rm_coeff, "rm_coeff")
        alpha = finite(alpha, "alpha")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if rm_coeff != DEFAULT_RM_COEFF and mode != "bonus":
            raise ValueError(
                f"rm_coeff={rm_coeff} has no effect in mode {mode!r}; it scales the score in "
                f"mode 'bonus' (env + rm_coeff * rm)"
            )
        if alpha != DEFAULT_ALPHA and mode != "weighted":
            raise ValueError(
                f"alpha={alpha} has no effect in mode {mode!r}; it is the env weight of mode "
                f"'weighted' (alpha * env + (1 - alpha) * rm)"
            )
        if not isinstance(rm_score_key, str) or not rm_score_key:
            raise ValueError(f"rm_score_key must be a non-empty string, got {rm_score_key!r}")
        if inner_assigner is not None and not callable(getattr(inner_assigner, "compute", None)):
            raise TypeError(
                f"inner_assigner must be a CreditAssigner (compute(rollouts) -> dict); a "
                f"{type(inner_assigner).__name__} has no compute()"
            )
        self.mode = mode
        self.rm_coeff = rm_coeff
        self.alpha = alpha
        self.rm_score_key = rm_score_key
        self.score_level = score_level
        self.inner_assigner = inner_assigner

    def __repr__(self) -> str:
        inner = type(self.inner_assigner).__name__ if self.inner_assigner else None
        return (f"RewardModelCreditAssigner(mode={self.mode!r}, rm_coeff={self.rm_coeff}, "
                f"alpha={self.alpha}, rm_score_key={self.rm_score_key!r}, "
                f"score_level={self.score_level!r}, inner_assigner={inner})")

    def combine(self, env: float, rm: float) -> float:
        """The mode's combined reward for one environment reward and one score."""
        a, b = self._factors(rm)
        return a * env + b

    def compute(self, rollouts: Sequence[Rollout]) -> dict[RolloutStepKey, float]:
        rs = check_rollouts(rollouts)
        shaped = [self._shape(r) for r in rs]
        inner = self.inner_assigner
        if inner is None:
            inner = EpisodicReturn() if self.score_level == "sequence" else PerStepReward()
        return check_weights(inner.compute(shaped), rs, type(inner).__name__)

    # -- shaping -------------------------------------------------------------------------------
    def _shape(self, r: Any) -> Rollout:
        """A copy of ``r`` whose step rewards are the combined rewards (see the docstring)."""
        if self.mode == "replace":  # never reads environment rewards
            envs = [0.0] * len(r.steps)
        else:
            envs = [step_reward(r, s) for s in r.steps]
        if self.score_level == "step":
            rewards = []
            for s, env in zip(r.steps, envs, strict=True):
                a, b = self._factors(_score(getattr(s, "meta", None), self.rm_score_key,
                                            f"rollout {r.id!r} step {s.index}", "step"))
                rewards.append(a * env + b)
        else:
            a, b = self._factors(_score(getattr(r, "meta", None), self.rm_score_key,
                                        f"rollout {r.id!r}", "sequence"))
            rewards = [a * env for env in envs]
            rewards[-1] += b
        for s, x in zip(r.steps, rewards, strict=True):
            if not math.isfinite(x):  # e.g. a huge score times a huge reward
                raise ValueError(f"rollout {r.id!r} step {s.index}: combined reward is {x}")
        return Rollout(
            id=r.id,
            steps=[_step_with_reward(s, x) for s, x in zip(r.steps, rewards, strict=True)],
            meta=getattr(r, "meta", None) or {},
        )

    def _factors(self, rm: float) -> tuple[float, float]:
        return _MODES[self.mode](rm, self.rm_coeff, self.alpha)


def _score(meta: Any, key: str, where: str, level: str) -> float:
    holder = "rollout.meta" if level == "sequence" else "step.meta"
    if not isinstance(meta, Mapping) or key not in meta or meta[key] is None:
        raise ValueError(
            f"{where}: no reward-model score in {holder}[{key!r}]; score the rollouts first "
            f"(await RewardModelScorer(client, score_key={key!r}, score_level={level!r})"
            f".score(rollouts))"
        )
    return finite(meta[key], f"{where}: {holder}[{key!r}]")


def _step_with_reward(s: Any, reward: float) -> Step:
    if isinstance(s, Step):
        return replace(s, reward=reward)
    return Step(index=s.index, prev_obs=getattr(s, "prev_obs", ""),
                action=getattr(s, "action", ""), next_obs=getattr(s, "next_obs", None),
                reward=reward, truncated=getattr(s, "truncated", False),
                terminated=getattr(s, "terminated", False), info=getattr(s, "info", None) or {},
                meta=getattr(s, "meta", None) or {})


# -- factories -------------------------------------------------------------------------------


def make_rm_grpo_assigner(
    group_size: int | None,
    mode: str = "bonus",
    rm_coeff: float = DEFAULT_RM_COEFF,
    alpha: float = DEFAULT_ALPHA,
    rm_score_key: str = "rm_score",
    score_level: str = "sequence",
    *,
    group_key: GroupKey = DEFAULT_GROUP_KEY,
    scale_by_std: bool = True,
    pool: str | None = None,
) -> RewardModelCreditAssigner:
    """Combined rewards, then GRPO advantages within prompt groups of ``group_size``
    (``None``: any size): ``(R - mean_g) / (std_g + 1e-8)``, ``R`` the combined return.
    ``pool`` (``GRPOAssigner``): None pools every step's weight in the group at step level (the
    reward spec's normalisation of per-step scores) and one return per rollout at sequence
    level."""
    if pool is None:
        pool = "step" if score_level == "step" else "rollout"
    inner = GRPOAssigner(group_size, group_key=group_key, scale_by_std=scale_by_std, pool=pool)
    return RewardModelCreditAssigner(mode, rm_coeff, alpha, rm_score_key, score_level, inner)


def make_rm_scalerl_assigner(
    group_size: int | None,
    mode: str = "bonus",
    rm_coeff: float = DEFAULT_RM_COEFF,
    alpha: float = DEFAULT_ALPHA,
    rm_score_key: str = "rm_score",
    score_level: str = "sequence",
    *,
    group_key: GroupKey = DEFAULT_GROUP_KEY,
) -> RewardModelCreditAssigner:
    """Combined rewards, then ScaleRL advantages: group-mean centring, batch-std scaling."""
    inner = ScaleRLAssigner(group_size, group_key=group_key)
    return RewardModelCreditAssigner(mode, rm_coeff, alpha, rm_score_key, score_level, inner)
