"""What one reward-model update may carry, decided from names and metadata before any byte moves.

Who calls: ``VLLMRewardClient.sync_weights`` and ``RewardModelPublisher``, in the training
process, on explicit parameters (a state dict or ``(name, tensor)`` pairs).

``select_params(params, training_mode, head_name_patterns)``:

1. **Names** become engine (HF checkpoint) names through ``weightsync.naming``: PEFT
   ``base_model.model.`` and ``.base_layer``, FSDP ``_fsdp_wrapped_module.``, DDP / DeepSpeed
   ``module.``, ``torch.compile`` ``_orig_mod.`` are stripped; PEFT's copy of the original
   head is skipped.
2. **Unmerged adapters** (``lora_A`` / ``lora_B`` / DoRA magnitudes) are refused, whatever the
   mode: a PEFT state dict cannot be merged without the adapter's scaling, and dropping the
   adapter tensors would send the pre-training base weights as if they were the trained ones.
   Publish the PEFT model itself (``RewardModelPublisher`` merges its adapters) or send
   ``model.merge_and_unload().state_dict()``.
3. **HEAD_ONLY** keeps only the head (``head_name_patterns``, default ``score.``,
   ``classifier.``, ``v_head.``); given more, it keeps the head and warns
   (``TrainingModeWarning``) naming what it dropped.
4. **Checks** (``check_update``): HEAD_ONLY needs a head, FULL and LORA need backbone weights,
   and with ``expected`` engine metadata unknown names and wrong shapes are refused.
   ``WeightMismatchError`` lists every offender; nothing has been sent.

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


def select_params(
    params: Any,
    training_mode: RewardModelTrainingMode | str,
    head_name_patterns: Sequence[str] | None = None,
    *,
    dtype: Any = None,
    expected: Mapping[str, TensorMeta] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Engine-named tensors for one update of ``training_mode`` (see the module docstring)."""
    mode = RewardModelTrainingMode.parse(training_mode)
    patterns = list(head_name_patterns or DEFAULT_HEAD_NAME_PATTERNS)
    items = named_items(params)
    lora = [n for n, _ in items if is_lora_param(n)]
    if lora:
        raise WeightMismatchError(
            [f"{n}: an unmerged LoRA tensor; publish the PEFT model itself (its adapters are "
             f"merged on the way) or send model.merge_and_unload().state_dict()" for n in lora],
            target=f"{mode.value} update",
        )
    try:
        mapping = engine_names(n for n, _ in items)
    except NamingError as e:
        raise WeightMismatchError([str(e)], target=f"{mode.value} update") from None
    named = [(mapping[n], t) for n, t in items if n in mapping]
    if mode is RewardModelTrainingMode.HEAD_ONLY:
        dropped = set(non_head_params([n for n, _ in named], patterns))
        if dropped and len(dropped) < len(named):
            shown = sorted(dropped, key=natural_key)
            warnings.warn(
                f"training_mode=head_only: kept the {len(named) - len(dropped)} head tensor(s) "
                f"(patterns {patterns}) and dropped {len(dropped)} other(s): "
                f"{', '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}",
                TrainingModeWarning, stacklevel=3,
            )
            named = [(n, t) for n, t in named if n not in dropped]
    named.sort(key=lambda item: natural_key(item[0]))
    if dtype is not None:
        named = [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in named]
    check_update([TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named], mode,
                 patterns, expected)
    return named


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
