"""``lora_adapter`` extractor: a PEFT LoRA model -> its adapter's ``lora_A`` / ``lora_B`` only.

Who calls: the sending training process, with an unsharded PEFT model whose base weights the
engine already serves (they are frozen: only the adapter trains). The update carries the
adapter's matrices under PEFT's saved names (``base_model.model.<module>.lora_A.weight``,
``[r, in_features]``; ``...lora_B.weight``, ``[out_features, r]``) and, in its start, the
adapter's name and ``LoraConfig`` (``adapter_spec(model)``: a
``weightsync.lora_adapter.LoRAAdapterSpec``); the engine installs it as the new version of
that named adapter (``weightsync.lora_adapter``). Nothing in the model changes.

Refused before anything is sent, naming the layer: LoRA variants vLLM cannot serve (DoRA,
embedding adapters, LoRA bias), and a model with no adapter ``peft_adapter``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.config import ExtractorConfig
from weightsync.interfaces import WeightExtractor
from weightsync.lora_adapter import DEFAULT_ADAPTER_NAME, PEFT_PREFIX, LoRAAdapterSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(kw_only=True)
class LoRAAdapterExtractorConfig(ExtractorConfig):
    """``adapter_name``: the name engines serve the adapter under (what requests name);
    ``peft_adapter``: which of the model's PEFT adapters is sent."""

    type: str = "lora_adapter"
    adapter_name: str = DEFAULT_ADAPTER_NAME
    peft_adapter: str = "default"


class LoRAAdapterWeightExtractor(WeightExtractor):
    """PEFT LoRA -> adapter tensors (registered as ``lora_adapter``); see the module docstring."""

    config_cls = LoRAAdapterExtractorConfig
    yields_model_tensors = True

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else LoRAAdapterExtractorConfig())
        # the adapter's layers, found once per model (a walk of every module); the tensors are
        # read at every push. Keyed by the model object, held weakly
        self._found: weakref.WeakKeyDictionary[Any, list[tuple[str, Any]]] = (
            weakref.WeakKeyDictionary())

    def adapter_spec(self, model: Any) -> LoRAAdapterSpec:
        """What the update's start carries: the adapter's name on the engines and its
        ``LoraConfig``."""
        return LoRAAdapterSpec.from_peft(model, name=self.cfg.adapter_name,
                                         adapter=self.cfg.peft_adapter)

    def _extract_raw_weights(
        self, model: Any, generator_dtype: Any
    ) -> Iterator[tuple[str, torch.Tensor]]:
        pairs = self._pairs(model)  # every refusal before the first tensor
        yield from pairs

    def _pairs(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        found = self._found.get(model)
        if found is None:
            found = self._find(model)
            self._found[model] = found
        return [(name, module.weight) for name, module in found]

    def _find(self, model: Any) -> list[tuple[str, Any]]:
        """``(tensor name, the nn.Linear holding it)`` for every A and B of the adapter; every
        refusal here."""
        from peft.tuners.lora import LoraLayer

        adapter = self.cfg.peft_adapter
        self.adapter_spec(model)  # refuses a model without that adapter
        base = getattr(model, "base_model", None)
        root = getattr(base, "model", None)
        if root is None:
            raise TypeError(f"lora_adapter extractor needs a PEFT model (PeftModel), got "
                            f"{type(model).__name__}")
        out: list[tuple[str, Any]] = []
        for prefix, layer in root.named_modules():
            if not isinstance(layer, LoraLayer) or adapter not in getattr(layer, "lora_A", {}):
                if isinstance(layer, LoraLayer) and adapter in getattr(
                        layer, "lora_embedding_A", {}):
                    raise ValueError(f"lora_adapter extractor: {prefix} is an embedding adapter; "
                                     f"vLLM's LoRA runtime serves linear-layer adapters here "
                                     f"(use the lora_merge extractor for this model)")
                continue
            if getattr(layer, "use_dora", {}).get(adapter, False):
                raise ValueError(f"lora_adapter extractor: {prefix} uses DoRA, which vLLM does "
                                 f"not serve (use the lora_merge extractor)")
            a, b = layer.lora_A[adapter], layer.lora_B[adapter]
            if getattr(b, "bias", None) is not None:
                raise ValueError(f"lora_adapter extractor: {prefix} has a LoRA bias, which vLLM "
                                 f"does not serve (use the lora_merge extractor)")
            out.append((f"{PEFT_PREFIX}{prefix}.lora_A.weight", a))
            out.append((f"{PEFT_PREFIX}{prefix}.lora_B.weight", b))
        if not out:
            raise ValueError(f"lora_adapter extractor: the model has no LoRA layer of adapter "
                             f"{adapter!r}")
        return out
