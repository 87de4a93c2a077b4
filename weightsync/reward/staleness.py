"""Version drift between the policy that sampled rollouts and the reward model that scored them.

The reward plan tracks the two versions independently and warns when they drift apart. Who
calls: ``RewardModelScorer.score``, after a run, with the ``policy_version`` the rollout engine
put in each rollout's meta and the reward model versions the scores came from. When some pair is
more than ``max_version_gap`` versions apart, ``VersionDriftWarning`` says which, by how much and
what to do: the rewards then judge a policy the reward model was not kept in step with (a
co-trained reward model that stopped being synced, or scores from an old reward server). A
reward model trained once and frozen (cold-start RLHF) drifts by design: turn the check off with
``max_version_gap=None``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

#: Versions apart the policy and the reward model may be before the warning: one step of lag is
#: what a pipeline that scores step k's rollouts before syncing step k's reward model has.
DEFAULT_MAX_VERSION_GAP = 1


class VersionDriftWarning(UserWarning):
    """The policy's and the reward model's weight versions are further apart than allowed."""


def checked_max_gap(value: int | None) -> int | None:
    """``value`` when it is None or an int >= 0.

    Raises:
        ValueError: anything else, naming ``max_version_gap``.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"max_version_gap must be an int >= 0 or None, got {value!r}")
    return value


def version_gap(
    policy_versions: Iterable[int | None], reward_versions: Iterable[int | None]
) -> tuple[int, int, int] | None:
    """The widest ``(gap, policy_version, reward_version)`` over the known versions; None when
    either side has none."""
    policy = sorted({int(v) for v in policy_versions if v is not None})
    reward = sorted({int(v) for v in reward_versions if v is not None})
    if not policy or not reward:
        return None
    pairs = [(abs(p - r), p, r) for p in (policy[0], policy[-1]) for r in (reward[0], reward[-1])]
    return max(pairs)


class DriftCheck:
    """``warn_on_drift`` once per drift: after a warning, the same scorer stays quiet until the
    versions come back within ``max_version_gap`` (a frozen reward model would otherwise warn
    at every training step)."""

    def __init__(self, max_version_gap: int | None = DEFAULT_MAX_VERSION_GAP) -> None:
        self.max_version_gap = checked_max_gap(max_version_gap)
        self.warned = False

    def __call__(
        self, policy_versions: Iterable[int | None], reward_versions: Iterable[int | None]
    ) -> int | None:
        """The widest gap (None when unknown), warning as the class docstring says."""
        gap = warn_on_drift(policy_versions, reward_versions,
                            None if self.warned else self.max_version_gap)
        if gap is not None and self.max_version_gap is not None:
            self.warned = gap > self.max_version_gap
        return gap


def warn_on_drift(
    policy_versions: Iterable[int | None],
    reward_versions: Iterable[int | None],
    max_version_gap: int | None,
) -> int | None:
    """Warn (``VersionDriftWarning``) when the versions are more than ``max_version_gap``
    apart; returns the widest gap (None when unknown). ``max_version_gap=None``: never warns."""
    found = version_gap(policy_versions, reward_versions)
    if found is None:
        return None
    gap, p, r = found
    if max_version_gap is not None and gap > max_version_gap:
        warnings.warn(
            f"reward model version {r} and policy version {p} are {gap} versions apart "
            f"(max_version_gap={max_version_gap}): the rewards come from a reward model that "
            f"was not kept in step with the policy; sync the reward model "
            f"(VLLMRewardClient.sync_weights / RewardModelPublisher.publish), or pass "
            f"max_version_gap=None when it is frozen on purpose",
            VersionDriftWarning, stacklevel=4,
        )
    return gap
