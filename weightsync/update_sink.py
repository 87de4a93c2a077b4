"""What a receiver loads into during one update: the engine's loader behind a checksum check,
either in place or staged.

Who uses it: ``weightsync.engine.WeightUpdateEndpoint`` only (in the engine process or vLLM
worker). For every update it builds one ``UpdateSink`` around the engine's ``WeightLoader`` and
hands the sink to the receiver instead of the loader, so every strategy gets the same behaviour
without knowing about it:

* **checksums** (``begin_chunk(request)`` with a request that carries ``checksums``): every
  tensor handed to ``load_weights`` is checked against the sender's checksum
  (``weightsync.integrity``); a mismatch raises ``ChecksumMismatchError`` naming the chunk and
  the tensors. The check runs in a worker thread at the same time as the load (in place) or the
  staging copy, so its cost hides behind them where a second core or stream is free.
* **in place** (default): tensors go straight to the loader. ``touched`` says whether the loader
  was given anything in this update (then a failed update leaves the weights torn).
* **staged** (``staged=True``): tensors are copied into staging buffers on their own device and
  the loader sees nothing until ``commit()`` (at the update's finish) hands every staged tensor
  to it in one ``load_weights`` call (one wait for the device's copies, not one per chunk: this
  is the time generation stands still when an update lands under requests in flight). A loader
  that keeps staged chunks itself (``stage_weights``; vLLM's direct mode: shadows of its
  parameters, swapped in by pointer at the finish) gets them as they arrive instead, and
  ``commit()`` asks it to publish them (``commit_staged``). An
  update that dies before its finish is ``discard()``-ed: the weights are exactly the last
  complete version. Memory cost: one extra copy of the update's bytes on the engine,
  held from the first chunk to the finish (a whole-model update: one more copy of the model).
  ``commit()`` itself copies into the weights; if it fails half-way (a loader error) the weights
  are torn like an in-place update that failed.

The sink also enforces what an update may carry as it arrives: each name at most once per
update (``seen``), which bounds an update by the model's own parameters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.errors import ChecksumMismatchError, WeightMismatchError
from weightsync.interfaces import WeightLoader
from weightsync.types import TensorMeta, WeightUpdateFinish, WeightUpdateStart

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.types import WeightUpdateRequest


class UpdateSink(WeightLoader):
    """The loader a receiver sees during one update (see the module docstring)."""

    def __init__(self, loader: WeightLoader, *, staged: bool = False, name: str = "engine") -> None:
        self.loader = loader
        self.staged = staged
        self.name = name
        #: the endpoint sets it while one call carries the update's chunks and its finish
        #: (``apply_update``): borrowed views may then be lent on (``load_borrowed``)
        self.one_call = False
        self.touched = False  # the engine's loader was given bytes in this update
        self.staged_bytes = 0
        self.seen: set[str] = set()
        self._staged: list[dict[str, torch.Tensor]] = []
        self._request: WeightUpdateRequest | None = None
        self._want: dict[str, int] | None = None  # name -> the sender's checksum
        self._chunk = 0  # the chunk landing now (its index in a streamed update's stream)
        self._kept_by_loader = False  # stage_weights took some of this update's chunks

    # -- what a receiver calls ---------------------------------------------------------------
    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        return self.loader.expected_metadata()

    def validate(self, metas: Iterable[TensorMeta]) -> None:
        self.loader.validate(metas)

    async def start_update(self, start: WeightUpdateStart) -> None:  # pragma: no cover
        raise AssertionError("the endpoint runs the loader's hooks itself")

    async def finish_update(self, finish: WeightUpdateFinish) -> None:  # pragma: no cover
        raise AssertionError("the endpoint runs the loader's hooks itself")

    def begin_chunk(self, request: WeightUpdateRequest) -> None:
        """Called by the endpoint before a chunk's bytes move: refuses names this update already
        carried (nothing moved yet) and remembers the chunk's checksums."""
        again = sorted(set(request.names) & self.seen)
        if again:
            raise WeightMismatchError(
                [f"{n}: sent more than once in one update (chunk {request.chunk_index} repeats "
                 f"it)" for n in again], target=f"update {request.update_id} of {self.name}")
        self._request = request
        self._chunk = request.chunk_index
        self._want = None
        if request.checksums is not None:
            self.expect_checksums(request.names, request.checksums)

    def end_chunk(self) -> None:
        """The chunk landed (loaded or staged): its names count as carried."""
        if self._request is not None:
            self.seen.update(self._request.names)
        self._request = None
        self._want = None

    def expect_checksums(self, names: Sequence[str], checksums: Sequence[int],
                         chunk: int | None = None) -> None:
        """The sender's checksums of ``names``: what arrives under those names is checked
        against them. A streamed update's come over the data plane with each of its chunks
        (``chunk``: its index in the stream, for the error)."""
        self._want = {**(self._want or {}), **dict(zip(names, checksums, strict=True))}
        if chunk is not None:
            self._chunk = chunk

    def direct_target(self, meta: TensorMeta) -> torch.Tensor | None:
        """The loader's ``direct_target`` during an in-place update (None while staging: the
        weights must not change before the finish). A target given out counts as touched:
        the weights change as soon as the bytes start to land."""
        if self.staged:
            return None
        target = self.loader.direct_target(meta)
        if target is not None:
            self.touched = True
        return target

    async def landed_in_place(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Tensors the receiver wrote into ``direct_target`` s landed: check their checksums,
        then tell the loader."""
        bad = await self._checked(named_tensors)
        self.loader.loaded_in_place(list(named_tensors))
        self._raise_for(bad)

    async def load_borrowed(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Views valid until the call that carried them returns (``WeightLoader.load_borrowed``):
        lent on to the loader while ``one_call`` (that call carries the finish too) and the
        update is in place; otherwise loaded as any chunk (copied)."""
        await self.load_weights(named_tensors, borrowed=self.one_call and not self.staged)

    async def load_weights(self, named_tensors: dict[str, torch.Tensor], *,
                           borrowed: bool = False) -> None:
        check = None
        if self._want is not None:
            check = asyncio.ensure_future(self._checked(named_tensors))
        try:
            if self.staged:
                if self.loader.stage_weights(named_tensors):
                    self._kept_by_loader = True
                    self.staged_bytes += sum(t.numel() * t.element_size()
                                             for t in named_tensors.values())
                else:
                    self._stage(named_tensors)
            else:
                self.touched = True
                if borrowed:
                    await self.loader.load_borrowed(named_tensors)
                else:
                    await self.loader.load_weights(named_tensors)
        finally:
            bad = await check if check is not None else []
        self._raise_for(bad)

    async def _checked(self, named_tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """One line per tensor whose bytes differ from the sender's checksum (none expected:
        nothing to check)."""
        want = self._want
        if not want:
            return []
        from weightsync._runtime.threads import in_thread
        from weightsync.integrity import mismatches

        names = [n for n in named_tensors if n in want]
        return await in_thread(mismatches, names, [want[n] for n in names], named_tensors,
                               name="ws-checksum")

    def _raise_for(self, bad: list[str]) -> None:
        if not bad:
            return
        request = self._request
        where = (f"chunk {self._chunk} of update {request.update_id}"
                 if request is not None else "the update")
        raise ChecksumMismatchError(
            f"{self.name}: {where}: {len(bad)} tensor(s) arrived with other bytes than the "
            f"sender sent (corrupted in transit): {'; '.join(bad[:5])}", bad)

    # -- staging -----------------------------------------------------------------------------
    def _stage(self, named: Mapping[str, torch.Tensor]) -> None:
        copies = {n: t.detach().clone() for n, t in named.items()}
        self._staged.append(copies)
        self.staged_bytes += sum(t.numel() * t.element_size() for t in copies.values())

    async def commit(self) -> None:
        """Every staged tensor into the engine's loader, in one call (the update's finish; a
        name comes at most once per update, so the chunks merge without loss)."""
        merged: dict[str, torch.Tensor] = {}
        for chunk in self._staged:
            merged.update(chunk)
        self._staged.clear()
        self.staged_bytes = 0
        if self._kept_by_loader:  # disjoint from ``merged``: each name once per update
            self._kept_by_loader = False
            self.touched = True
            self.loader.commit_staged()
        if merged:
            self.touched = True
            await self.loader.load_weights(merged)

    def discard(self) -> None:
        """Drop every staged tensor (the update failed): the weights never saw them."""
        self._staged.clear()
        self.staged_bytes = 0
        if self._kept_by_loader:
            self._kept_by_loader = False
            self.loader.discard_staged()

    def __getattr__(self, item: str) -> Any:  # loader attributes a receiver may read
        return getattr(self.loader, item)
