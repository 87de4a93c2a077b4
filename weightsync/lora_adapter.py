"""LoRA adapter-only updates: what travels, how an adapter is named, how requests pick it.

A PEFT policy whose base weights are frozen changes only its adapter. An adapter update sends
the adapter's ``lora_A`` / ``lora_B`` matrices (megabytes, not the model's gigabytes) and the
engine installs them, from memory (no file is written or read), into vLLM's LoRA runtime as the
new version of a named adapter; requests that name the adapter are served by its latest
complete version, requests that name the base model by the base weights.

Who uses what:

* the trainer: ``ws.connect(engines, strategy, extractor="lora_adapter")`` then
  ``push(peft_model, version=v)`` (the ``lora_adapter`` extractor,
  ``weightsync.extractors.lora_adapter``, sends the adapter and names it; ``adapter_name=`` in
  the extractor config, default ``"policy"``); the start of the update carries
  ``lora_adapter = LoRAAdapterSpec(...).to_dict()``.
* the engine (``weightsync.engine.WeightUpdateEndpoint``): an update whose start carries
  ``lora_adapter`` goes to ``loader.adapter_loader(spec)`` instead of the loader itself
  (``weightsync.loaders.vllm_lora`` for vLLM, built with ``enable_lora=True``); the adapter is
  collected whole and installed at finish, so the engine serves the previous version until the
  update completed.
* whoever sends requests: ``lora_request(name)`` (an in-process ``LLM``), or ``"model": name``
  on the policy server's OpenAI routes.

Wire format (JSON, in the start): ``{"name": str, "config": {"r": int, "lora_alpha": number,
"target_modules": [str] | str, ...}}``; ``config`` holds PEFT ``LoraConfig`` fields (the ones
vLLM's ``PEFTHelper`` reads: ``use_rslora``, ``rank_pattern``, ``alpha_pattern``, ``bias``,
``use_dora`` ...). Tensor names are PEFT's saved names: ``base_model.model.<module>.lora_A.weight``
(``[r, in_features]``) and ``...lora_B.weight`` (``[out_features, r]``). The server adds
``"slot": int`` (``LoRAAdapterSpec.slot``) when it keeps several versions of an adapter; a
trainer never sends it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: what ``lora_request`` gives vLLM as the adapter's path: no file is behind it; the adapter
#: was installed in every worker from memory, so vLLM never reads it
MEMORY_PATH_PREFIX = "weightsync-memory://"
#: PEFT's prefix of a saved adapter's tensor names
PEFT_PREFIX = "base_model.model."
#: what separates an adapter's name from its version slot in the name vLLM knows a slot by
SLOT_NAME_SEP = "@slot"
#: the adapter name used when none is given
DEFAULT_ADAPTER_NAME = "policy"
#: ``LoraConfig`` fields that travel (what vLLM's ``PEFTHelper`` reads)
_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "bias", "modules_to_save", "use_rslora",
                "use_dora", "lora_bias", "init_lora_weights", "rank_pattern", "alpha_pattern",
                "layer_replication")


def adapter_id(name: str, slot: int = 0) -> int:
    """The adapter's integer id in vLLM (``LoRARequest.lora_int_id``): the same for a name in
    every process, trainer and engine alike, so neither side keeps a table (1 .. 2**31 - 1).
    ``slot``: which of the adapter's version slots (a policy server with ``--adapter-slots N``
    keeps N versions of an adapter, each under its own id; slot 0 is the name's own id)."""
    key = name if slot == 0 else f"{name}\x00{slot}"
    return zlib.crc32(key.encode()) % (2**31 - 1) + 1


