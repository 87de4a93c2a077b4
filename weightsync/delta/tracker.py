"""The sending rank's side of delta updates: what the engines hold, and one push as a delta.

Who uses it: the front door (``weightsync.connect``: ``connect(..., delta=True)`` or
``push(..., delta=True)``), on the sending rank, around the session's one send. Nothing else
changes for the strategy: a delta update is a normal update whose chunks carry the wire tensors
of ``weightsync.delta.codec`` and whose start carries the ``DeltaSpec``.

``DeltaTracker`` keeps ``base`` (the tensors of the last complete version pushed, exactly as
sent: after the push's cast, i.e. at the dtype the engine serves, on the device the extractor
yielded them on) and ``version`` (the version every engine published with them; None when
unknown). One push:

1. no known version (the first push, or after a failure): a **full** update whose start says
   ``delta = {base_version: None}``; the chunks stream out as usual and are copied into
   ``base`` on the way, and the engines keep what a later delta needs;
2. otherwise the chunks are encoded against ``base`` where they are (per tensor the cheapest
   of unchanged / sparse / dense by exact byte count, ``codec.encode``), ``base`` is advanced
   to the new tensors in place, and only the wire tensors are sent, as a **delta** against
   ``version``;
3. an engine that cannot apply it (it missed a version, restarted, or got an update from
   someone else) refuses at the start (``DeltaBaseMismatchError``, nothing moved) and the
   tracker sends the same push as a full update from ``base`` (which now holds the new
   tensors: no second extraction, no second copy).

Any other failure forgets the version (the next push is full). Memory: one copy of the pushed
tensors at the served dtype on the sender's device, plus the wire tensors of one push.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.delta.codec import DENSE, UNCHANGED, DeltaSpec, DeltaTarget, encode, full_spec
from weightsync.errors import DeltaBaseMismatchError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.types import SyncStats, TensorMeta, WeightChunk

#: ``send(chunks, manifest, delta) -> SyncStats``: one update through the session's sender
Send = Callable[[Any, list["TensorMeta"], dict], Awaitable["SyncStats"]]


class DeltaTracker:
    """What the engines hold, as far as this sending rank knows (see the module docstring).
    ``bucket_size_mb``: how wire tensors are cut into chunks; ``checksum``: send each rebuilt
    tensor's checksum, which every engine checks after applying the delta."""

    def __init__(self, *, bucket_size_mb: float, checksum: bool = False) -> None:
        self.bucket_size_mb = float(bucket_size_mb)
        self.checksum = bool(checksum)
        self.base: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    def forget(self) -> None:
        """The engines got something else (a push without delta): the next push is full."""
        self.version = None

    async def send(self, send: Send, chunks: Any, manifest: Sequence[TensorMeta]) -> SyncStats:
        """One push of ``chunks`` (``manifest``: the tensors they carry) through ``send``."""
        t0 = time.perf_counter()
        manifest = list(manifest)
        if self.version is None:
            stats = await self._full(send, self._recording(chunks), manifest)
            return self._done(stats, full_spec(manifest), t0, base=None, encode_s=0.0,
                              fallback=False)
        base = self.version
        self.version = None  # until the engines confirm the new one
        spec, wire = await self._encode(chunks, manifest, base)
        encode_s = time.perf_counter() - t0
        try:
            stats = await send(self._chunks(wire), spec.wire_metas(), spec.to_dict())
        except DeltaBaseMismatchError:
            # ``base`` holds the new tensors now: send them in full
            stats = await self._full(send, self._chunks(
                [(m.name, self.base[m.name]) for m in manifest]), manifest)
            return self._done(stats, full_spec(manifest), t0, base=base, encode_s=encode_s,
                              fallback=True)
        return self._done(stats, spec, t0, base=base, encode_s=encode_s, fallback=False)

    # -- internals ------------------------------------------------------------------------------
    async def _full(self, send: Send, chunks: Any, manifest: list[TensorMeta]) -> SyncStats:
        return await send(chunks, manifest, full_spec(manifest).to_dict())

    async def _recording(self, chunks: Any) -> Any:
        """``chunks`` as they are, each tensor copied into ``base`` on the way."""
        from weightsync.pipeline import aiter_chunks

        async for chunk in aiter_chunks(chunks):
            for name, t in zip(chunk.names, chunk.tensors, strict=True):
                self._keep(name, t)
            yield chunk

    async def _encode(self, chunks: Any, manifest: list[TensorMeta], base: int,
                      ) -> tuple[DeltaSpec, list[tuple[str, torch.Tensor]]]:
        """Every chunk against ``self.base`` (which becomes the new tensors): the spec of a
        delta against version ``base`` and its wire tensors."""
        from weightsync.pipeline import aiter_chunks

        targets: list[DeltaTarget] = []
        wire: list[tuple[str, torch.Tensor]] = []
        async for chunk in aiter_chunks(chunks):
            for name, t in zip(chunk.names, chunk.tensors, strict=True):
                target, parts = encode(name, t.detach(), self.base.get(name))
                if target.encoding != UNCHANGED:
                    self._keep(name, t)  # the base becomes the new tensor
                if target.encoding == DENSE:
                    parts = {name: self.base[name]}
                targets.append(target)
                wire.extend(parts.items())
        names = [t.name for t in targets]
        if names != [m.name for m in manifest]:
            extra = sorted(set(names) - {m.name for m in manifest})[:3]
            lost = sorted({m.name for m in manifest} - set(names))[:3]
            raise ValueError(f"delta push: the chunks do not follow the manifest (not in it: "
                             f"{extra}; missing: {lost}; or another order)")
        if not wire:  # nothing changed: the smallest tensor goes dense, so a version is published
            i = min(range(len(targets)), key=lambda k: targets[k].meta.nbytes)
            t = targets[i]
            targets[i] = DeltaTarget(t.name, t.dtype, t.shape, DENSE, t.meta.numel)
            wire = [(t.name, self.base[t.name])]
        if self.checksum:
            targets = self._with_checksums(targets)
        return DeltaSpec(base, targets), wire

    def _with_checksums(self, targets: list[DeltaTarget]) -> list[DeltaTarget]:
        from dataclasses import replace

        from weightsync.integrity import tensor_checksums

        sent = [t for t in targets if t.encoding != UNCHANGED]
        sums = dict(zip([t.name for t in sent],
                        tensor_checksums([self.base[t.name] for t in sent]), strict=True))
        return [replace(t, checksum=sums[t.name]) if t.name in sums else t for t in targets]

    def _chunks(self, named: list[tuple[str, torch.Tensor]]) -> list[WeightChunk]:
        from weightsync.pipeline import make_chunks

        return list(make_chunks(named, bucket_size_mb=self.bucket_size_mb))

    def _keep(self, name: str, t: torch.Tensor) -> None:
        old = self.base.get(name)
        if old is t:
            return
        if old is not None and old.shape == t.shape and old.dtype == t.dtype \
                and old.device == t.device:
            old.copy_(t)
        else:
            self.base[name] = t.detach().clone().contiguous()

    def _done(self, stats: SyncStats, spec: DeltaSpec, t0: float, *, base: int | None,
              encode_s: float, fallback: bool) -> SyncStats:
        versions = stats.versions
        ok = bool(versions) and all(isinstance(v, int) for v in versions) and len(set(versions)) == 1
        self.version = int(versions[0]) if ok else None  # type: ignore[arg-type]
        changed = sum(t.nnz for t in spec.targets)
        numel = sum(t.meta.numel for t in spec.targets)
        stats.seconds = time.perf_counter() - t0
        stats.delta = {
            "base_version": base, "fallback": fallback, "full_bytes": spec.full_bytes,
            "wire_bytes": stats.total_bytes, "encodings": spec.counts(),
            "changed_fraction": changed / numel if numel else 0.0, "encode_s": encode_s,
        }
        return stats
