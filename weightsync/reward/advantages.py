"""Credit assigners over environment rewards: GRPO and ScaleRL advantages, and the two plain
ones ``RewardModelCreditAssigner`` uses when it has no inner assigner.

Each is a ``CreditAssigner`` (``compute(rollouts) -> {(rollout.id, step.index): weight}``), pure
Python over floats, deterministic. ``R`` is a rollout's return: the sum of its steps' rewards
(``Rollout.total_reward``). Group-normalising assigners give the rollout's advantage to every
one of its steps.

========================  ============================================================
``EpisodicReturn``        every step gets ``R``
``PerStepReward``         every step gets its own ``step.reward``
``GRPOAssigner``          ``A = (R - mean_g) / (std_g + eps)`` within each group ``g``
                          (``pool="step"``: every step's reward ``r`` pooled instead, each
                          step gets ``(r - mean_g) / (std_g + eps)``, as the reward spec)
``ScaleRLAssigner``       ``A = (R - mean_g) / (std_batch + eps)``
========================  ============================================================

Groups are the rollouts sampled from one prompt: ``rollout.meta["initial_obs"]``, falling back
to the first step's ``prev_obs`` (``group_key`` names another meta key or is a callable).
``std`` is the population standard deviation (divide by n), ``eps = 1e-8``.

Edge cases, the same in both group assigners:

- A group whose returns are all equal, a group of one included, has no comparison to learn
  from: every advantage in it is exactly 0 (no ``(x - mean) / eps`` blow-up of rounding noise).
  This is what GRPO's formula gives in exact arithmetic; we make it exact in floating point.
- A NaN or infinite reward raises ``ValueError`` naming the rollout and step. Skipping the
  rollout would silently shift its group's baseline, zeroing it would invent a reward; either
  hides a broken environment or reward model. Failing the step is the design's policy.
- ``group_size`` (optional): every group must have exactly that many rollouts, else
  ``ValueError`` naming the groups (catches prompts that were grouped wrongly).

ScaleRL (Khatri et al. 2025, "The Art of Scaling Reinforcement Learning Compute for LLMs")
centres on the group mean like GRPO but scales by one standard deviation over the whole batch,
so easy prompts with tiny spreads are not blown up. We compute that std over the group-centred
advantages of the groups that have any spread: the recipe's zero-variance filtering drops
all-equal groups from the batch, so they neither dilute the std nor get a weight (theirs is 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from weightsync.reward._checks import GroupKey, check_rollouts, groups_of, step_reward
from weightsync.reward.rollout import RolloutStepKey

DEFAULT_GROUP_KEY = "initial_obs"
DEFAULT_EPS = 1e-8


class EpisodicReturn:
    """Every step of a rollout gets the rollout's return ``R`` (outcome-level credit)."""

    def compute(self, rollouts: Sequence[Any]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for r in check_rollouts(rollouts):
            total = math.fsum(step_reward(r, s) for s in r.steps)
            out.update({(r.id, s.index): total for s in r.steps})
        return out


class PerStepReward:
    """Every step gets its own reward (process-level credit, no return, no baseline)."""

    def compute(self, rollouts: Sequence[Any]) -> dict[RolloutStepKey, float]:
        return {
            (r.id, s.index): step_reward(r, s) for r in check_rollouts(rollouts) for s in r.steps
        }


class _GroupAssigner:
    def __init__(
        self, group_size: int | None = None, *, group_key: GroupKey = DEFAULT_GROUP_KEY,
        eps: float = DEFAULT_EPS,
    ) -> None:
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(f"group_size must be an int >= 1 or None, got {group_size!r}")
        if not (isinstance(group_key, str) and group_key) and not callable(group_key):
            raise ValueError(f"group_key must be a meta key or a callable, got {group_key!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.group_size = group_size
        self.group_key = group_key
        self.eps = float(eps)

    def _returns_and_groups(self, rollouts: Sequence[Any]) -> tuple[list[Any], list[float],
                                                                    list[list[int]]]:
        rs = check_rollouts(rollouts)
        returns = [math.fsum(step_reward(r, s) for s in r.steps) for r in rs]
        return rs, returns, groups_of(rs, self.group_key, self.group_size)

    @staticmethod
    def _spread(xs: list[float]) -> tuple[float, float]:
        """(mean, population std) of ``xs``."""
        mean = math.fsum(xs) / len(xs)
        return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))

    @staticmethod
    def _assign(rs: list[Any], adv: list[float]) -> dict[RolloutStepKey, float]:
        return {(r.id, s.index): a for r, a in zip(rs, adv, strict=True) for s in r.steps}


