"""An adapter's next version written into what vLLM already holds for it: the tensors of its
``LoRAModel`` and, where the adapter is active, its slot of vLLM's stacked LoRA buffers.

Who uses it: ``weightsync.loaders.vllm_lora.VLLMLoRAAdapterLoader``, inside each vLLM worker,
at the finish of an adapter update (a ``collective_rpc``: between two model steps, so no step
sees half of a version). One ``InstalledAdapter`` per adapter id lives in the worker's
``AdapterMemory`` (held by its ``VLLMWeightLoader``) from one update to the next.

Why: vLLM builds an adapter from tensors with ``LoRAModel.from_lora_tensors`` (a Python pass
over every module: dtype casts, q/k/v and gate/up packed, ``lora_b`` scaled by its alpha / r)
and activates it into a slot with one ``set_lora`` per layer (a zero fill and a device copy per
slice: about 800 small device operations for a 7B adapter on every linear layer). A trainer
pushes the same adapter again and again: the same names, shapes, dtypes and config; only the
values change. So the first version is built by vLLM and remembered; the next ones are written
into the same places:

* ``inbox``: one flat buffer in the update's wire dtype, a view per tensor: the update's direct
  targets (the receiver lands the bytes there; nothing is cloned).
* ``held``: one flat buffer in the engine's LoRA dtype, laid out as ``inbox`` (every ``lora_A``,
  then every ``lora_B``). The first version is cast into it and its views handed to
  ``from_lora_tensors``: vLLM keeps a tensor it is given when it already has the LoRA dtype
  and device, packing keeps the member tensors in lists and folding the scaling into
  ``lora_b`` multiplies in place, so the ``LoRAModel`` vLLM registers holds our views. This is
  checked by identity after vLLM built it; if vLLM copied any tensor (a CPU engine that pins
  its adapters' memory), there is no fast path and vLLM builds every version.
* ``scales``: each ``lora_B``'s scaling as vLLM's own layer weights computed it (alpha / r,
  rsLoRA, ``rank_pattern`` / ``alpha_pattern``), read before vLLM folded it in.
* slot copies: the first time the adapter is found active in slot ``i``, vLLM's own
  ``set_lora`` of every layer runs under a recorder of the device copies it makes (destination:
  a view of the layer's stacked buffer; source: a view of ``held``, TP slicing included), with
  the last version still in ``held`` (so a failure leaves it serving); this and later versions
  replay them as one ``torch._foreach_copy_``. A ``set_lora`` that changes anything
  else than zero fills and copies out of ``held`` is not replayed: vLLM's ``set_lora`` of every
  layer then runs for each version (correct, slower).

The next version, all on the device: ``held.copy_(inbox)`` (one cast, what ``tensor.to(dtype)``
does per tensor), ``lora_B`` part multiplied by its scaling (what vLLM's ``optimize`` does per
tensor), the slot copies. Bit-equal to vLLM building and activating the same tensors (tested:
digests of the ``LoRAModel`` and the slot contents against vLLM's own build and activation).

Memory: ``inbox`` is one more copy of the adapter in its wire dtype (161 MB for a float32
rank-16 adapter on every linear layer of a 7B model), held while the adapter is installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync._runtime import trace
from weightsync.types import TensorMeta, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch


def config_key(config: Mapping[str, Any]) -> str:
    """An adapter config as a hashable key (what the adapter tensors it implies depend on)."""
    return json.dumps(dict(config), sort_keys=True, default=str)


def update_key(config: Mapping[str, Any], metas: Sequence[TensorMeta]) -> tuple:
    """What must not change for a version to be written into the last one's places: the
    adapter's config and its tensors' names, dtypes and shapes."""
    return config_key(config), tuple(sorted((m.name, m.dtype, tuple(m.shape)) for m in metas))


def _layout(metas: Sequence[TensorMeta]) -> list[TensorMeta]:
    """Every ``lora_A`` first, then every ``lora_B`` (one contiguous part to scale)."""
    return sorted(metas, key=lambda m: (m.name.endswith("lora_B.weight"), m.name))


def _views(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for m in metas:
        n = m.numel
        out[m.name] = flat[at:at + n].view(m.shape)
        at += n
    return out


@dataclass(eq=False)
class InstalledAdapter:
    """One adapter as a worker holds it between updates (see the module docstring)."""

    key: tuple
    metas: list[TensorMeta]  # in the flat layout's order
    inbox_flat: torch.Tensor
    inbox: dict[str, torch.Tensor]
    lora: Any = None  # the LoRAModel vLLM registered for the last version (None: not yet)
    held_flat: torch.Tensor | None = None  # None: vLLM copied our tensors; no fast path
    b_start: int = 0  # where the lora_B part of held_flat starts
    scale_parts: list[tuple[float, list[torch.Tensor]]] = field(default_factory=list)
    #: slot index -> the recorded (destinations, sources), or None: set_lora each time
    slot_copies: dict[int, tuple[list, list] | None] = field(default_factory=dict)
    #: the manifest object and config last found to match ``key`` (the endpoint hands the
    #: same parsed manifest again while the trainer sends the same one)
    matched: tuple[Any, dict] | None = None
    #: ``held`` as views in ``metas`` order (set with ``held_flat``)
    held_views: list[torch.Tensor] = field(default_factory=list)
    #: the lent views last found to fit (the dict a receiver hands again while its layout
    #: holds) and their tensors in ``metas`` order
    lent: tuple[Any, list[torch.Tensor]] | None = None

    def matches(self, config: Mapping[str, Any], manifest: list[TensorMeta]) -> bool:
        """Whether an update of ``config`` and ``manifest`` has this record's key."""
        if self.matched is not None and self.matched[0] is manifest and self.matched[1] == config:
            return True
        if update_key(config, manifest) != self.key:
            return False
        self.matched = (manifest, dict(config))
        return True

    def lent_order(self, named: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """``named`` in ``metas`` order when it is the whole inbox's names with their dtypes,
        shapes and device (what ``take`` and ``rewrite`` copy from), else None. The dict found
        to fit last time fits again without a look at its tensors."""
        last = self.lent
        if last is not None and last[0] is named:
            return last[1]
        if len(named) != len(self.inbox):
            return None
        out = []
        for m in self.metas:
            t, want = named.get(m.name), self.inbox[m.name]
            if (t is None or t.dtype != want.dtype or t.shape != want.shape
                    or t.device != want.device):
                return None
            out.append(t)
        self.lent = (named, out)
        return out

    def take(self, lent: Sequence[torch.Tensor]) -> None:
        """Copy lent views (``lent_order``) into the inbox."""
        import torch

        torch._foreach_copy_(list(self.inbox.values()), list(lent))

    @classmethod
    def allocate(cls, key: tuple, metas: Sequence[TensorMeta], device: Any) -> InstalledAdapter | None:
        """An empty record with its ``inbox`` for an update of ``metas``; None when they do not
        share one dtype (then the update is cloned tensor by tensor and vLLM builds it)."""
        import torch

        dtypes = {m.dtype for m in metas}
        if len(dtypes) != 1 or not metas:
            return None
        ordered = _layout(metas)
        flat = torch.empty(sum(m.numel for m in ordered), dtype=str_to_dtype(dtypes.pop()),
                           device=device)
        return cls(key=key, metas=ordered, inbox_flat=flat, inbox=_views(flat, ordered))

    # -- the first version: built by vLLM -------------------------------------------------------
    def private_copies(self, lora_dtype: Any) -> dict[str, torch.Tensor]:
        """The received tensors cast into a new ``held`` buffer, as views (what the first
        version is built from)."""
        import torch

        dtype = lora_dtype if isinstance(lora_dtype, torch.dtype) else self.inbox_flat.dtype
        held = torch.empty(self.inbox_flat.numel(), dtype=dtype, device=self.inbox_flat.device)
        held.copy_(self.inbox_flat)
        self.held_flat = held
        self.b_start = sum(m.numel for m in self.metas if not m.name.endswith("lora_B.weight"))
        views = _views(held, self.metas)
        self.held_views = list(views.values())
        return views

    def remember(self, lora: Any, given: Mapping[str, torch.Tensor],
                 scales: Mapping[int, float]) -> None:
        """vLLM registered ``lora`` (built from ``given``, views of ``held``; ``scales``: id of
        each leaf's ``lora_b`` -> its scaling before vLLM folded it in). Keeps the fast path
        only if every given tensor is one that ``lora`` holds."""
        self.lora, self.slot_copies = lora, {}
        kept = {id(t) for t in _lora_tensors(lora)}
        if any(id(t) not in kept for t in given.values()):
            self.held_flat = None  # vLLM copied: every version is built by vLLM
            return
        parts: dict[float, list] = {}
        for m in self.metas:
            if m.name.endswith("lora_B.weight"):
                scale = scales.get(id(given[m.name]))
                if scale is None:
                    self.held_flat = None
                    return
                parts.setdefault(float(scale), []).append(given[m.name])
        self.scale_parts = sorted(parts.items())

    # -- the next versions ----------------------------------------------------------------------
    def can_rewrite(self, adapters: Any, adapter_id: int) -> bool:
        """The fast path applies: the record knows where every tensor goes and vLLM still holds
        the ``LoRAModel`` it registered for the last version."""
        return (self.held_flat is not None and self.lora is not None
                and adapters._registered_adapters.get(adapter_id) is self.lora)

    def rewrite(self, adapters: Any, adapter_id: int,
                lent: Sequence[torch.Tensor] | None = None) -> str:
        """Write the version in ``inbox`` (or in ``lent``, views in ``metas`` order: copied
        straight into ``held``, cast as vLLM casts) over the last one (see the module
        docstring); returns
        how the slot was written: "replayed", "recorded" (its copies recorded first, then
        replayed), "set_lora" (not replayable: vLLM's ``set_lora`` of every layer) or
        "inactive". Whatever may fail (the recording runs vLLM's code) runs before the last
        version is overwritten: the recording writes the last version into the slot again."""
        import torch

        index = _slot_of(adapters, adapter_id)
        how = "replayed"
        if index is not None and index not in self.slot_copies:
            self.slot_copies[index] = _record_set_lora(adapters, self.lora, index,
                                                       self.held_flat)
            how = "recorded"
        held = self.held_flat
        if lent is None:
            held.copy_(self.inbox_flat)
        else:
            torch._foreach_copy_(self.held_views, list(lent))
        if len(self.scale_parts) == 1:
            scale = self.scale_parts[0][0]
            if scale != 1:
                held[self.b_start:].mul_(scale)
        else:
            for scale, parts in self.scale_parts:
                if scale != 1:
                    torch._foreach_mul_(parts, scale)
        trace.mark("lora.rewrite.held")
        if index is None:
            return "inactive"
        copies = self.slot_copies[index]
        if copies is None:
            _set_lora(adapters, self.lora, index)
            return "set_lora"
        torch._foreach_copy_(copies[0], copies[1])
        trace.mark("lora.rewrite.slot")
        return how


@dataclass
class AdapterMemory:
    """What one worker keeps between adapter updates: per adapter id its ``InstalledAdapter``
    and how its last version was installed (``how``: "built" by vLLM, or "rewritten, slot
    recorded" / "replayed" / "set_lora" / "inactive", "rewritten from lent views, ..." when
    ``rewrite`` copied lent views), per adapter config the adapter tensors
    the served model implies (``expected``)."""

    installed: dict[int, InstalledAdapter] = field(default_factory=dict)
    how: dict[int, str] = field(default_factory=dict)
    expected: dict[str, dict[str, TensorMeta] | None] = field(default_factory=dict)

    def release_inboxes(self) -> int:
        """Forget every record (their inboxes are freed; the tensors vLLM holds stay vLLM's):
        the next version of each adapter is built by vLLM. Returns the inboxes' bytes."""
        freed = sum(r.inbox_flat.numel() * r.inbox_flat.element_size()
                    for r in self.installed.values())
        self.installed.clear()
        return freed


def _lora_tensors(lora: Any) -> list[torch.Tensor]:
    out = []
    for w in lora.loras.values():
        for part in (w.lora_a, w.lora_b):
            items = part if isinstance(part, (list, tuple)) else [part]
            out.extend(t for t in items if t is not None)
    return out


def leaf_scales(lora: Any) -> dict[int, float]:
    """id of each leaf layer's ``lora_b`` -> its scaling, read from a ``LoRAModel`` that
    ``from_lora_tensors`` built and vLLM has not packed or optimised yet."""
    out = {}
    for w in lora.loras.values():
        if not isinstance(w.lora_b, (list, tuple)) and w.lora_b is not None:
            out[id(w.lora_b)] = w.scaling
    return out


def _slot_of(adapters: Any, adapter_id: int) -> int | None:
    slots = getattr(adapters, "lora_index_to_id", None) or []
    return slots.index(adapter_id) if adapter_id in slots else None


def _set_lora(adapters: Any, lora: Any, index: int) -> None:
    """vLLM's activation of ``lora`` into slot ``index``, layer by layer (its own ``set_lora``;
    layers the adapter does not touch keep the zeros they already hold in that slot)."""
    for name, module in adapters.modules.items():
        weights = adapters._get_lora_layer_weights(lora, name)
        if weights:
            module.set_lora(index, weights.lora_a, weights.lora_b)


def _record_set_lora(adapters: Any, lora: Any, index: int, held: torch.Tensor
                     ) -> tuple[list, list] | None:
    """Run ``_set_lora`` and record the device copies it made (see the module docstring);
    None if it did anything a replay of those copies would not redo."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    allowed = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    other: list[str] = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func is aten.copy_.default:
                copies.append((args[0], args[1]))
            elif func._schema.is_mutable and func not in allowed:
                other.append(str(func))
            return out

    with _Recorder():
        _set_lora(adapters, lora, index)
    source = held.untyped_storage().data_ptr()
    if other or not copies or any(
            not isinstance(s, torch.Tensor) or s.untyped_storage().data_ptr() != source
            for _, s in copies):
        return None
    return [d for d, _ in copies], [s for _, s in copies]