@dataclass
class LoRAAdapterSpec:
    """A named adapter and its PEFT config (see the module docstring)."""

    name: str = DEFAULT_ADAPTER_NAME
    config: dict[str, Any] = field(default_factory=dict)
    #: the version slot the engine installs this update in (``adapter_id``); set by the server
    #: that owns the slots (``--adapter-slots``), 0 otherwise
    slot: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"lora_adapter.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.slot, int) or isinstance(self.slot, bool) or self.slot < 0:
            raise ValueError(f"lora_adapter.slot must be an int >= 0, got {self.slot!r}")
        if not isinstance(self.config, Mapping):
            raise ValueError(f"lora_adapter.config must be a mapping, got "
                             f"{type(self.config).__name__}")
        cfg = dict(self.config)
        r, alpha = cfg.get("r"), cfg.get("lora_alpha")
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"lora_adapter.config.r must be an int > 0, got {r!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"lora_adapter.config.lora_alpha must be a number, got {alpha!r}")
        targets = cfg.get("target_modules")
        if isinstance(targets, (set, tuple)):
            cfg["target_modules"] = sorted(targets)
        elif not isinstance(targets, (str, list)) or not targets:
            raise ValueError(f"lora_adapter.config.target_modules must name modules (a list or "
                             f"a regular expression), got {targets!r}")
        self.config = cfg

    @property
    def adapter_id(self) -> int:
        return adapter_id(self.name, self.slot)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def rank_of(self, module: str) -> int:
        """The rank of one module (``rank_pattern`` overrides ``r`` by name suffix)."""
        for key, r in (self.config.get("rank_pattern") or {}).items():
            if module == key or module.endswith("." + key):
                return int(r)
        return self.rank

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "config": dict(self.config)}
        if self.slot:
            out["slot"] = self.slot
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoRAAdapterSpec:
        if not isinstance(d, Mapping):
            raise ValueError(f"lora_adapter must be a mapping with name and config, got "
                             f"{type(d).__name__}")
        unknown = set(d) - {"name", "config", "slot"}
        if unknown:
            raise ValueError(f"lora_adapter: unknown field(s) {sorted(unknown)} (expected name, "
                             f"config, slot)")
        return cls(name=d.get("name", DEFAULT_ADAPTER_NAME), config=dict(d.get("config") or {}),
                   slot=d.get("slot", 0))

    @classmethod
    def from_peft(cls, model: Any, *, name: str = DEFAULT_ADAPTER_NAME,
                  adapter: str = "default") -> LoRAAdapterSpec:
        """The spec of a PEFT model's adapter ``adapter`` (its ``LoraConfig``)."""
        configs = getattr(model, "peft_config", None)
        if not isinstance(configs, Mapping) or adapter not in configs:
            have = sorted(configs) if isinstance(configs, Mapping) else []
            raise ValueError(f"lora_adapter: the model has no PEFT adapter {adapter!r} "
                             f"(adapters: {have}); pass a PEFT model and its adapter's name")
        raw = configs[adapter]
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
        cfg = {k: _json_safe(raw[k]) for k in _CONFIG_KEYS if raw.get(k) is not None}
        return cls(name=name, config=cfg)


def slot_lora_name(name: str, slot: int = 0) -> str:
    """The name vLLM knows the version in ``slot`` of adapter ``name`` by (``name`` itself for
    slot 0). vLLM tells ``LoRARequest``s apart by name alone (their hash and equality): two
    versions of one adapter running in one batch under one name would be one adapter to it."""
    return name if slot == 0 else f"{name}{SLOT_NAME_SEP}{slot}"


def lora_request(name: str = DEFAULT_ADAPTER_NAME, slot: int = 0, *,
                 listed: bool = False) -> Any:
    """vLLM's ``LoRARequest`` for the latest version of adapter ``name`` pushed into an
    in-process engine: ``llm.generate(prompts, params, lora_request=lora_request("policy"))``;
    ``slot``: the version held in that slot (``adapter_id``, ``slot_lora_name``); ``listed``:
    under ``name`` itself whatever the slot (what ``/v1/models`` shows; never run)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name if listed else slot_lora_name(name, slot), adapter_id(name, slot),
                       MEMORY_PATH_PREFIX + name)


def module_of(tensor_name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a PEFT adapter tensor name
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``("model.layers.0.self_attn.q_proj", "A")``); None for any other name."""
    if not tensor_name.startswith(PEFT_PREFIX) or not tensor_name.endswith(".weight"):
        return None
    stem = tensor_name[len(PEFT_PREFIX):-len(".weight")]
    for part in ("A", "B"):
        suffix = f".lora_{part}"
        if stem.endswith(suffix):
            return stem[:-len(suffix)], part
    return None


def _json_safe(v: Any) -> Any:
    if isinstance(v, (set, frozenset, tuple)):
        return sorted(v) if isinstance(v, (set, frozenset)) else list(v)
    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):
        return v.value  # an enum
    return v
