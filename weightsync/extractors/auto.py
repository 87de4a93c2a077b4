"""Which extractor fits a model: chosen from what the model is.

Callers: the front door (``weightsync.connect``) and anyone who holds a model and wants the
right extractor without naming it. Runs on every training rank (the answer is the same on each:
it reads only the model's structure, no collective).

============================================  ==============
the model                                     extractor type
============================================  ==============
a DeepSpeed engine, or ZeRO-3 (``ds_id``)      ``deepspeed``
FSDP2: DTensor parameters                     ``fsdp``
PEFT with an active, unmerged LoRA adapter    ``lora_merge``
anything else (HF, plain ``nn.Module``)        ``hf``
============================================  ==============

``extractor_config_for(model, ...)`` turns that into a config for ``build_extractor``, with the
bucket size, the sending rank and, for a head-only update, the head patterns (``hf`` becomes
``hf_head``; the others filter by ``name_patterns``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync.config import DEFAULT_BUCKET_MB

#: model kind -> extractor type
EXTRACTOR_FOR_KIND = {"deepspeed": "deepspeed", "fsdp": "fsdp", "peft": "lora_merge", "hf": "hf"}


def model_kind(model: Any) -> str:
    """``"deepspeed"``, ``"fsdp"``, ``"peft"`` or ``"hf"`` (see the module docstring); a list
    of model chunks (Megatron's virtual pipeline stages) is the kind of its first."""
    if isinstance(model, (list, tuple)) and model and hasattr(model[0], "parameters"):
        return model_kind(model[0])
    if type(model).__name__ == "DeepSpeedEngine" and type(model).__module__.startswith("deepspeed"):
        return "deepspeed"
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    for p in params:
        if hasattr(p, "ds_id"):
            return "deepspeed"
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "fsdp"
    from weightsync.extractors.lora_layers import has_active_lora

    if has_active_lora(model):
        return "peft"
    return "hf"


def extractor_config_for(
    model: Any,
    *,
    bucket_size_mb: float = DEFAULT_BUCKET_MB,
    rank: int = 0,
    src_rank: int = 0,
    is_sender: bool = True,
    head_name_patterns: Sequence[str] | None = None,
) -> dict[str, Any]:
    """An extractor config for ``model``. ``head_name_patterns`` (a head-only update): only
    those names are extracted."""
    kind = EXTRACTOR_FOR_KIND[model_kind(model)]
    cfg: dict[str, Any] = {"type": kind, "bucket_size_mb": float(bucket_size_mb),
                           "is_sender": bool(is_sender)}
    if kind in ("fsdp", "deepspeed"):
        cfg.update(rank=int(rank), src_rank=int(src_rank))
    if head_name_patterns is not None:
        if kind == "hf":
            cfg.update(type="hf_head", head_name_patterns=list(head_name_patterns))
        else:
            cfg["name_patterns"] = list(head_name_patterns)
    return cfg


def device_of(source: Any) -> Any:
    """The device of the first tensor of a model or a mapping of tensors (None if it has none):
    what the front door reads to pick a transport backend. A list of model chunks: its first."""
    if isinstance(source, (list, tuple)) and source and hasattr(source[0], "parameters"):
        source = source[0]
    if hasattr(source, "parameters"):
        for p in source.parameters():
            return p.device
        return None
    values = source.values() if hasattr(source, "values") else (t for _, t in source)
    for t in values:
        return getattr(t, "device", None)
    return None
