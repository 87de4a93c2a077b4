"""Reduce a multi-label reward model's score vector (``n_labels > 1``) to the one number credit
assignment needs.

``aggregate`` is a name from ``AGGREGATIONS`` (``"first"``, ``"last"``, ``"mean"``, ``"sum"``,
``"max"``, ``"min"``), an int (that label's column, negative counts from the end) or a callable
``f(list[float]) -> float``. A one-label score (a float) is returned as it is.

Default ``"first"``: column 0 is where a one-label head puts its score, so a model that grows
extra labels (e.g. auxiliary objectives after the main reward) keeps its meaning. Choose
``"mean"`` for an ensemble of equal objectives; an explicit index for a softmax classifier whose
"good" class is not column 0 (averaging softmax columns gives a constant).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Aggregate = str | int | Callable[[list[float]], float]

AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "first": lambda v: v[0],
    "last": lambda v: v[-1],
    "mean": lambda v: math.fsum(v) / len(v),
    "sum": math.fsum,
    "max": max,
    "min": min,
}
DEFAULT_AGGREGATE = "first"


def resolve_aggregate(aggregate: Aggregate) -> Callable[[list[float]], float]:
    """The reducing function for ``aggregate``; a clear ``ValueError`` for anything else."""
    if isinstance(aggregate, str):
        try:
            return AGGREGATIONS[aggregate]
        except KeyError:
            raise ValueError(
                f"aggregate: unknown name {aggregate!r}; choose one of {sorted(AGGREGATIONS)}, "
                f"a label index or a callable"
            ) from None
    if isinstance(aggregate, int) and not isinstance(aggregate, bool):
        index = aggregate

        def pick(v: list[float]) -> float:
            if not -len(v) <= index < len(v):
                raise ValueError(f"aggregate={index}: the score has only {len(v)} labels")
            return v[index]

        return pick
    if callable(aggregate):
        return aggregate
    raise ValueError(
        f"aggregate must be a name, a label index or a callable, got {type(aggregate).__name__}"
    )


def reduce_score(score: float | Sequence[float], fn: Callable[[list[float]], float]) -> float:
    """``score`` itself for one label, ``fn(vector)`` for a vector; the result must be finite."""
    if not isinstance(score, (list, tuple)):
        return float(score)
    out: Any = fn(list(score))
    if hasattr(out, "item") and not isinstance(out, (int, float)):
        out = out.item()
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out):
        raise ValueError(f"aggregate returned {out!r} for {list(score)}; expected a finite number")
    return float(out)
