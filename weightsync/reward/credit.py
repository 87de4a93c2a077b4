"""``RewardModelCreditAssigner``: mix reward-model scores with environment rewards per rollout,
optionally normalised GRPO-style within each prompt group.

Who calls: the RL loop, after ``RewardModelScorer`` wrote the scores and before advantages are
computed. Pure Python over floats (no torch); deterministic.

Modes (``s`` = reward-model score, ``r`` = environment reward):

============  =========================================  ======================================
mode          reward                                     typical use
============  =========================================  ======================================
``replace``   ``s``                                      RLHF: the reward model is the reward
``add``       ``r + weight * s``                         shaped reward on top of a verifier
``multiply``  ``r * s``                                  gate the model score by success
``weighted``  ``(1 - weight) * r + weight * s``          interpolate (``0 <= weight <= 1``)
``bonus``     ``r + bonus`` if ``s > threshold`` else    a fixed bonus when the reward model
              ``r``                                      approves (e.g. style / safety)
============  =========================================  ======================================

``group_normalize=True`` then maps each reward to ``(x - mean_g) / (std_g + eps)`` over the
rollouts of its group ``g`` (GRPO; groups are usually "same prompt"). ``std`` is the sample
standard deviation (Bessel-corrected, as TRL and verl compute it); a group of one rollout has
std 0 and normalises to 0. ``scale_by_std=False`` only subtracts the group mean (Dr. GRPO).

Multi-label reward models (a list of scores per text) need ``label_index`` to pick the label.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

MODES = ("replace", "add", "multiply", "weighted", "bonus")

_MISSING = object()


class RewardModelCreditAssigner:
    """Turn reward-model scores (+ environment rewards) into the per-rollout rewards RL uses."""

    def __init__(
        self,
        mode: str = "replace",
        *,
        weight: float = 1.0,
        bonus: float = 1.0,
        threshold: float = 0.0,
        group_normalize: bool = False,
        eps: float = 1e-6,
        scale_by_std: bool = True,
        label_index: int | None = None,
        metadata_key: str = "rm_score",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown credit mode {mode!r}; valid modes: {', '.join(MODES)}")
        for name, value in (("weight", weight), ("bonus", bonus), ("threshold", threshold),
                            ("eps", eps)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if mode == "weighted" and not 0.0 <= weight <= 1.0:
            raise ValueError(f"weighted mode needs 0 <= weight <= 1, got {weight}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if label_index is not None and (
            isinstance(label_index, bool) or not isinstance(label_index, int) or label_index < 0
        ):
            raise ValueError(f"label_index must be an int >= 0 or None, got {label_index!r}")
        self.mode = mode
        self.weight = float(weight)
        self.bonus = float(bonus)
        self.threshold = float(threshold)
        self.group_normalize = bool(group_normalize)
        self.eps = float(eps)
        self.scale_by_std = bool(scale_by_std)
        self.label_index = label_index
        self.metadata_key = metadata_key

    @property
    def needs_env_rewards(self) -> bool:
        return self.mode != "replace"

    # -- on plain lists ------------------------------------------------------------------------
    def assign(
        self,
        scores: Sequence[Any],
        env_rewards: Sequence[Any] | None = None,
        group_ids: Sequence[Hashable] | None = None,
    ) -> list[float]:
        """Rewards for ``len(scores)`` rollouts: combine, then normalise per group if enabled."""
        s = self._scores(scores)
        n = len(s)
        r = self._env(env_rewards, n)
        out = [self._combine(si, ri) for si, ri in zip(s, r, strict=True)]
        if self.group_normalize:
            if group_ids is None:
                raise ValueError(
                    "group_normalize=True needs group_ids (one per rollout, e.g. the prompt)"
                )
            out = group_normalize(out, group_ids, eps=self.eps, scale_by_std=self.scale_by_std)
        return out

    def _combine(self, s: float, r: float | None) -> float:
        if self.mode == "replace":
            return s
        assert r is not None
        if self.mode == "add":
            return r + self.weight * s
        if self.mode == "multiply":
            return r * s
        if self.mode == "weighted":
            return (1.0 - self.weight) * r + self.weight * s
        return r + self.bonus if s > self.threshold else r  # bonus

    def _scores(self, scores: Sequence[Any]) -> list[float]:
        if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
            raise ValueError(f"scores must be a sequence, got {type(scores).__name__}")
        missing = [i for i, x in enumerate(scores) if x is None]
        if missing:
            raise ValueError(
                f"missing reward-model scores for rollouts {_few(missing)} "
                f"({len(missing)} of {len(scores)}); score them first (RewardModelScorer)"
            )
        return [self._one_score(i, x) for i, x in enumerate(scores)]

    def _one_score(self, i: int, x: Any) -> float:
        if isinstance(x, (list, tuple)):
            if self.label_index is None:
                if len(x) != 1:
                    raise ValueError(
                        f"rollout {i}: the reward model gives {len(x)} labels per text; set "
                        f"label_index to pick one"
                    )
                x = x[0]
            else:
                if self.label_index >= len(x):
                    raise ValueError(
                        f"rollout {i}: label_index {self.label_index} but only {len(x)} labels"
                    )
                x = x[self.label_index]
        return _number(x, f"rollout {i}: score")

    def _env(self, env_rewards: Sequence[Any] | None, n: int) -> list[float | None]:
        if env_rewards is None:
            if self.needs_env_rewards:
                raise ValueError(f"mode {self.mode!r} needs env_rewards (one per rollout)")
            return [None] * n
        if len(env_rewards) != n:
            raise ValueError(
                f"length mismatch: {n} scores but {len(env_rewards)} env_rewards"
            )
        if not self.needs_env_rewards:
            return [None] * n
        missing = [i for i, x in enumerate(env_rewards) if x is None]
        if missing:
            raise ValueError(
                f"missing environment rewards for rollouts {_few(missing)} (mode {self.mode!r} "
                f"needs them)"
            )
        return [
            _number(x, f"rollout {i}: env reward", allow_bool=True)
            for i, x in enumerate(env_rewards)
        ]

    # -- on rollouts ---------------------------------------------------------------------------
    def assign_rollouts(
        self,
        rollouts: Sequence[Any],
        *,
        env_reward_key: str = "reward",
        group_key: str | Callable[[Any], Hashable] = "prompt",
        output_key: str | None = None,
    ) -> list[float]:
        """Read scores from ``metadata[metadata_key]``, env rewards from ``env_reward_key`` (a
        field of the rollout, or of its metadata) and groups from ``group_key`` (a field name or a
        function); optionally write the result to ``metadata[output_key]``."""
        rollouts = list(rollouts)
        scores = []
        for ro in rollouts:
            meta = _get(ro, "metadata")
            if not isinstance(meta, Mapping) or self.metadata_key not in meta:
                scores.append(None)
                continue
            scores.append(meta[self.metadata_key])
        env = None
        if self.needs_env_rewards:
            env = []
            for ro in rollouts:
                v = _get(ro, env_reward_key)
                if v is _MISSING or v is None:  # not on the rollout: look in its metadata
                    meta = _get(ro, "metadata")
                    v = meta.get(env_reward_key, None) if isinstance(meta, Mapping) else None
                env.append(v)
        groups = None
        if self.group_normalize:
            groups = []
            for i, ro in enumerate(rollouts):
                g = group_key(ro) if callable(group_key) else _get(ro, group_key)
                if g is _MISSING:
                    raise ValueError(f"rollout {i}: no group field {group_key!r} (group_key)")
                try:
                    hash(g)
                except TypeError:
                    raise ValueError(
                        f"rollout {i}: group id of type {type(g).__name__} is not hashable"
                    ) from None
                groups.append(g)
        out = self.assign(scores, env, groups)
        if output_key is not None:
            for ro, value in zip(rollouts, out, strict=True):
                meta = _get(ro, "metadata")
                if isinstance(meta, dict):
                    meta[output_key] = value
        return out


def group_normalize(
    values: Sequence[float],
    group_ids: Sequence[Hashable],
    *,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> list[float]:
    """``(x - mean_g) / (std_g + eps)`` per group (sample std; a group of one gives 0)."""
    if len(values) != len(group_ids):
        raise ValueError(f"length mismatch: {len(values)} rewards but {len(group_ids)} group ids")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(values)
    for idx in members.values():
        xs = [float(values[i]) for i in idx]
        mean = math.fsum(xs) / len(xs)
        if len(xs) > 1:
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        else:
            std = 0.0
        for i, x in zip(idx, xs, strict=True):
            centred = x - mean
            out[i] = centred / (std + eps) if scale_by_std and std + eps > 0 else centred
    return out


def _get(rollout: Any, key: str) -> Any:
    if isinstance(rollout, Mapping):
        return rollout.get(key, _MISSING)
    return getattr(rollout, key, _MISSING)


def _number(x: Any, what: str, *, allow_bool: bool = False) -> float:
    """A finite float; env rewards may be booleans (a verifier's pass/fail), scores may not."""
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        x = x.item()
    if (isinstance(x, bool) and not allow_bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{what} must be a number, got {type(x).__name__}")
    f = float(x)
    if not math.isfinite(f):
        raise ValueError(f"{what} is not finite ({f})")
    return f


def _few(idx: list[int], k: int = 10) -> str:
    return str(idx[:k])[:-1] + (", ...]" if len(idx) > k else "]")
