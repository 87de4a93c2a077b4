"""A LoRA adapter update into vLLM's LoRA runtime, from memory (``weightsync.lora_adapter``).

Runs inside each vLLM worker of an engine started with ``enable_lora=True`` (``--enable-lora``);
built per update by ``VLLMWeightLoader.adapter_loader(spec)`` when the update's start carries
``lora_adapter``. The endpoint does not stage the update: this loader keeps what arrives in its
own buffer, apart from anything served, and installs it only at finish:

* ``validate`` (the manifest at start, each chunk before its bytes move): every name is a PEFT
  adapter tensor of a module the served model has, the adapter's config targets and vLLM's LoRA
  runtime supports; ``lora_A`` is ``[rank, in_features]``, ``lora_B`` ``[out_features, rank]``
  (the base weight's shape from the served checkpoint); floating point; each name once;
* ``start_update``: vLLM's own check of the config (``PEFTHelper.validate_legal``: rank <=
  ``max_lora_rank``, no DoRA / LoRA bias ...), and a manifest that covers every A/B pair the
  config implies (an adapter is replaced whole);
* ``start_update`` also finds where the update's bytes go: for an adapter pushed before with
  the same config, names, dtypes and shapes, the buffer its last version arrived in
  (``weightsync.loaders.vllm_lora_install``); else a new one. Its views are the update's direct
  targets (the receiver lands the bytes there, nothing is cloned);
* ``finish_update``: the first version (or one whose config, names or shapes changed) is built
  by vLLM's ``LoRAModel.from_lora_tensors`` (its packing of q/k/v and gate/up, its scaling), on
  the device the tensors arrived on (vLLM's own file loader builds it on the CPU; on a GPU
  engine ours stays there, so activating it copies device to device), then the adapter's
  previous version is dropped, the new one added and pinned in vLLM's CPU cache of adapters
  (an adapter from memory has no file to reload after an eviction, so it is never evicted; an
  engine keeps at most ``max_cpu_loras`` of them, and a start that would need one more is
  refused); GPU slots (``max_loras``) stay least-recently-used as vLLM runs them. A next
  version of the same adapter is written over the last one where vLLM holds it (its
  ``LoRAModel``'s tensors and, if it is active, its slot: ``vllm_lora_install``), bit-equal to
  vLLM building it, without a Python pass over the modules. Either runs between two model
  steps (a ``collective_rpc`` runs between steps): requests that name the adapter from the next
  step on are served by the new version; the driver resets the prefix cache after every
  finished update (KV computed with the old adapter is not reused).

Nothing is installed before finish, so a failed or aborted adapter update leaves the engine
serving the previous version of the adapter (and the base weights untouched).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync._runtime import trace
from weightsync._runtime import vllm_compat as compat
from weightsync.errors import UpdateRefusedError, WeightMismatchError
from weightsync.interfaces import WeightLoader
from weightsync.loaders.vllm_lora_install import (
    AdapterMemory,
    InstalledAdapter,
    config_key,
    leaf_scales,
    update_key,
)
from weightsync.lora_adapter import LoRAAdapterSpec, module_of
from weightsync.types import TensorMeta, WeightUpdateFinish, WeightUpdateStart, dtype_to_str

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


def adapter_slot_digest(worker: Any, adapter_id: int) -> dict[str, Any] | None:
    """Where the adapter ``adapter_id`` is active in ``worker`` and what its slot holds:
    ``{"slot": i, "digest": state_digest of every LoRA layer's stacked A / B at slot i}``; None
    when it is not active. Two adapters of the same tensors activated by vLLM, or written by
    ``vllm_lora_install``, answer the same digest. For checks and tests: hashes on the CPU."""
    from weightsync.digest import state_digest

    manager = lora_manager(worker)
    adapters = getattr(manager, "_adapter_manager", None)
    slots = list(getattr(adapters, "lora_index_to_id", None) or [])
    if adapter_id not in slots:
        return None
    index = slots.index(adapter_id)
    flat = {}
    for name, module in adapters.modules.items():
        for part in ("lora_a_stacked", "lora_b_stacked"):
            for i, t in enumerate(getattr(module, part, None) or ()):
                flat[f"{name}.{part}.{i}"] = t[index]
    return {"slot": index, "digest": state_digest(flat)}


class VLLMLoRAAdapterLoader(WeightLoader):
    """One adapter update into the LoRA runtime of ``worker`` (see the module docstring).
    ``base_meta``: the served checkpoint's names and shapes (``VLLMWeightLoader``'s expected
    metadata), for the adapter's shapes; None skips the shape check. ``memory``: what the
    worker keeps between adapter updates (its ``VLLMWeightLoader`` holds one); None: nothing is
    kept and vLLM builds every version."""

    changes_at_finish_only = True  # the adapter is swapped in by finish_update, or not at all

    def __init__(self, worker: Any, spec: LoRAAdapterSpec, *,
                 base_meta: Mapping[str, TensorMeta] | None, model_name: str,
                 memory: AdapterMemory | None = None) -> None:
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
        self.memory = memory if memory is not None else AdapterMemory()
        key = config_key(spec.config)
        if key not in self.memory.expected:
            self.memory.expected[key] = _expected_adapter(
                spec, base_meta, _supported_modules(manager))
        self._expected = self.memory.expected[key]
        self._received: dict[str, torch.Tensor] = {}  # arrived outside the record's inbox
        self._landed: set[str] = set()  # arrived in the record's inbox (or lent for it)
        self._lent: list[torch.Tensor] | None = None  # lent views, in the record's order
        self._record: InstalledAdapter | None = None  # where this update's bytes go

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
        self._landed.clear()
        self._lent = None
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
                f"many as it keeps (max_cpu_loras={adapters.capacity}; each version slot of "
                f"a policy server's --adapter-slots counts as one); start it with a larger "
                f"max_cpu_loras (--max-cpu-loras) or push to an adapter name it holds")
        if start.manifest is not None:
            missing = self._missing(m.name for m in start.manifest)
            if missing:
                raise WeightMismatchError(missing, target=self.target)
            self._record = self._record_for(start.manifest)

    def _record_for(self, manifest: list[TensorMeta]) -> InstalledAdapter | None:
        """The last version's record when this update has the same key (its inbox takes the
        bytes again), else a new record with its own inbox (None: no single dtype)."""
        last = self.memory.installed.get(self.spec.adapter_id)
        if last is not None and last.matches(self.spec.config, manifest):
            return last
        model = compat.get_model(self.worker)
        device = next(model.parameters()).device
        return InstalledAdapter.allocate(update_key(self.spec.config, manifest), manifest,
                                         device)

    def direct_target(self, meta: TensorMeta) -> torch.Tensor | None:
        """The view of the record's inbox for ``meta`` (same dtype and shape), else None."""
        target = self._record.inbox.get(meta.name) if self._record is not None else None
        if target is None or meta.dtype != dtype_to_str(target.dtype) or list(
                meta.shape) != list(target.shape):
            return None
        return target

    def loaded_in_place(self, names: Sequence[str]) -> None:
        self._landed.update(names)

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Tensors that did not land in place (a transport without direct targets, or small
        tensors packed on the wire): into the record's inbox, one batched copy; kept on the
        device they arrived on (the engine's GPU on GPU), so vLLM later copies them into its
        adapter slots device to device."""
        import torch

        inbox = self._record.inbox if self._record is not None else {}
        dsts, srcs = [], []
        for name, t in named_tensors.items():
            target = inbox.get(name)
            if (target is not None and target.dtype == t.dtype and target.shape == t.shape
                    and target.device == t.device):
                dsts.append(target)
                srcs.append(t)
                self._landed.add(name)
            else:
                self._received[name] = t.detach().clone()
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)

    async def load_borrowed(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Views valid until this finish returns (``WeightLoader.load_borrowed``): when they are
        the whole adapter in the record's dtypes, shapes and device they are kept, not copied
        into the inbox, and the finish copies them once, where the version goes (a next
        version: straight into vLLM's tensors). Else ``load_weights``."""
        record = self._record
        lent = record.lent_order(named_tensors) if record is not None else None
        if lent is None:
            return await self.load_weights(named_tensors)
        self._lent = lent
        self._landed.update(record.inbox)

    async def finish_update(self, finish: WeightUpdateFinish) -> None:
        received, self._received = self._received, {}
        landed, self._landed = self._landed, set()
        lent, self._lent = self._lent, None
        missing = self._missing(set(received) | landed)
        if missing:
            raise WeightMismatchError(missing, target=self.target)
        record, self._record = self._record, None
        adapters = self.manager._adapter_manager
        whole = record is not None and not received and landed == set(record.inbox)
        if whole and record.can_rewrite(adapters, self.spec.adapter_id):
            how = record.rewrite(adapters, self.spec.adapter_id, lent=lent)
            # the inbox takes the next update's bytes; lent views are read before we return
            compat.wait_for_copies(self.worker)
            self.memory.how[self.spec.adapter_id] = (
                f"rewritten{' from lent views' if lent is not None else ''}, slot {how}")
            trace.mark("lora.rewritten", slot=how)
            return
        if lent is not None:  # built by vLLM from the inbox: the lent views go there first
            record.take(lent)
        if whole:
            given = record.private_copies(self.manager.lora_config.lora_dtype)
            lora, scales = self._build(given)
            self._swap_in(lora)
            record.remember(lora, given, scales)
            self.memory.installed[self.spec.adapter_id] = record
        else:
            tensors = {**{n: record.inbox[n] for n in landed}, **received} if landed else received
            self._swap_in(self._build(tensors)[0])
            self.memory.installed.pop(self.spec.adapter_id, None)
        self.memory.how[self.spec.adapter_id] = "built"
        trace.mark("lora.built")

    def _build(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, dict[int, float]]:
        """vLLM's ``LoRAModel`` of ``tensors`` and its layers' scalings (``leaf_scales``, read
        before vLLM packs and scales it)."""
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
        return lora, leaf_scales(lora)

    def _swap_in(self, lora: Any) -> None:
        """Drop the adapter's last version and register ``lora`` (vLLM packs and scales it
        here), pinned in the CPU cache. Everything that can fail is done before: this only
        moves entries between vLLM's tables (an adapter not pushed from memory is evicted if
        the cache is full)."""
        adapters = self.manager._adapter_manager
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