class GRPOAssigner(_GroupAssigner):
    """GRPO advantages: ``A = (R - mean_g) / (std_g + eps)`` within each group (population std,
    ``eps = 1e-8``); ``scale_by_std=False`` keeps only ``R - mean_g`` (Dr. GRPO). All-equal
    groups (and groups of one) get 0; NaN rewards raise (see the module docstring).

    ``pool``: ``"rollout"`` (default) normalises one return per rollout and gives it to each of
    its steps; ``"step"`` pools every step's own reward in the group (the reward spec's group
    normalisation of per-step weights: a longer rollout weighs more in the statistics) and
    gives each step its normalised reward. Equal for one-step rollouts."""

    POOLS = ("rollout", "step")

    def __init__(
        self, group_size: int | None = None, *, group_key: GroupKey = DEFAULT_GROUP_KEY,
        eps: float = DEFAULT_EPS, scale_by_std: bool = True, pool: str = "rollout",
    ) -> None:
        super().__init__(group_size, group_key=group_key, eps=eps)
        if pool not in self.POOLS:
            raise ValueError(f"pool must be one of {self.POOLS}, got {pool!r}")
        self.scale_by_std = bool(scale_by_std)
        self.pool = pool

    def compute(self, rollouts: Sequence[Any]) -> dict[RolloutStepKey, float]:
        rs, returns, groups = self._returns_and_groups(rollouts)
        if self.pool == "step":
            return self._per_step(rs, groups)
        adv = [0.0] * len(rs)
        for members in groups:
            xs = [returns[i] for i in members]
            for i, a in zip(members, self._normalised(xs), strict=True):
                adv[i] = a
        return self._assign(rs, adv)

    def _per_step(self, rs: list[Any], groups: list[list[int]]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for members in groups:
            keys = [(rs[i].id, s.index) for i in members for s in rs[i].steps]
            xs = [step_reward(rs[i], s) for i in members for s in rs[i].steps]
            out.update(zip(keys, self._normalised(xs), strict=True))
        return out

    def _normalised(self, xs: list[float]) -> list[float]:
        if max(xs) == min(xs):
            return [0.0] * len(xs)  # no spread: exactly 0
        mean, std = self._spread(xs)
        return [(x - mean) / (std + self.eps) if self.scale_by_std else x - mean for x in xs]


class ScaleRLAssigner(_GroupAssigner):
    """ScaleRL advantages: ``A = (R - mean_g) / (std_batch + eps)``, ``std_batch`` the population
    std of the group-centred advantages of every group with a spread (see the module docstring).
    All-equal groups (and groups of one) get 0 and do not enter ``std_batch``."""

    def compute(self, rollouts: Sequence[Any]) -> dict[RolloutStepKey, float]:
        rs, returns, groups = self._returns_and_groups(rollouts)
        adv = [0.0] * len(rs)
        centred: list[float] = []
        for members in groups:
            xs = [returns[i] for i in members]
            if max(xs) == min(xs):
                continue
            mean = math.fsum(xs) / len(xs)
            for i, x in zip(members, xs, strict=True):
                adv[i] = x - mean
                centred.append(x - mean)
        if centred:
            _, std = self._spread(centred)
            adv = [a / (std + self.eps) for a in adv]
        return self._assign(rs, adv)
