"""Metadata checks run before the data plane moves a byte.

Callers: engine-side endpoints (``WeightUpdateEndpoint.start_weight_update`` and per chunk),
loaders' ``validate`` and trainer-side pre-checks. Pure functions over ``TensorMeta`` and names;
no torch needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from weightsync.errors import WeightMismatchError
from weightsync.types import TensorMeta, TrainingMode


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


def size_offenders(
    incoming: Iterable[TensorMeta],
    expected: Mapping[str, TensorMeta] | None,
    *,
    whole_update: bool = False,
) -> list[str]:
    """The metadata limits of an update against the model it targets (``expected``; no limits
    when the target is unknown): no tensor larger than the parameter it targets, and with
    ``whole_update`` (a start's manifest) no more tensors and no more bytes than the model has.
    Names and shapes themselves are the loader's check (a tensor of another shape is left to it);
    this bounds what an engine allocates for an update even where a loader accepts casts (a bf16
    engine sent float64)."""
    if expected is None:
        return []
    incoming = list(incoming)
    out = []
    for m in incoming:
        target = expected.get(m.name)
        if target is not None and list(m.shape) == list(target.shape) and m.nbytes > target.nbytes:
            out.append(f"{m.name}: {m.nbytes} bytes ({m.dtype}{list(m.shape)}) but the target "
                       f"holds {target.nbytes} ({target.dtype}{list(target.shape)}); send the "
                       f"engine's dtype")
    if whole_update and not out:
        if len(incoming) > len(expected):
            out.append(f"the update has {len(incoming)} tensors but the model only "
                       f"{len(expected)}")
        total, limit = sum(m.nbytes for m in incoming), sum(m.nbytes for m in expected.values())
        if total > limit:
            out.append(f"the update carries {total} bytes but the model's parameters hold "
                       f"{limit}")
    return out


def training_mode_offenders(
    names: Sequence[str],
    mode: TrainingMode | str,
    head_patterns: Iterable[str] | None = None,
    *,
    whole_update: bool = False,
) -> list[str]:
    """One line per name the training mode forbids (empty: allowed); see ``TrainingMode``.

    Every mode refuses unmerged adapter tensors (an engine cannot load them). HEAD_ONLY: only
    head parameters. FULL with ``whole_update`` (the manifest of a whole update): at least one
    backbone parameter. Callers: ``WeightUpdateEndpoint`` (engine side, on the start's manifest
    and on every chunk) and trainer-side checks (the front door, the reward publisher).
    """
    from weightsync.naming import DEFAULT_HEAD_NAME_PATTERNS, is_lora_param, non_head_params

    mode = TrainingMode.parse(mode)
    patterns = DEFAULT_HEAD_NAME_PATTERNS if head_patterns is None else tuple(head_patterns)
    out = [
        f"{n}: an unmerged LoRA tensor; merge the adapters (lora_merge extractor) and send "
        f"engine weights"
        for n in names if is_lora_param(n)
    ]
    if mode is TrainingMode.HEAD_ONLY:
        out += [
            f"{n}: not a head parameter (head patterns {list(patterns)}); a head_only update "
            f"may carry only the reward head"
            for n in non_head_params(names, patterns) if not is_lora_param(n)
        ]
    elif mode is TrainingMode.FULL and whole_update and names and not non_head_params(names, patterns):
        out.append(
            f"update carries only head parameters {sorted(names)[:5]}; full mode requires "
            f"backbone weights (use head_only when only the head is trained)"
        )
    return out


def _closest(name: str, expected: Mapping[str, TensorMeta]) -> str | None:
    import difflib

    if len(expected) > 20000:
        return None
    hits = difflib.get_close_matches(name, list(expected), n=1, cutoff=0.8)
    return hits[0] if hits else None
