"""Requests versus weight updates: a readers/writer gate on a server's event loop.

Callers: ``weightsync.servers.control.UpdateControl`` only (one asyncio loop per server). A
request that runs the model (a score, a completion, a stream until its last byte) holds the
read side, so everything in one response comes from one weight version. A weight update holds
the write side from its ``start`` to its ``finish`` (several HTTP calls): it waits for in-flight
requests to drain, and new requests wait until the update is done, so no response ever mixes
old and new weights. A waiting writer blocks new readers (no starvation).
"""

from __future__ import annotations

import asyncio
import time


class UpdateGate:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer: str | None = None  # update id holding the gate
        self._writers_waiting = 0
        self.writer_since = 0.0

    @property
    def writer(self) -> str | None:
        return self._writer

    @property
    def readers(self) -> int:
        return self._readers

    async def acquire_read(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no update holds or waits for the gate."""
        async with self._cond:
            await asyncio.wait_for(
                self._cond.wait_for(lambda: self._writer is None and not self._writers_waiting),
                timeout_s,
            )
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self, owner: str, timeout_s: float) -> None:
        """Wait until in-flight scores finished and no other update holds the gate."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._writer is None and self._readers == 0),
                    timeout_s,
                )
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()
            self._writer = owner
            self.writer_since = time.monotonic()

    async def transfer_write(self, owner: str) -> None:
        """Hand a held gate to a new update (a restarted sync replaces an abandoned one)."""
        async with self._cond:
            self._writer = owner
            self.writer_since = time.monotonic()

    async def release_write(self, owner: str | None = None) -> None:
        async with self._cond:
            if owner is None or self._writer == owner:
                self._writer = None
                self._cond.notify_all()
