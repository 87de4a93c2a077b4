"""``FanOutClient``: the one ``InferenceEngineClient`` the senders use, over any channels.

Lives in the sending (training) process. Each call goes to every engine at once (one
``Channel`` each, in engine order) and follows one error policy (``policy.gather``):

* every engine's call is issued before the first await, in engine order (so an ordered
  channel delivers a sender's pipelined chunks in order);
* every call has a timeout: ``timeout_s`` for control calls; a chunk
  (``update_named_weights``) gets ``timeout_s`` plus ``timeout_s_per_gb`` per GB it carries
  (the engines receive and load it in that time), and ``apply_update`` likewise for all its
  requests' bytes; ``init_weight_transfer`` (the data plane's
  rendezvous) and ``start_weight_update`` (a server first drains its requests in flight) get
  ``join_timeout_s``. A call that outlives its timeout is a ``WeightSyncTimeout`` naming the
  engine and the call (the phase);
* the client waits for every engine, so none is left mid-call while another's failure is
  raised; once one failed, the others get ``grace_s`` to answer (an engine stuck in a collective
  with a dead peer may otherwise hang until its own timeout), then they are cancelled on our side
  and reported as such;
* of several failures the most telling is raised (``weightsync.errors.most_telling``): a
  ``WeightMismatchError`` with its offenders, then a dead engine (``EngineDiedError``), then a
  timeout, then the rest; the others are attached as notes. Every error names the engine and
  the method it failed in.

Engine ``i`` with ``w_i`` receiving workers joins data planes at ``rank_offset = 1 +
sum(w_0..w_{i-1})`` (rank 0 is the sender). ``max_inflight_updates`` is 2 only when every
channel is ordered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.clients.channel import Channel, as_channel
from weightsync.clients.policy import DEFAULT_GRACE_S, failed, gather
from weightsync.config import scaled_timeout
from weightsync.errors import WeightSyncError
from weightsync.interfaces import InferenceEngineClient
from weightsync.types import request_nbytes


class FanOutClient(InferenceEngineClient):
    """Every engine of a sync group behind one client.

    ``engines``: channels, or anything ``as_channel`` adapts (URLs, ``LocalEngineProcess``, Ray
    actor handles, in-process vLLM engines or endpoints); their order fixes the rank offsets.
    ``api_key`` goes to HTTP channels; ``names`` overrides the engines' names in errors.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        timeout_s: float = 30.0,
        timeout_s_per_gb: float = 20.0,
        join_timeout_s: float | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        api_key: str | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        engines = list(engines)
        if not engines:
            raise ValueError("FanOutClient needs at least one engine")
        if names is not None and len(names) != len(engines):
            raise ValueError(f"{len(names)} names given for {len(engines)} engines")
        self.channels: list[Channel] = [
            as_channel(e, index=i, api_key=api_key, name=names[i] if names else None)
            for i, e in enumerate(engines)
        ]
        labels = [ch.name for ch in self.channels]
        if len(set(labels)) != len(labels):
            raise ValueError(f"engine names must be unique, got {labels}")
        self.timeout_s = float(timeout_s)
        self.timeout_s_per_gb = float(timeout_s_per_gb)
        #: default: at least 2 minutes (a rendezvous, a server draining long generations)
        self.join_timeout_s = float(join_timeout_s if join_timeout_s is not None
                                    else max(self.timeout_s, 120.0))
        self.grace_s = float(grace_s)
        #: 2 chunks in flight only where every engine gets them in call order
        self.max_inflight_updates = 2 if all(ch.ordered for ch in self.channels) else 1
        self._world_sizes: list[int] | None = None

    @property
    def names(self) -> list[str]:
        return [ch.name for ch in self.channels]

    # -- InferenceEngineClient ----------------------------------------------------------------
    async def get_world_sizes(self) -> list[int]:
        if self._world_sizes is None:
            sizes = await gather(
                [ch.world_size() for ch in self.channels], names=self.names,
                method="world_size", timeout_s=self.timeout_s, grace_s=self.grace_s,
            )
            bad = [f"{n}: {s!r}" for n, s in zip(self.names, sizes, strict=True)
                   if not (isinstance(s, int) and not isinstance(s, bool) and s >= 1)]
            if bad:
                raise WeightSyncError(
                    f"engines reported invalid weight-sync world sizes (need ints >= 1): {bad}"
                )
            self._world_sizes = [int(s) for s in sizes]
        return list(self._world_sizes)

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        offsets = self.rank_offsets(await self.get_world_sizes())
        await self._all(
            "init_weight_transfer",
            [{"strategy_cfg": strategy_cfg, "sync_info": sync_info, "rank_offset": off}
             for off in offsets],
            timeout_s=self.join_timeout_s,
        )

    def start_weight_update(self, start: dict) -> Awaitable[None]:  # type: ignore[override]
        return self._all("start_weight_update", {"start": start}, timeout_s=self.join_timeout_s)

    def update_named_weights(self, request: dict) -> Awaitable[None]:  # type: ignore[override]
        """Not ``async``: the request is issued to every engine before this returns, so a
        sender that calls it chunk after chunk keeps them in order while several are in flight.
        Await the result for the engines' answers (within ``chunk_timeout_s`` of its bytes)."""
        return self._all("update_named_weights", {"request": request},
                         timeout_s=self.chunk_timeout_s(request_nbytes(request)))

    def chunk_timeout_s(self, nbytes: int) -> float:
        """How long the engines may take to receive and load a chunk of ``nbytes``."""
        return scaled_timeout(self.timeout_s, self.timeout_s_per_gb, nbytes)

    def finish_weight_update(self, finish: dict) -> Awaitable[list[int | None]]:  # type: ignore[override]
        return self._all("finish_weight_update", {"finish": finish})

    async def close_weight_transfer(self) -> None:
        await self._all("close_weight_transfer", {})

    @property
    def supports_apply_update(self) -> bool:  # type: ignore[override]
        """Every channel carries ``apply_update`` (a channel says so with ``one_call = True``)."""
        return all(getattr(ch, "one_call", False) for ch in self.channels)

    def apply_update(  # type: ignore[override]
        self, start: dict | None, requests: list[dict], finish: dict
    ) -> Awaitable[list[int | None]]:
        """Issued to every engine before this returns, like ``update_named_weights``; the
        engines answer within ``chunk_timeout_s`` of every request's bytes (a streamed
        broadcast's one request carries the whole update)."""
        nbytes = sum(request_nbytes(r) for r in requests)
        return self._all("apply_update", {"start": start, "requests": requests, "finish": finish},
                         timeout_s=self.chunk_timeout_s(nbytes))

    # -- beyond the sender's needs ---------------------------------------------------------------
    async def status(self) -> list[dict[str, Any]]:
        """Every engine's ``status()`` (state, version, last error, update in progress)."""
        return list(await self._all("status", {}))

    async def versions(self) -> list[int]:
        """The version each engine serves."""
        return [int(s["version"]) for s in await self.status()]

    async def aclose(self) -> None:
        """Release the channels' connections (the engines keep running)."""
        for ch in self.channels:
            await ch.aclose()

    # -- machinery -------------------------------------------------------------------------------
    def _all(
        self, method: str, kwargs: dict | Sequence[dict], *, timeout_s: float | None = None
    ) -> asyncio.Future:
        """Issue ``method`` to every engine now (engine order); a future of all results."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        per_engine = list(kwargs) if not isinstance(kwargs, dict) else [kwargs] * len(self.channels)
        calls: list[Awaitable[Any]] = []
        for ch, kw in zip(self.channels, per_engine, strict=True):
            try:
                calls.append(ch.call(method, kw, timeout_s=timeout))
            except Exception as e:  # refused before it left (e.g. a known-dead engine)
                calls.append(failed(e))
        return asyncio.ensure_future(gather(
            calls, names=self.names, method=method, timeout_s=timeout, grace_s=self.grace_s
        ))

    def __repr__(self) -> str:
        return f"FanOutClient({self.names})"
