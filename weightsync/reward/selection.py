"""What one reward-model update may carry, decided from names and metadata before any byte moves.

Who calls: ``VLLMRewardClient.sync_weights`` and ``RewardModelPublisher``, in the training
process, on explicit parameters (a state dict or ``(name, tensor)`` pairs).

``select_params(params, training_mode, head_name_patterns)``:

1. **Names** become engine (HF checkpoint) names through ``weightsync.naming``: PEFT
   ``base_model.model.`` and ``.base_layer``, FSDP ``_fsdp_wrapped_module.``, DDP / DeepSpeed
   ``module.``, ``torch.compile`` ``_orig_mod.`` are stripped; PEFT's copy of the original
   head is skipped. Then the reward spec's rewrite (``reference_name``): a leading
   ``model.model.`` loses one ``model.`` and a bare ``layers.`` gains one (a wrapper holding
   the HF model as ``.model``, or the inner ``model.model`` state dict).
2. **Unmerged adapters** (``lora_A`` / ``lora_B`` / DoRA magnitudes): ``unmerged_lora="refuse"``
   (default) refuses them, whatever the mode: a PEFT state dict cannot be merged without the
   adapter's scaling, and dropping the adapter tensors would send the pre-training base weights
   as if they were the trained ones. Publish the PEFT model itself (``RewardModelPublisher``
   merges its adapters) or send ``model.merge_and_unload().state_dict()``.
   ``unmerged_lora="skip"`` is the reference's: FULL / HEAD_ONLY drop them with a
   ``TrainingModeWarning``; LORA keeps them, and they are refused as the engine refuses them
   (it loads merged weights only).
3. **HEAD_ONLY** given more than the head (``head_name_patterns``, default ``score.``,
   ``classifier.``, ``lm_head.``, ``v_head.``) warns (``TrainingModeWarning``) naming the
   others, then: ``head_only_extra="drop"`` keeps the head only (the reference publisher's);
   ``"send"`` sends everything (the reference client's), checked as what it carries, a full
   update (``effective_mode``).
4. **Checks** (``check_update``): HEAD_ONLY needs a head, FULL and LORA need backbone weights
   (and warn without a head: the served head then stays as it is), and with ``expected``
   engine metadata unknown names and wrong shapes are refused. ``WeightMismatchError`` lists
   every offender; nothing has been sent.

Names are sorted naturally (``layers.2`` before ``layers.10``) so the same tensors always travel
in the same order.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.errors import WeightMismatchError
from weightsync.naming import NamingError, engine_names, is_lora_param
from weightsync.reward.types import (
    DEFAULT_HEAD_NAME_PATTERNS,
    RewardModelTrainingMode,
    non_head_params,
    training_mode_offenders,
)
from weightsync.types import TensorMeta, dtype_to_str

if TYPE_CHECKING:  # pragma: no cover
    import torch


class TrainingModeWarning(UserWarning):
    """A training mode dropped tensors it does not carry (e.g. HEAD_ONLY given a whole model)."""


def named_items(params: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs from a mapping or an iterable of pairs, detached."""
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"params: item {i} is not a (name, tensor) pair")
        if not hasattr(item[1], "dtype") or not hasattr(item[1], "shape"):
            raise TypeError(f"params: {item[0]!r} is a {type(item[1]).__name__}, not a tensor")
        out.append((item[0], item[1].detach()))
    if not out:
        raise ValueError("params: nothing to send (no tensors given)")
    return out


UNMERGED_LORA = ("refuse", "skip")
HEAD_ONLY_EXTRA = ("drop", "send")


def reference_name(name: str) -> str:
    """The reward spec's last rewrite of an engine name: ``model.model.x`` -> ``model.x``,
    ``layers.x`` -> ``model.layers.x``; anything else unchanged."""
    if name.startswith("model.model."):
        name = name[len("model."):]
    if name.startswith("layers."):
        name = "model." + name
    return name


