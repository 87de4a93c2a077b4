"""What an RL loop hands to reward scoring and credit assignment: ``Rollout``, ``Step``,
``RolloutStepKey`` and the ``CreditAssigner`` protocol.

Plain data (no torch, no vLLM), cheap to import. The field names are those of the reward-model
design this package implements, so code written against it runs unchanged:

- ``Step(index, prev_obs, action, next_obs=None, reward=0.0, truncated=False, terminated=False,
  info={}, meta={})``: one agent turn. ``prev_obs`` is what the policy saw, ``action`` what it
  wrote, ``reward`` the environment's reward for it. ``meta`` holds per-step annotations
  (a step-level reward-model score goes there), ``info`` what the environment reported.
- ``Rollout(id, steps, meta)``: one episode. ``meta["initial_obs"]`` names the prompt the episode
  started from; group-normalising assigners (GRPO, ScaleRL) group rollouts by it and fall back
  to the first step's ``prev_obs``. A sequence-level reward-model score goes in ``meta``.
- ``RolloutStepKey = (rollout.id, step.index)``: the key of one step's weight.
- ``CreditAssigner``: ``compute(rollouts) -> {RolloutStepKey: float}``, synchronous, with a
  weight for every step of every rollout (and nothing else).
- ``SAWItem(input_ids, attention_mask, action_mask, weight, actor_logps=None, meta={})``: one
  state-action-weight training sample (the prompt and completion tokens, 1 in ``action_mask``
  for the completion's, the step's credit); ``SAWBatch(items, meta={})``; ``BatchSource``:
  ``async next_batch() -> SAWBatch`` (``weightsync.reward.rollout_engine`` makes them).

Who builds these: the RL loop, after sampling. Who reads them: ``RewardModelScorer`` (writes
scores into ``meta``), credit assigners (read rewards and scores; they never mutate rollouts).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

RolloutStepKey = tuple[str, int]
"""``(rollout.id, step.index)``: identifies one step of one rollout in a batch."""


@dataclass
class Step:
    """One turn: the observation the policy saw, the action it took, the reward it got.

    Positional order as in the design (``index, prev_obs, action, next_obs, reward, truncated,
    terminated, info``); everything after ``action`` has a default. ``meta`` is ours: per-step
    annotations such as a process-reward score (``RewardModelScorer(score_level="step")``).
    """

    index: int
    prev_obs: str
    action: str
    next_obs: str | None = None
    reward: float = 0.0
    truncated: bool = False
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollout:
    """One episode: its steps in order and its metadata (``initial_obs``, scores, ...)."""

    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    steps: list[Step] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        """The undiscounted sum of the steps' environment rewards."""
        return float(sum(s.reward for s in self.steps))

    @property
    def length(self) -> int:
        return len(self.steps)

    def keys(self) -> list[RolloutStepKey]:
        """The ``RolloutStepKey`` of every step, in step order."""
        return [(self.id, s.index) for s in self.steps]


@runtime_checkable
class CreditAssigner(Protocol):
    """Maps a batch of rollouts to one scalar weight per step.

    Contract: synchronous; returns a key for every step of every rollout given (and no other);
    does not modify the rollouts. Implement it without subclassing anything.
    """

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]: ...


@dataclass
class SAWItem:
    """One state-action-weight sample: ``input_ids`` (prompt then completion tokens),
    ``attention_mask``, ``action_mask`` (1 on the completion's tokens, which the loss trains),
    ``weight`` (the step's credit), ``actor_logps`` (the sampling policy's log-probability of
    each completion token, for ratio-based losses; None if unknown), ``meta`` (the rollout id,
    the step index, versions)."""

    input_ids: list[int]
    attention_mask: list[int]
    action_mask: list[int]
    weight: float
    actor_logps: list[float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.attention_mask) != n or len(self.action_mask) != n:
            raise ValueError(f"SAWItem: input_ids ({n}), attention_mask "
                             f"({len(self.attention_mask)}) and action_mask "
                             f"({len(self.action_mask)}) must have one entry per token")
        actions = sum(1 for m in self.action_mask if m)
        if self.actor_logps is not None and len(self.actor_logps) != actions:
            raise ValueError(f"SAWItem: {len(self.actor_logps)} actor_logps for {actions} "
                             f"action tokens")

    @property
    def num_action_tokens(self) -> int:
        return sum(1 for m in self.action_mask if m)


@dataclass
class SAWBatch:
    """The samples of one training step and what made them (``meta``: e.g. the rollouts'
    rewards and the weight versions that sampled and scored them)."""

    items: list[SAWItem] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)


@runtime_checkable
class BatchSource(Protocol):
    """Where a trainer gets its next batch (e.g. ``RolloutBatchSource``: sample, score, assign
    credit)."""

    async def next_batch(self) -> SAWBatch: ...
