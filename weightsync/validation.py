"""Metadata checks run before the data plane moves a byte.

Callers: engine-side endpoints (``WeightUpdateEndpoint.start_weight_update`` and per chunk) and
loaders' ``validate``. Pure functions over ``TensorMeta``; no torch needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from weightsync.errors import WeightMismatchError
from weightsync.types import TensorMeta


def find_mismatches(
    incoming: Iterable[TensorMeta],
    expected: Mapping[str, TensorMeta],
    *,
    check_dtype: bool = True,
) -> list[str]:
    """One line per incoming tensor whose name is unknown or whose shape/dtype differs."""
    offenders: list[str] = []
    for m in incoming:
        exp = expected.get(m.name)
        if exp is None:
            hint = _closest(m.name, expected)
            offenders.append(
                f"{m.name}: not a parameter of the target" + (f" (did you mean {hint!r}?)" if hint else "")
            )
            continue
        if list(m.shape) != list(exp.shape):
            offenders.append(f"{m.name}: shape {list(m.shape)} but target has {list(exp.shape)}")
        elif check_dtype and m.dtype != exp.dtype:
            offenders.append(f"{m.name}: dtype {m.dtype} but target has {exp.dtype}")
    return offenders


def check_metadata(
    incoming: Iterable[TensorMeta],
    expected: Mapping[str, TensorMeta] | None,
    *,
    check_dtype: bool = True,
    target: str = "target model",
) -> None:
    """Raise ``WeightMismatchError`` listing every offender; no-op when ``expected`` is None."""
    incoming = list(incoming)
    counts = Counter(m.name for m in incoming)
    dup = sorted(n for n, c in counts.items() if c > 1)
    offenders = [f"{n}: sent more than once in one update" for n in dup]
    if expected is not None:
        offenders += find_mismatches(incoming, expected, check_dtype=check_dtype)
    if offenders:
        raise WeightMismatchError(offenders, target=target)


def _closest(name: str, expected: Mapping[str, TensorMeta]) -> str | None:
    import difflib

    if len(expected) > 20000:
        return None
    hits = difflib.get_close_matches(name, list(expected), n=1, cutoff=0.8)
    return hits[0] if hits else None
