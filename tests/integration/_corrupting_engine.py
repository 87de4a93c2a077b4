"""A module factory for ``LocalEngineProcess`` that also corrupts one chunk on purpose, on the
receiving side: the fault the end-to-end checksum exists to catch.

``build(corrupt_chunk=K, **qwen2_kwargs)`` runs in the engine's child process. It builds the
usual Qwen2-shaped module (``weightsync.local.modules.qwen2_module``) and registers a test-only
hook there: every receiver's ``receive_and_load_weights`` gets a loader wrapper that, for chunk
``K`` of each update, flips every bit of one byte of the first tensor it is handed (after the
data plane delivered it, before the engine checks and loads it). The byte is flipped in a
private copy, so the sender's shared buffers (and a trainer's shared weights) stay intact; a
tensor a streamed broadcast wrote straight into the weights is flipped there. No
flag in weightsync turns this on: the test asks for this factory.
"""

from __future__ import annotations

from typing import Any


def build(corrupt_chunk: int = 1, **kwargs: Any) -> Any:
    from weightsync.interfaces import WeightTransferReceiver
    from weightsync.local.modules import qwen2_module

    original = WeightTransferReceiver.receive_and_load_weights

    async def corrupting(self, request, loader):
        if getattr(request, "stream", False):  # one request, chunk K of its data-plane stream
            return await original(self, request, _Flipper(loader, chunk=-1, nth=corrupt_chunk))
        if request.chunk_index != corrupt_chunk:
            return await original(self, request, loader)
        return await original(self, request, _Flipper(loader, chunk=0, nth=0))

    WeightTransferReceiver.receive_and_load_weights = corrupting  # the injected fault
    return qwen2_module(**kwargs)


class _Flipper:
    """Hands the loader the same tensors, the first one of chunk ``nth`` with one byte flipped
    (a streamed update's chunks are counted by the checksums that come with each)."""

    def __init__(self, loader: Any, *, chunk: int, nth: int) -> None:
        self.loader = loader
        self.chunk = chunk
        self.nth = nth
        self.flipped = False

    def __getattr__(self, item: str) -> Any:
        return getattr(self.loader, item)

    def expect_checksums(self, names: Any, sums: Any, chunk: Any = None) -> None:
        self.chunk += 1
        self.loader.expect_checksums(names, sums, chunk)

    def _due(self) -> bool:
        due = self.chunk == self.nth and not self.flipped
        self.flipped = self.flipped or due
        return due

    async def load_weights(self, named: dict) -> None:
        await self.loader.load_weights(self._flipped(named))

    async def load_borrowed(self, named: dict) -> None:  # views a receiver lends (cuda_ipc)
        await self.loader.load_borrowed(self._flipped(named))

    def _flipped(self, named: dict) -> dict:
        if not self._due():
            return named
        named = dict(named)
        first = next(iter(named))
        bad = named[first].detach().clone()
        bad.view(-1).view(__import__("torch").uint8)[0] ^= 0xFF
        named[first] = bad
        return named

    async def landed_in_place(self, named: dict) -> None:
        if self._due():  # the bytes are in the weights already: corrupt them there
            first = next(iter(named))
            named[first].view(-1).view(__import__("torch").uint8)[0] ^= 0xFF
        await self.loader.landed_in_place(named)
