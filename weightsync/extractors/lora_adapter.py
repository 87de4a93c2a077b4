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
from weightsync.extractors.held import HoldsUpdates
from weightsync.interfaces import WeightExtractor
from weightsync.lora_adapter import DEFAULT_ADAPTER_NAME, PEFT_PREFIX, LoRAAdapterSpec
from weightsync.types import TensorMeta, WeightChunk

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(kw_only=True)
class LoRAAdapterExtractorConfig(ExtractorConfig):
    """``adapter_name``: the name engines serve the adapter under (what requests name);
    ``peft_adapter``: which of the model's PEFT adapters is sent."""

    type: str = "lora_adapter"
    adapter_name: str = DEFAULT_ADAPTER_NAME
    peft_adapter: str = "default"


class LoRAAdapterWeightExtractor(HoldsUpdates, WeightExtractor):
    """PEFT LoRA -> adapter tensors (registered as ``lora_adapter``); see the module docstring.
    While the model holds the same adapter tensors (an optimizer changes their values in place),
    the last push's manifest and chunks are given out again (``weightsync.extractors.held``;
    the record: ``_HeldAdapter``)."""

    config_cls = LoRAAdapterExtractorConfig
    yields_model_tensors = True

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else LoRAAdapterExtractorConfig())
        # whole modules per chunk, chunks filled up to the bucket size (the base's are off)
        self._group_by_module = bool(getattr(self.cfg, "group_by_module", True))
        self._batch_by_threshold = True
        # the adapter's layers, found once per model (a walk of every module); the tensors are
        # read at every push. Keyed by the model object, held weakly
        self._found: weakref.WeakKeyDictionary[Any, list[tuple[str, Any, Any, str]]] = (
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
        return [(name, module.weight) for name, module, _, _ in self._layers(model)]

    def _layers(self, model: Any) -> list[tuple[str, Any, Any, str]]:
        """``_find`` once per model, again when one of its A / B modules was swapped."""
        found = self._found.get(model)
        if found is None or any(c._modules.get(k) is not m for _, m, c, k in found):
            found = self._find(model)
            self._found[model] = found
        return found

    def _metadata_now(self, model: Any, dtype: Any) -> list[TensorMeta]:
        return WeightExtractor.metadata(self, model, dtype)

    def _record_of(self, model: Any, dtype: Any, config: tuple) -> _HeldAdapter | None:
        return _HeldAdapter.of(model, dtype, config, self._layers(model))

    def _find(self, model: Any) -> list[tuple[str, Any, Any, str]]:
        """``(tensor name, the nn.Linear holding it, the PEFT ``ModuleDict`` holding that, its
        key)`` for every A and B of the adapter; every refusal here."""
        from peft.tuners.lora import LoraLayer

        adapter = self.cfg.peft_adapter
        self.adapter_spec(model)  # refuses a model without that adapter
        base = getattr(model, "base_model", None)
        root = getattr(base, "model", None)
        if root is None:
            raise TypeError(f"lora_adapter extractor needs a PEFT model (PeftModel), got "
                            f"{type(model).__name__}")
        out: list[tuple[str, Any, Any, str]] = []
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
            out.append((f"{PEFT_PREFIX}{prefix}.lora_A.weight", a, layer.lora_A, adapter))
            out.append((f"{PEFT_PREFIX}{prefix}.lora_B.weight", b, layer.lora_B, adapter))
        if not out:
            raise ValueError(f"lora_adapter extractor: the model has no LoRA layer of adapter "
                             f"{adapter!r}")
        return out


class _HeldAdapter:
    """What an adapter extraction was made of: the model, the dtype, and for every A / B its
    PEFT ``ModuleDict`` entry, the ``nn.Linear`` in it, its weight and that tensor's storage,
    dtype, shape and stride (``holds``: one pass, no names built). The objects are held, so an
    id compared is never a later object's."""

    __slots__ = ("model", "dtype", "config", "entries", "metas", "chunks")

    def __init__(self, model: Any, dtype: Any, config: tuple, entries: list[tuple]) -> None:
        self.model, self.dtype, self.config, self.entries = model, dtype, config, entries
        self.metas: list[TensorMeta] | None = None
        self.chunks: list[WeightChunk] | None = None

    @classmethod
    def of(cls, model: Any, dtype: Any, config: tuple,
           layers: list[tuple[str, Any, Any, str]]) -> _HeldAdapter | None:
        entries = []
        for _, linear, container, key in layers:
            w = linear._parameters.get("weight")
            if w is None or type(w).__name__ == "DTensor" or w.device.type == "meta":
                return None
            entries.append((container._modules, key, linear, w, w.data_ptr(), w.dtype, w.shape,
                            w.stride()))
        return cls(model, dtype, config, entries)

    def made_for(self, model: Any, dtype: Any, config: tuple) -> bool:
        return model is self.model and dtype == self.dtype and config == self.config

    def holds(self, model: Any, dtype: Any, config: tuple) -> bool:
        if not self.made_for(model, dtype, config):
            return False
        for modules, key, linear, w, ptr, dt, shape, stride in self.entries:
            if (modules.get(key) is not linear or linear._parameters.get("weight") is not w
                    or w.data_ptr() != ptr or w.dtype is not dt or w.shape != shape
                    or w.stride() != stride):
                return False
        return True