def check_options(unmerged_lora: str, head_only_extra: str) -> tuple[str, str]:
    """The two choices of ``select_params``, checked.

    Raises:
        ValueError: one is not among its choices, naming it.
    """
    for what, value, choices in (("unmerged_lora", unmerged_lora, UNMERGED_LORA),
                                 ("head_only_extra", head_only_extra, HEAD_ONLY_EXTRA)):
        if value not in choices:
            raise ValueError(f"{what} must be one of {list(choices)}, got {value!r}")
    return unmerged_lora, head_only_extra


def select_params(
    params: Any,
    training_mode: RewardModelTrainingMode | str,
    head_name_patterns: Sequence[str] | None = None,
    *,
    dtype: Any = None,
    expected: Mapping[str, TensorMeta] | None = None,
    unmerged_lora: str = "refuse",
    head_only_extra: str = "drop",
) -> list[tuple[str, torch.Tensor]]:
    """Engine-named tensors for one update of ``training_mode`` (see the module docstring).

    Raises:
        ValueError: ``unmerged_lora`` / ``head_only_extra`` is not one of its choices.
        WeightMismatchError: the selection breaks the mode or the engine's metadata.
    """
    mode = RewardModelTrainingMode.parse(training_mode)
    check_options(unmerged_lora, head_only_extra)
    patterns = list(head_name_patterns or DEFAULT_HEAD_NAME_PATTERNS)
    items = _without_unmerged_lora(named_items(params), mode, unmerged_lora)
    try:
        mapping = engine_names(n for n, _ in items)
    except NamingError as e:
        raise WeightMismatchError([str(e)], target=f"{mode.value} update") from None
    named = _renamed([(mapping[n], t) for n, t in items if n in mapping], mode)
    if mode is RewardModelTrainingMode.HEAD_ONLY:
        others = set(non_head_params([n for n, _ in named], patterns))
        if others and len(others) < len(named):
            shown = sorted(others, key=natural_key)
            send = head_only_extra == "send"
            warnings.warn(
                f"training_mode=head_only: {'sent' if send else 'kept'} the "
                f"{len(named) - len(others)} head tensor(s) (patterns {patterns}) and "
                f"{'sent' if send else 'dropped'} {len(others)} other(s)"
                f"{' as well (a full update)' if send else ''}: "
                f"{', '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}",
                TrainingModeWarning, stacklevel=3,
            )
            if not send:
                named = [(n, t) for n, t in named if n not in others]
    named.sort(key=lambda item: natural_key(item[0]))
    if dtype is not None:
        named = [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in named]
    check_update([TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named],
                 effective_mode([n for n, _ in named], mode, patterns), patterns, expected)
    return named


def effective_mode(
    names: Sequence[str], training_mode: RewardModelTrainingMode | str,
    head_name_patterns: Sequence[str] | None = None,
) -> RewardModelTrainingMode:
    """The mode an update is announced and checked as: FULL for a HEAD_ONLY selection that
    carries backbone tensors too (``head_only_extra="send"``) and a head, else the mode given."""
    mode = RewardModelTrainingMode.parse(training_mode)
    patterns = list(head_name_patterns or DEFAULT_HEAD_NAME_PATTERNS)
    others = non_head_params(names, patterns)
    if mode is RewardModelTrainingMode.HEAD_ONLY and others and len(others) < len(names):
        return RewardModelTrainingMode.FULL
    return mode


def _without_unmerged_lora(
    items: list[tuple[str, Any]], mode: RewardModelTrainingMode, unmerged_lora: str
) -> list[tuple[str, Any]]:
    """``items`` less unmerged adapter tensors where ``unmerged_lora="skip"`` drops them
    (warning); refused where they stay (the default, and LORA under ``"skip"``)."""
    lora = [n for n, _ in items if is_lora_param(n)]
    if not lora:
        return items
    if unmerged_lora == "skip" and mode is not RewardModelTrainingMode.LORA:
        warnings.warn(
            f"training_mode={mode.value}: skipped {len(lora)} unmerged LoRA tensor(s) "
            f"({', '.join(lora[:4])}{' ...' if len(lora) > 4 else ''}); the engine gets the "
            f"weights without the adapters. Merge them before syncing: "
            f"model.merge_and_unload().state_dict()",
            TrainingModeWarning, stacklevel=4,
        )
        return [(n, t) for n, t in items if not is_lora_param(n)]
    raise WeightMismatchError(
        [f"{n}: an unmerged LoRA tensor; publish the PEFT model itself (its adapters are "
         f"merged on the way) or send model.merge_and_unload().state_dict()" for n in lora],
        target=f"{mode.value} update",
    )


