"""Requests versus weight updates: a readers/writer gate on a server's event loop.

Callers: ``weightsync.servers.control.UpdateControl`` only (one asyncio loop per server). A
request that runs the model (a score, a completion, a stream until its last byte) holds the
read side, so everything in one response comes from one weight version. A weight update holds
the write side from its ``start`` to its ``finish`` (several HTTP calls): it waits for in-flight
requests to drain, and new requests wait until the update is done, so no response ever mixes
old and new weights. A waiting writer blocks new readers (no starvation).

Releasing never awaits: ``release_read``/``release_write`` are plain calls, so a request
cancelled at any point (its client went away, the server shuts down) still gives its seat back
in the ``finally`` that releases it; a release that awaited a lock there could itself be
cancelled and leave a reader behind that no update could ever drain. Every reader carries a
label (method and path) and its start time, so a drain that times out can say who is holding
the gate (``in_flight``).

Scopes: a reader may say which model it asked for (``model``: the request's ``"model"``, None
when unknown), and a writer which LoRA adapter it updates (``adapter``: None for an update of
the weights). An adapter-only update changes nothing a request of another model reads, so it
and such requests do not wait for each other: a writer of adapter ``a`` waits only for readers
of ``a`` (and of an unknown model), and holds back only those. An update of the weights waits
for and holds back every reader, as does a reader of an unknown model every writer.

A reader may ask to run alone (``alone``: a request vLLM cannot run beside others, see
``weightsync.servers.policy``'s ``prompt_logprobs_alone``): it waits until no other reader runs,
new readers wait while it waits or runs (no starvation), and it waits for and holds back updates
as any reader of its model does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def conflicts(model: str | None, adapter: str | None) -> bool:
    """Whether a request for ``model`` and an update of ``adapter`` must not overlap (see the
    module docstring)."""
    return adapter is None or model is None or model == adapter


class UpdateGate:
    def __init__(self) -> None:
        self._readers: dict[int, tuple[str, float, str | None]] = {}  # token -> (label, since, model)
        self._next_token = 0
        self._writer: str | None = None  # update id holding the gate
        self._writer_adapter: str | None = None  # the adapter it updates (None: the weights)
        self._waiting: list[str | None] = []  # the adapters of the writers waiting
        self._alone: set[int] = set()  # the readers that run alone (tokens)
        self._alone_waiting = 0  # readers waiting to run alone
        self._changed = asyncio.Event()
        self.writer_since = 0.0

    @property
    def writer(self) -> str | None:
        return self._writer

    @property
    def readers(self) -> int:
        return len(self._readers)

    @property
    def alone_busy(self) -> bool:
        """A reader runs alone or waits to."""
        return bool(self._alone or self._alone_waiting)

    def in_flight(self, limit: int = 5, adapter: str | None = None) -> str:
        """The oldest readers an update of ``adapter`` waits for, e.g. ``"POST /v1/completions
        for 62s, ..."`` (for error texts)."""
        now = time.monotonic()
        oldest = sorted((r for r in self._readers.values() if conflicts(r[2], adapter)),
                        key=lambda r: r[1])
        text = ", ".join(f"{label or 'a request'} for {now - since:.0f}s"
                         for label, since, _ in oldest[:limit])
        more = len(oldest) - limit
        return text + (f" and {more} more" if more > 0 else "")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, ready: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not ready():
                await self._changed.wait()

    async def acquire_read(self, timeout_s: float, label: str = "",
                           model: str | None = None, *, alone: bool = False) -> int:
        """Wait (at most ``timeout_s``, else ``TimeoutError``) until no update that conflicts
        with a request for ``model`` holds or waits for the gate, no reader runs alone or waits
        to and, with ``alone``, no other reader runs; returns the token to hand to
        ``release_read``."""

        def free() -> bool:
            if self._writer is not None and conflicts(model, self._writer_adapter):
                return False
            if any(conflicts(model, a) for a in self._waiting) or self._alone:
                return False
            return not self._readers if alone else not self._alone_waiting

        if alone:
            self._alone_waiting += 1
        try:
            await self._wait_until(free, timeout_s)
        finally:
            if alone:
                self._alone_waiting -= 1
                self._notify()
        self._next_token += 1
        self._readers[self._next_token] = (label, time.monotonic(), model)
        if alone:
            self._alone.add(self._next_token)
        return self._next_token

    def release_read(self, token: int) -> None:
        self._alone.discard(token)
        if self._readers.pop(token, None) is not None:
            self._notify()

    async def acquire_write(self, owner: str, timeout_s: float,
                            adapter: str | None = None) -> None:
        """Wait until the in-flight requests an update of ``adapter`` conflicts with finished
        and no other update holds the gate."""
        self._waiting.append(adapter)
        try:
            await self._wait_until(
                lambda: self._writer is None and not any(
                    conflicts(r[2], adapter) for r in self._readers.values()), timeout_s)
        finally:
            self._waiting.remove(adapter)
            self._notify()
        self._writer, self._writer_adapter = owner, adapter
        self.writer_since = time.monotonic()

    def transfer_write(self, owner: str) -> None:
        """Hand a held gate to a new update (a restarted sync replaces an abandoned one); it
        keeps the scope it was acquired with (a caller hands it only to an update of the same
        adapter, or of the weights)."""
        self._writer = owner
        self.writer_since = time.monotonic()

    def release_write(self, owner: str | None = None) -> None:
        if owner is None or self._writer == owner:
            self._writer, self._writer_adapter = None, None
            self._notify()
