"""A LoRA adapter update into vLLM's LoRA runtime, from memory (``weightsync.lora_adapter``).

Runs inside each vLLM worker of an engine started with ``enable_lora=True`` (``--enable-lora``);
built per update by ``VLLMWeightLoader.adapter_loader(spec)`` when the update's start carries
``lora_adapter``. The endpoint stages the update (``UpdateSink(staged=True)``), so this loader
sees the adapter's tensors only once every chunk landed and checked out, then:

* ``validate`` (the manifest at start, each chunk before its bytes move): every name is a PEFT
  adapter tensor of a module the served model has, the adapter's config targets and vLLM's LoRA
  runtime supports; ``lora_A`` is ``[rank, in_features]``, ``lora_B`` ``[out_features, rank]``
  (the base weight's shape from the served checkpoint); floating point; each name once;
* ``start_update``: vLLM's own check of the config (``PEFTHelper.validate_legal``: rank <=
  ``max_lora_rank``, no DoRA / LoRA bias ...), and a manifest that covers every A/B pair the
  config implies (an adapter is replaced whole);
* ``finish_update``: ``LoRAModel.from_lora_tensors`` (vLLM's packing of q/k/v and gate/up, its
  scaling), on the device the tensors arrived on (vLLM's own file loader builds it on the CPU;
  on a GPU engine ours stays there, so activating it copies device to device), then, between two model steps (a ``collective_rpc`` runs between steps), the
  adapter's previous version is dropped, the new one added and pinned in vLLM's CPU cache of
  adapters (an adapter from memory has no file to reload after an eviction, so it is never
  evicted; an engine keeps at most ``max_cpu_loras`` of them, and a start that would need one
  more is refused); GPU slots (``max_loras``) stay least-recently-used as vLLM runs them. Requests that name the
  adapter from the next step on are served by the new version; the driver resets the prefix
  cache after every finished update (KV computed with the old adapter is not reused).

Nothing is installed before finish, so a failed or aborted adapter update leaves the engine
serving the previous version of the adapter (and the base weights untouched).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from weightsync._runtime import vllm_compat as compat
from weightsync.errors import UpdateRefusedError, WeightMismatchError
from weightsync.interfaces import WeightLoader
from weightsync.lora_adapter import LoRAAdapterSpec, module_of
from weightsync.types import TensorMeta, WeightUpdateFinish, WeightUpdateStart

if TYPE_CHECKING:  # pragma: no cover
    import torch

_FLOAT = {"float32", "float16", "bfloat16", "float64"}


def lora_manager(worker: Any) -> Any:
    """The worker's vLLM ``WorkerLoRAManager`` (None: the engine was started without LoRA)."""
    runner = getattr(worker, "model_runner", None)
    return getattr(runner, "lora_manager", None)


def adapter_digest(worker: Any, adapter_id: int) -> dict[str, dict] | None:
    """``weightsync.digest.state_digest`` of the adapter ``adapter_id`` as vLLM holds it in
    ``worker`` (its ``LoRAModel``: per module ``lora_a`` / ``lora_b`` after vLLM's packing and
    scaling, one entry per packed slice), None when the worker has no such adapter. Two adapters
    built from the same tensors by vLLM's code (a push from memory, a load from files) answer
    the same. For checks and benchmarks: hashes every tensor on the CPU."""
    from weightsync.digest import state_digest

    manager = lora_manager(worker)
    if manager is None:
        return None
    lora = manager._adapter_manager._registered_adapters.get(int(adapter_id))
    if lora is None:
        return None
    flat: dict[str, Any] = {}
    for module, weights in sorted(lora.loras.items()):
        for part in ("lora_a", "lora_b"):
            value = getattr(weights, part, None)
            items = value if isinstance(value, (list, tuple)) else [value]
            for i, t in enumerate(items):
                if t is not None:
                    flat[f"{module}.{part}.{i}"] = t
    return state_digest(flat)