def _renamed(
    named: list[tuple[str, Any]], mode: RewardModelTrainingMode
) -> list[tuple[str, Any]]:
    """``named`` under ``reference_name``; two sources reaching one name are refused."""
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    clashes = []
    for n, t in named:
        new = reference_name(n)
        if new in out:
            clashes.append(f"{new}: given twice (as {source[new]!r} and as {n!r})")
        out[new], source[new] = t, n
    if clashes:
        raise WeightMismatchError(clashes, target=f"{mode.value} update")
    return list(out.items())


def check_update(
    metas: Sequence[TensorMeta],
    training_mode: RewardModelTrainingMode | str,
    head_name_patterns: Sequence[str] | None = None,
    expected: Mapping[str, TensorMeta] | None = None,
) -> None:
    """Refuse (``WeightMismatchError``, every offender listed) an update the mode or the engine
    cannot take: nothing selected, a head-only update without a head, a full or LoRA update
    without backbone weights, unmerged adapters, and (with ``expected``) unknown names or
    wrong shapes."""
    mode = RewardModelTrainingMode.parse(training_mode)
    patterns = list(head_name_patterns or DEFAULT_HEAD_NAME_PATTERNS)
    names = [m.name for m in metas]
    if not names:
        what = "head " if mode is RewardModelTrainingMode.HEAD_ONLY else ""
        raise WeightMismatchError(
            [f"nothing to send: no {what}tensors selected (head patterns {patterns})"],
            target=f"{mode.value} update",
        )
    offenders = training_mode_offenders(names, mode, patterns, whole_update=True)
    headless = len(non_head_params(names, patterns)) == len(names)
    if mode is not RewardModelTrainingMode.HEAD_ONLY and headless:
        warnings.warn(
            f"training_mode={mode.value}: no head tensor (patterns {patterns}); the reward "
            f"model's head on the server is not updated", TrainingModeWarning, stacklevel=3)
    if mode is RewardModelTrainingMode.LORA and not non_head_params(names, patterns):
        offenders.append(
            f"update carries only head parameters {sorted(names)[:5]}; a lora update sends the "
            f"merged backbone too (use head_only when only the head is trained)"
        )
    if expected is not None:
        from weightsync.validation import find_mismatches

        offenders += find_mismatches(list(metas), dict(expected), check_dtype=False)
    if offenders:
        raise WeightMismatchError(offenders, target=f"{mode.value} update")


def natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def expected_metadata(spec: Any) -> dict[str, TensorMeta] | None:
    """Engine metadata from ``{name: TensorMeta | dict}``, TensorMetas, or a checkpoint dir."""
    if spec is None:
        return None
    if isinstance(spec, str):
        from weightsync._runtime.vllm_compat import checkpoint_metadata

        found = checkpoint_metadata(spec)
        if found is None:
            raise FileNotFoundError(f"engine_metadata: no *.safetensors in {spec!r}")
        return {n: TensorMeta(n, d, s) for n, (d, s) in found.items()}
    if isinstance(spec, Mapping):
        return {str(k): v if isinstance(v, TensorMeta) else TensorMeta.from_dict(
            {"name": k, **v}) for k, v in spec.items()}
    if isinstance(spec, Iterable):
        metas = [m if isinstance(m, TensorMeta) else TensorMeta.from_dict(m) for m in spec]
        return {m.name: m for m in metas}
    raise TypeError(f"engine_metadata: expected a mapping, TensorMetas or a checkpoint directory, "
                    f"got {type(spec).__name__}")
