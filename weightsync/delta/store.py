"""The engine side of delta updates: what an engine keeps so that a delta can be applied, and
the loader a delta update is received into.

Who uses it: ``weightsync.engine.WeightUpdateEndpoint`` only (one ``DeltaStore`` per endpoint,
one ``DeltaLoader`` per update whose start carries a ``delta``). The endpoint keeps its state
machine; this module adds three rules to it:

* **What a delta needs.** Applying a delta needs the base's bits. A loader that hands out its
  engine's own tensor (``WeightLoader.direct_target``: a torch module's parameter, a vLLM
  parameter that a copy plan copies into whole) is patched in place and nothing is kept. For
  the others (vLLM's layer-wise reload on CPU, where linear weights are repacked and cannot be
  read back) the store keeps a copy (a *shadow*) of every tensor it saw land, on the tensor's
  device: one more copy of those tensors, paid only by an engine that a trainer pushes deltas
  to. A reconstructed shadow is loaded through ``load_weights`` like any tensor; at the finish
  the unchanged shadows are loaded too (a layer is loaded whole), so only the wire is sparse.
* **When a delta is accepted.** The start's ``base_version`` must be the version the engine
  serves, the engine must be idle (not torn) and the store must hold that version, with a base
  for every target that is not sent dense; otherwise ``DeltaBaseMismatchError`` (a refusal:
  nothing moved) and the trainer sends a full update instead.
* **When the store is valid.** It holds the served version after every complete update whose
  start carried a ``delta`` (a full one, ``base_version`` None, or a delta); an update without
  one, or one that leaves the weights torn, empties it (``drop``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.delta.codec import DENSE, UNCHANGED, DeltaSpec, DeltaTarget, apply, target_of
from weightsync.errors import DeltaBaseMismatchError, WeightMismatchError
from weightsync.interfaces import WeightLoader

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.types import TensorMeta, WeightUpdateStart


class DeltaStore:
    """What one engine keeps for delta updates: ``version`` (the served version the store is
    valid for; None: nothing usable) and ``shadow`` (copies of the tensors its loader cannot
    hand back)."""

    def __init__(self, name: str = "engine") -> None:
        self.name = name
        self.version: int | None = None
        self.shadow: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    def begin(self, start: WeightUpdateStart, loader: WeightLoader, *, served: int,
              idle: bool) -> DeltaLoader:
        """The loader update ``start`` (which carries a ``delta``) is received into. Raises
        ``ValueError`` for a malformed spec, ``WeightMismatchError`` when the start's manifest
        is not the spec's wire tensors, ``DeltaBaseMismatchError`` when the engine cannot apply
        the delta; nothing changes then. The caller validates ``DeltaLoader.targets`` against
        its loader before calling ``check_base``."""
        spec = DeltaSpec.from_dict(start.delta)
        wire = spec.wire_metas()
        if start.manifest is not None and [m.to_dict() for m in start.manifest] != [
                m.to_dict() for m in wire]:
            got = {m.name for m in start.manifest}
            want = {m.name for m in wire}
            diff = sorted(got ^ want)[:10] or ["(same names, other dtypes, shapes or order)"]
            raise WeightMismatchError(
                [f"the start's manifest is not the delta's wire tensors: {d}" for d in diff],
                target=f"delta update of {self.name}")
        if spec.base_version is None and self.version != served:
            self.drop()  # a full update replaces the base: nothing older may be used
        return DeltaLoader(loader, self, spec, served=served, idle=idle)

    def published(self, version: int) -> None:
        """A complete update with a ``delta`` published ``version``."""
        self.version = version

    def drop(self) -> None:
        """Forget everything (an update without a delta, torn weights)."""
        self.version = None
        self.shadow.clear()

    def keep(self, name: str, t: torch.Tensor) -> None:
        """Remember ``t`` (the new value of ``name``): copied into the shadow."""
        old = self.shadow.get(name)
        if old is not None and old.shape == t.shape and old.dtype == t.dtype \
                and old.device == t.device:
            old.copy_(t)
        else:
            self.shadow[name] = t.detach().clone().contiguous()


class DeltaLoader(WeightLoader):
    """The loader one update with a ``delta`` is received into (inside the endpoint's
    ``UpdateSink``): it takes the wire tensors, rebuilds each target on its base (the engine's
    own tensor or the store's shadow) and hands the rebuilt tensors to the engine's loader.

    ``targets`` / ``loader_start``: what the endpoint validates and what the engine's loader
    sees at start (the targets as the manifest: a layer-wise loader checks that layers are
    whole). ``complete()`` runs at the finish, before the loader's finish hook."""

    def __init__(self, loader: WeightLoader, store: DeltaStore, spec: DeltaSpec, *,
                 served: int, idle: bool) -> None:
        self.loader = loader
        self.store = store
        self.spec = spec
        self.served = served
        self.idle = idle
        self._targets = {t.name: t for t in spec.targets}
        self._wire = {m.name: m for m in spec.wire_metas()}
        self._parts: dict[str, dict[str, torch.Tensor]] = {}
        self._done: set[str] = set()

    # -- at start ---------------------------------------------------------------------------
    @property
    def targets(self) -> list[TensorMeta]:
        return self.spec.target_metas()

    def targets_of(self, metas: Iterable[TensorMeta]) -> list[TensorMeta]:
        """The targets that wire tensors ``metas`` belong to, each once (a name that is not
        this delta's stays as it is: the receiver's validation names it)."""
        out: dict[str, TensorMeta] = {}
        for m in metas:
            name = target_of(m.name)[0]
            t = self._targets.get(name)
            out.setdefault(name if t is not None else m.name, t.meta if t is not None else m)
        return list(out.values())

    def loader_start(self, start: WeightUpdateStart) -> WeightUpdateStart:
        return dataclasses.replace(start, manifest=self.targets)

    def check_base(self) -> None:
        """Raise ``DeltaBaseMismatchError`` unless this engine can apply the delta (see the
        module docstring); nothing to check for a full update."""
        base = self.spec.base_version
        if base is None:
            return
        store = self.store
        why = ""
        if base != self.served:
            why = f"it serves version {self.served}"
        elif not self.idle:
            why = "its weights are incomplete after a failed update"
        elif store.version != self.served:
            why = ("it keeps no base for it (no complete update with a delta since it started "
                   "serving it, or an update without one came since)")
        else:
            missing = [t.name for t in self.spec.targets
                       if t.encoding != DENSE and self._base_of(t) is None]
            if missing:
                why = (f"it holds no base for {len(missing)} tensor(s) ({', '.join(missing[:3])}"
                       f"{', ...' if len(missing) > 3 else ''})")
        if why:
            raise DeltaBaseMismatchError(
                f"{store.name}: refusing a delta against version {base}: {why}; send a full "
                f"update (the front door does so by itself)")

    # -- what a receiver calls ----------------------------------------------------------------
    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        return self._wire

    def validate(self, metas: Iterable[TensorMeta]) -> None:
        offenders = []
        for m in metas:
            want = self._wire.get(m.name)
            if want is None:
                offenders.append(f"{m.name}: not a wire tensor of this delta update")
            elif m.dtype != want.dtype or list(m.shape) != list(want.shape):
                offenders.append(f"{m.name}: {m.dtype}{list(m.shape)} but the delta announced "
                                 f"{want.dtype}{list(want.shape)}")
        if offenders:
            raise WeightMismatchError(offenders, target=f"delta update of {self.store.name}")

    def direct_target(self, meta: TensorMeta) -> torch.Tensor | None:
        """A dense target whose engine tensor the loader hands out takes its bytes in place."""
        t = self._targets.get(meta.name)
        if t is None or t.encoding != DENSE or meta.name in self.store.shadow:
            return None
        return self.loader.direct_target(meta)

    def loaded_in_place(self, names: Sequence[str]) -> None:
        self.loader.loaded_in_place(names)
        self._done.update(names)

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        rebuilt: dict[str, torch.Tensor] = {}
        in_place: list[str] = []
        for wire_name, t in named_tensors.items():
            name, part = target_of(wire_name)
            target = self._targets[name]
            if target.encoding == DENSE:
                rebuilt[name] = t
                continue
            parts = self._parts.setdefault(name, {})
            need = 3 if target.escapes else 2
            # a part waits for the others: copy it, the tensor may be a reused buffer
            parts[part] = t if len(parts) == need - 1 else t.detach().clone()
            if len(parts) < need:
                continue
            del self._parts[name]
            dst = self._base_of(target)
            assert dst is not None  # check_base made sure
            apply(dst, target, parts)
            if name in self.store.shadow:
                rebuilt[name] = dst
            else:
                in_place.append(name)
        if in_place:
            self.loader.loaded_in_place(in_place)
            self._done.update(in_place)
        if rebuilt:
            await self.loader.load_weights(rebuilt)
            self._done.update(rebuilt)
            self._remember(rebuilt)

    # -- at the finish ----------------------------------------------------------------------
    async def complete(self) -> None:
        """Every target arrived (else ``WeightMismatchError``); the unchanged ones the loader
        cannot patch in place are loaded from their shadows (a layer is loaded whole); the
        rebuilt tensors are checked against the sender's checksums when it sent them."""
        missing = [t.name for t in self.spec.targets
                   if t.encoding != UNCHANGED and t.name not in self._done]
        if missing or self._parts:
            lines = [f"{n}: announced in the delta but never arrived" for n in missing]
            lines += [f"{n}: only its {sorted(p)} part arrived" for n, p in self._parts.items()]
            raise WeightMismatchError(lines, target=f"delta update of {self.store.name}")
        rest = {t.name: self.store.shadow[t.name] for t in self.spec.targets
                if t.encoding == UNCHANGED and t.name in self.store.shadow}
        if rest:
            await self.loader.load_weights(rest)
        self._check_sums()

    def _check_sums(self) -> None:
        from weightsync.errors import ChecksumMismatchError
        from weightsync.integrity import tensor_checksums

        want = [t for t in self.spec.targets if t.checksum is not None and t.encoding != UNCHANGED]
        have = [(t, self._base_of(t)) for t in want]
        have = [(t, x) for t, x in have if x is not None]
        if not have:
            return
        sums = tensor_checksums([x for _, x in have])
        bad = [t.name for (t, _), s in zip(have, sums, strict=True) if s != t.checksum]
        if bad:
            raise ChecksumMismatchError(
                f"{self.store.name}: {len(bad)} tensor(s) rebuilt from the delta differ from "
                f"the sender's: {', '.join(bad[:5])}", bad)

    # -- internals ----------------------------------------------------------------------------
    def _base_of(self, target: DeltaTarget) -> torch.Tensor | None:
        shadow = self.store.shadow.get(target.name)
        if shadow is not None:
            return shadow
        return self.loader.direct_target(target.meta)

    def _remember(self, rebuilt: Mapping[str, torch.Tensor]) -> None:
        """Tensors given to ``load_weights``: kept as shadows unless the loader now hands out
        the engine tensor (then the engine tensor holds exactly these bits)."""
        store = self.store
        for name, t in rebuilt.items():
            if store.shadow.get(name) is t:
                continue  # rebuilt in its shadow
            if self.loader.direct_target(self._targets[name].meta) is not None:
                store.shadow.pop(name, None)
            else:
                store.keep(name, t)

    def __getattr__(self, item: str) -> Any:  # loader attributes a receiver may read
        return getattr(self.loader, item)
