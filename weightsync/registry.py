"""Name -> class registries for strategies, extractors and loaders.

Built-ins are registered as ``"module:Class"`` strings and imported only when first used, so
``import weightsync`` pulls in neither torch nor any heavy backend. Third parties add their own
classes with ``@register_strategy("name")`` / ``@register_extractor`` / ``@register_loader``.
A name can be registered once; an unknown name is an error that lists the registered ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Registry:
    def __init__(self, kind: str, builtins: dict[str, str]) -> None:
        self.kind = kind
        self._entries: dict[str, str | type] = dict(builtins)

    def register(self, name: str) -> Callable[[T], T]:
        def deco(cls: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and existing is not cls and not _is_same(existing, cls):
                raise ValueError(f"{self.kind} {name!r} is already registered ({existing})")
            self._entries[name] = cls  # type: ignore[assignment]
            return cls

        return deco

    def get(self, name: str) -> type:
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(
                f"unknown {self.kind} type {name!r}; registered: {', '.join(sorted(self._entries))}"
            )
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            try:
                entry = getattr(importlib.import_module(module), attr)
            except ImportError as e:
                raise ImportError(
                    f"{self.kind} {name!r} needs {module}, which failed to import ({e}); "
                    f"install the extra it needs, e.g. pip install 'weightsync[vllm,ray,train]'"
                ) from e
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _is_same(entry: Any, cls: Any) -> bool:
    return isinstance(entry, str) and entry == f"{cls.__module__}:{cls.__qualname__}"


STRATEGIES = Registry(
    "strategy",
    {
        "broadcast": "weightsync.strategies.broadcast:BroadcastTransferStrategy",
        "cuda_ipc": "weightsync.strategies.cuda_ipc:CudaIpcTransferStrategy",
        "packed_cuda_ipc": "weightsync.strategies.packed_cuda_ipc:PackedCudaIpcTransferStrategy",
        "ludic_broadcast": "weightsync.strategies.ludic_broadcast:LudicBroadcastStrategy",
    },
)
# engine side only: the sender is another project's trainer (weightsync has no sender for these)
RECEIVER_ONLY_STRATEGIES = frozenset({"ludic_broadcast"})
EXTRACTORS = Registry(
    "extractor",
    {
        "hf": "weightsync.extractors.hf:HFWeightExtractor",
        "hf_head": "weightsync.extractors.hf:HFHeadWeightExtractor",
        "lora_merge": "weightsync.extractors.lora:LoraMergeWeightExtractor",
        "lora_adapter": "weightsync.extractors.lora_adapter:LoRAAdapterWeightExtractor",
        "fsdp": "weightsync.extractors.fsdp:FSDPWeightExtractor",
        "deepspeed": "weightsync.extractors.deepspeed:DeepSpeedWeightExtractor",
        "megatron": "weightsync.extractors.megatron:MegatronWeightExtractor",
    },
)
LOADERS = Registry(
    "loader",
    {
        "torch_module": "weightsync.loaders.torch_module:TorchModuleWeightLoader",
        "vllm": "weightsync.loaders.vllm:VLLMWeightLoader",
        "sglang": "weightsync.loaders.sglang:SGLangWeightLoader",
        "remote": "weightsync.loaders.remote:RemoteWeightLoader",
    },
)

register_strategy = STRATEGIES.register
register_extractor = EXTRACTORS.register
register_loader = LOADERS.register