class VLLMLoRAAdapterLoader(WeightLoader):
    """One adapter update into the LoRA runtime of ``worker`` (see the module docstring).
    ``base_meta``: the served checkpoint's names and shapes (``VLLMWeightLoader``'s expected
    metadata), for the adapter's shapes; None skips the shape check."""

    changes_at_finish_only = True  # the adapter is swapped in by finish_update, or not at all

    def __init__(self, worker: Any, spec: LoRAAdapterSpec, *,
                 base_meta: Mapping[str, TensorMeta] | None, model_name: str) -> None:
        manager = lora_manager(worker)
        if manager is None:
            raise UpdateRefusedError(
                f"vLLM model {model_name}: this engine was started without LoRA, so it cannot "
                f"take adapter {spec.name!r}; start it with enable_lora=True (--enable-lora) "
                f"and max_lora_rank >= {spec.rank}")
        self.worker = worker
        self.spec = spec
        self.manager = manager
        self.target = f"LoRA adapter {spec.name!r} of vLLM model {model_name}"
        self._expected = _expected_adapter(spec, base_meta, _supported_modules(manager))
        self._received: dict[str, torch.Tensor] = {}

    # -- checks --------------------------------------------------------------------------------
    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        return self._expected

    def validate(self, metas: Iterable[TensorMeta]) -> None:
        from collections import Counter

        metas = list(metas)
        offenders = [f"{n}: sent more than once in one update"
                     for n, c in sorted(Counter(m.name for m in metas).items()) if c > 1]
        for m in metas:
            if module_of(m.name) is None:
                offenders.append(f"{m.name}: not a LoRA adapter tensor (expected "
                                 f"base_model.model.<module>.lora_A.weight / lora_B.weight)")
                continue
            if m.dtype not in _FLOAT:
                offenders.append(f"{m.name}: dtype {m.dtype}, expected a floating dtype")
            if self._expected is None:
                continue
            want = self._expected.get(m.name)
            if want is None:
                offenders.append(f"{m.name}: no such adapter module here (the config targets "
                                 f"{self.spec.config['target_modules']!r} of the served model, "
                                 f"in modules vLLM's LoRA runtime supports)")
            elif list(m.shape) != list(want.shape):
                offenders.append(f"{m.name}: shape {list(m.shape)}, expected {list(want.shape)} "
                                 f"(rank {self.spec.rank_of(module_of(m.name)[0])})")
        if offenders:
            raise WeightMismatchError(offenders, target=self.target)

    def _missing(self, names: Iterable[str]) -> list[str]:
        if self._expected is None:
            return []
        have = set(names)
        return [f"{n}: missing; an adapter update carries the whole adapter"
                for n in self._expected if n not in have]

    # -- update lifecycle ----------------------------------------------------------------------
    async def start_update(self, start: WeightUpdateStart) -> None:
        self._received.clear()
        helper = self._peft_helper()
        try:
            helper.validate_legal(self.manager.lora_config)
        except ValueError as e:
            raise UpdateRefusedError(f"{self.target}: {e}") from None
        adapters = self.manager._adapter_manager
        pinned = adapters._registered_adapters.pinned_items  # adapters pushed from memory
        if self.spec.adapter_id not in pinned and len(pinned) >= adapters.capacity:
            raise UpdateRefusedError(
                f"{self.target}: the engine holds {len(pinned)} adapters pushed from memory, as "
                f"many as it keeps (max_cpu_loras={adapters.capacity}); start it with a larger "
                f"max_cpu_loras (--max-cpu-loras) or push to an adapter name it holds")
        if start.manifest is not None:
            missing = self._missing(m.name for m in start.manifest)
            if missing:
                raise WeightMismatchError(missing, target=self.target)

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        # kept on the device they arrived on (the engine's GPU on GPU): vLLM then copies them
        # into its adapter slots device to device, with no trip through host memory
        for name, t in named_tensors.items():
            self._received[name] = t.detach().clone()

    async def finish_update(self, finish: WeightUpdateFinish) -> None:
        received, self._received = self._received, {}
        missing = self._missing(received)
        if missing:
            raise WeightMismatchError(missing, target=self.target)
        self.install(received)

    def install(self, tensors: dict[str, torch.Tensor]) -> None:
        """Build the adapter with vLLM's own code and swap it in (see the module docstring)."""
        manager = self.manager
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        device = next(iter(tensors.values())).device if tensors else "cpu"
        lora = manager._lora_model_cls.from_lora_tensors(
            self.spec.adapter_id, tensors, self._peft_helper(), device=str(device),
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=compat.lora_name_mapper(mapper),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        # everything that can fail is done; the swap below only moves entries between vLLM's
        # tables (an adapter not pushed from memory is evicted if the cache is full)
        adapters = manager._adapter_manager
        adapters.remove_adapter(lora.id)
        if len(adapters) + 1 > adapters.capacity:
            adapters.remove_oldest_adapter()
        adapters.add_adapter(lora)
        # kept in the CPU cache for good (no file to reload it from); GPU slots stay LRU
        adapters._pin_lora_in_cpu_cache(lora.id)

    def _peft_helper(self) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        try:
            return PEFTHelper.from_dict(dict(self.spec.config))
        except (TypeError, ValueError) as e:
            raise UpdateRefusedError(f"{self.target}: its config is refused: {e}") from None


def _supported_modules(manager: Any) -> set[str]:
    """Leaf module names vLLM's LoRA runtime takes for this model (packed layers expanded:
    ``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``)."""
    adapters = manager._adapter_manager
    packed = dict(getattr(adapters, "packed_modules_mapping", {}) or {})
    out: set[str] = set()
    for m in adapters.supported_lora_modules:
        out.update(packed.get(m, [m]))
    return out


def _targets(spec: LoRAAdapterSpec, module: str) -> bool:
    """PEFT's ``target_modules`` rule: a list names module-name suffixes, a string is a regular
    expression matched against the whole module name."""
    targets = spec.config["target_modules"]
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _expected_adapter(
    spec: LoRAAdapterSpec, base_meta: Mapping[str, TensorMeta] | None, supported: set[str],
) -> dict[str, TensorMeta] | None:
    if base_meta is None:
        return None
    out: dict[str, TensorMeta] = {}
    for name, meta in base_meta.items():
        if not name.endswith(".weight") or len(meta.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] not in supported or not _targets(spec, module):
            continue
        rank = spec.rank_of(module)
        out_f, in_f = meta.shape
        out[f"base_model.model.{module}.lora_A.weight"] = TensorMeta(
            f"base_model.model.{module}.lora_A.weight", "float32", [rank, in_f])
        out[f"base_model.model.{module}.lora_B.weight"] = TensorMeta(
            f"base_model.model.{module}.lora_B.weight", "float32", [out_f, rank])
    return out
