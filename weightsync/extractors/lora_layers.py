"""PEFT LoRA layers as the extractors see them: which layers have adapters to merge, which
adapters cannot be merged here (variants such as DoRA), and the merge arithmetic the sharded
extractors apply to gathered tensors.

Callers: the ``lora_merge`` extractor (``lora.py``), the sharded extractors' base
(``_gather.py``) and the reward publisher (which picks an extractor by asking whether a model has
active LoRA layers). In the training process; imports peft only when a model has LoRA tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.naming import is_lora_param

if TYPE_CHECKING:  # pragma: no cover
    import torch


def lora_layers(model: Any, adapter_names: list[str] | None) -> list[tuple[str, Any, list[str]]]:
    """``(prefix, layer, adapters to merge)`` for every LoRA layer with an adapter to merge."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: a model without LoRA layers
        if any(is_lora_param(n) for n, _ in model.named_parameters()):
            raise ImportError("lora_merge extractor: the model has LoRA tensors but peft is not "
                              "installed (pip install 'weightsync[train]')") from None
        return []
    out = []
    for prefix, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or getattr(mod, "disable_adapters", False):
            continue
        present = set(getattr(mod, "lora_A", {})) | set(getattr(mod, "lora_embedding_A", {}))
        wanted = adapter_names if adapter_names is not None else list(mod.active_adapters)
        merged = set(getattr(mod, "merged_adapters", []))
        adapters = [a for a in wanted if a in present and a not in merged]
        if adapters:
            out.append((prefix, mod, adapters))
    return out


def has_active_lora(model: Any) -> bool:
    """Whether ``model`` has a PEFT LoRA layer with an adapter that is active and not merged."""
    return bool(lora_layers(model, None))


def refuse_variant(layer: Any, adapter: str) -> None:
    variants = getattr(layer, "lora_variant", {}) or {}
    if adapter in variants or (getattr(layer, "use_dora", {}) or {}).get(adapter, False):
        kind = type(variants.get(adapter)).__name__ if adapter in variants else "DoRA"
        raise NotImplementedError(
            f"lora_merge extractor: adapter {adapter!r} on {type(layer).__name__} is a LoRA "
            f"variant ({kind}); only vanilla LoRA is merged here. Merge it with PEFT "
            f"(merge_and_unload) and sync with the 'hf' extractor"
        )


def lora_merges(model: Any) -> dict[str, tuple[list[Any], Any]] | None:
    """For a (sharded) PEFT model: ``{base_layer tensor name: (adapter sources, merge)}``.

    ``merge(W, W_is_fresh, [A1, B1, A2, B2, ...])`` returns ``W + sum(scaling * B @ A)`` (the
    transpose for ``fan_in_fan_out``), PEFT's arithmetic (fp32 for half precision on CPU), and
    for a ``lora_bias`` bias ``b + sum(scaling * B.bias)``. Only vanilla LoRA on Linear layers;
    variants (DoRA...) and embedding/conv LoRA are refused with a clear error. None for a model
    without PEFT LoRA layers (its adapter-looking names are then refused by the naming rules);
    empty when every adapter is disabled or already merged (base weights are sent as they are).
    """
    if not any(is_lora_param(n) for n, _ in model.named_parameters()):
        return None
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - lora_layers raises the actionable error
        LoraLayer = ()  # noqa: N806
    if not any(isinstance(m, LoraLayer) for m in model.modules()):
        return None

    out: dict[str, tuple[list[Any], Any]] = {}
    for prefix, layer, adapters in lora_layers(model, None):
        pre = f"{prefix}." if prefix else ""
        for a in adapters:
            refuse_variant(layer, a)
            if a not in (getattr(layer, "lora_A", None) or {}):
                raise NotImplementedError(
                    f"{prefix}: LoRA on {type(layer).__name__} is merged by the sharded "
                    f"extractors only for Linear layers; gather and merge this model otherwise"
                )
        fan = bool(getattr(layer, "fan_in_fan_out", False))
        pairs = [(layer.lora_A[a].weight, layer.lora_B[a].weight, layer.scaling[a])
                 for a in adapters]
        out[pre + "base_layer.weight"] = (
            [t for A, B, _ in pairs for t in (A, B)], _weight_merger([s for *_, s in pairs], fan))
        biased = [(layer.lora_B[a].bias, layer.scaling[a]) for a in adapters
                  if (getattr(layer, "lora_bias", {}) or {}).get(a, False)]
        if biased:
            out[pre + "base_layer.bias"] = ([b for b, _ in biased],
                                            _bias_merger([s for _, s in biased]))
    return out


def _weight_merger(scalings: list[float], fan_in_fan_out: bool) -> Any:
    def merge(w: torch.Tensor, fresh: bool, extras: list[torch.Tensor]) -> torch.Tensor:
        import torch

        out = w if fresh else w.clone()
        with torch.no_grad():
            for i, s in enumerate(scalings):
                a, b = extras[2 * i], extras[2 * i + 1]
                half_on_cpu = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
                if half_on_cpu:
                    a, b = a.float(), b.float()
                delta = b @ a
                if fan_in_fan_out:
                    delta = delta.T
                delta = delta * s
                if half_on_cpu:
                    delta = delta.to(extras[2 * i + 1].dtype)
                out += delta.to(out.dtype)
        return out

    return merge


def _bias_merger(scalings: list[float]) -> Any:
    def merge(bias: torch.Tensor, fresh: bool, extras: list[torch.Tensor]) -> torch.Tensor:
        import torch

        out = bias if fresh else bias.clone()
        with torch.no_grad():
            for b, s in zip(extras, scalings, strict=True):
                out += (b * s).to(out.dtype)
        return out

    return merge
