"""Input checks shared by the credit assigners (private to ``weightsync.reward``).

Every check runs before any arithmetic and raises ``ValueError`` naming the rollout (and step)
at fault, so a bad batch fails the training step instead of producing a silent NaN gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from weightsync.reward.rollout import RolloutStepKey


def check_rollouts(rollouts: Iterable[Any]) -> list[Any]:
    """The rollouts as a list, after checking what every assigner relies on: unique ids, at
    least one step each, unique step indices within a rollout."""
    out = list(rollouts)
    seen: set[Any] = set()
    for pos, r in enumerate(out):
        for attr in ("id", "steps"):
            if not hasattr(r, attr):
                raise ValueError(
                    f"rollouts[{pos}]: a {type(r).__name__} has no {attr!r}; credit assigners "
                    f"take weightsync.reward.Rollout objects (id, steps, meta)"
                )
        if r.id in seen:
            raise ValueError(f"rollouts[{pos}]: duplicate rollout id {r.id!r}; ids key the weights")
        seen.add(r.id)
        if not r.steps:
            raise ValueError(f"rollout {r.id!r}: has no steps; there is nothing to assign credit to")
        indices = [s.index for s in r.steps]
        if len(set(indices)) != len(indices):
            dup = sorted({i for i in indices if indices.count(i) > 1})
            raise ValueError(f"rollout {r.id!r}: duplicate step indices {dup}")
    return out


def finite(x: Any, what: str, *, allow_bool: bool = False) -> float:
    """``x`` as a finite float, else ``ValueError`` naming ``what``. NaN and inf are refused:
    one of them would turn every advantage of its group (or batch) into NaN."""
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        x = x.item()  # a 0-d tensor / numpy scalar
    if isinstance(x, (list, tuple)):
        raise ValueError(
            f"{what} is a list of {len(x)} numbers, expected one; a multi-label reward model's "
            f"scores must be reduced first (RewardModelScorer(aggregate=...))"
        )
    if (isinstance(x, bool) and not allow_bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{what} must be a number, got {type(x).__name__}")
    f = float(x)
    if not math.isfinite(f):
        raise ValueError(f"{what} is {f}; refusing to assign credit from a non-finite value")
    return f


def step_reward(rollout: Any, step: Any) -> float:
    return finite(step.reward, f"rollout {rollout.id!r} step {step.index}: reward", allow_bool=True)


GroupKey = str | Callable[[Any], Hashable]


def group_of(rollout: Any, group_key: GroupKey) -> Hashable:
    """The group a rollout belongs to: ``group_key(rollout)`` for a callable, else
    ``rollout.meta[group_key]``, falling back to the first step's ``prev_obs``."""
    if callable(group_key):
        g = group_key(rollout)
    else:
        meta = getattr(rollout, "meta", None)
        g = meta[group_key] if isinstance(meta, Mapping) and group_key in meta else None
        if g is None:
            g = rollout.steps[0].prev_obs
    try:
        hash(g)
    except TypeError:
        raise ValueError(
            f"rollout {rollout.id!r}: group id of type {type(g).__name__} is not hashable; put a "
            f"string in meta[{group_key!r}] or pass group_key=callable"
        ) from None
    return g


def groups_of(
    rollouts: Sequence[Any], group_key: GroupKey, group_size: int | None
) -> list[list[int]]:
    """Positions of the rollouts of each group, groups in order of first appearance. With
    ``group_size``, every group must have exactly that many members."""
    members: dict[Hashable, list[int]] = {}
    for pos, r in enumerate(rollouts):
        members.setdefault(group_of(r, group_key), []).append(pos)
    if group_size is not None:
        bad = [(g, len(m)) for g, m in members.items() if len(m) != group_size]
        if bad:
            shown = ", ".join(f"{_short(g)}: {n}" for g, n in bad[:5])
            more = ", ..." if len(bad) > 5 else ""
            hint = (
                f"; sample group_size completions per prompt and give them the same "
                f"meta[{group_key!r}]" if isinstance(group_key, str) else ""
            )
            raise ValueError(
                f"group_size={group_size} but {len(bad)} group(s) have another size "
                f"({shown}{more}){hint}"
            )
    return list(members.values())


def check_weights(
    weights: Mapping[RolloutStepKey, Any], rollouts: Sequence[Any], who: str
) -> dict[RolloutStepKey, float]:
    """The ``CreditAssigner`` contract on a result: one finite weight for every step of every
    rollout, nothing else. Returns the weights in rollout/step order."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"{who}.compute returned {type(weights).__name__}, expected a dict")
    keys = [(r.id, s.index) for r in rollouts for s in r.steps]
    missing = [k for k in keys if k not in weights]
    extra = set(weights) - set(keys)
    if missing or extra:
        raise ValueError(
            f"{who}.compute broke the CreditAssigner contract: {len(missing)} step(s) without a "
            f"weight {missing[:5]}, {len(extra)} unknown key(s) {sorted(extra, key=str)[:5]}"
        )
    return {k: finite(weights[k], f"{who} weight for {k}") for k in keys}


def _short(g: Any, n: int = 40) -> str:
    s = repr(g)
    return s if len(s) <= n else s[: n - 3] + "..."
