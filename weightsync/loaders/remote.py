"""``remote`` loader: an engine reached over HTTP, fed by the engine process that hosts the loader.

A relay: the process that runs this loader receives an update over any strategy (its
``WeightUpdateEndpoint`` and receiver, as for any engine) and the loader forwards it, chunk by
chunk, to a remote engine through a front-door session of its own (``weightsync.connect`` to the
remote server's control plane, e.g. ``http://host:8000`` of a policy or reward server) over our
strategies (``strategy``, default ``broadcast``; ``backend`` set or following the tensors): no
second transport. Each local update is one remote update with the same manifest, version,
training mode and head patterns, one remote chunk per local chunk.

Who calls: the relay's endpoint, in its event loop (the loader hooks). ``start_update`` starts
the remote push (the session is opened on the first update); ``load_weights`` copies the
chunk's tensors (they may be views of the receiver's reused buffers) and hands them to it, with
at most one chunk waiting; ``finish_update`` ends it and waits for the remote engines' answer,
so the local update succeeds only once the remote one did (``last_stats``: the remote push's
``SyncStats``). A remote refusal (a bad name or shape: the remote validates the manifest before
any byte moves there) or a remote failure is raised from the next ``load_weights`` or from
``finish_update``: the local update fails with it and the local sender sees it. A local update
that fails half-way calls no loader hook: the remote push still waiting for chunks is cancelled
by the next ``start_update`` (the remote gets a failed finish) or abandoned by the remote after
its idle timeout; either way the remote never publishes a partial update.

``expected_metadata()`` is None: the remote engine knows its names; the start must carry a
manifest (every weightsync sender sends one for a model or a state dict), the remote checks it.
``aclose()`` closes the session (the remote's receivers are torn down).

    loader = RemoteWeightLoader(RemoteLoaderConfig(url="http://10.0.0.7:8000", api_key=KEY))
    endpoint = WeightUpdateEndpoint(loader, name="relay")   # served like any local engine
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.config import LoaderConfig
from weightsync.errors import UpdateRefusedError, WeightSyncError
from weightsync.interfaces import WeightLoader
from weightsync.types import (
    SyncStats,
    TensorMeta,
    WeightChunk,
    WeightUpdateFinish,
    WeightUpdateStart,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

_END = object()  # the last chunk was handed over


@dataclass(kw_only=True)
class RemoteLoaderConfig(LoaderConfig):
    """``url``: the remote engine (a server's base URL); ``api_key``: its token; ``strategy``:
    how the chunks travel on (anything ``weightsync.connect`` takes as a strategy);
    ``timeout_s``: the session's control-call timeout (None: the strategy's)."""

    type: str = "remote"
    url: str = ""
    api_key: str | None = None
    strategy: dict[str, Any] = field(default_factory=lambda: {"type": "broadcast"})
    timeout_s: float | None = None


class RemoteWeightLoader(WeightLoader):
    """Forwards every update it is given to one remote engine (registered as ``remote``).

    ``engine``: instead of ``cfg.url``, any engine ``weightsync.connect`` takes (a URL, a Ray
    actor handle, a ``LocalEngineProcess``, an in-process ``WeightUpdateEndpoint``)."""

    config_cls = RemoteLoaderConfig

    def __init__(self, cfg: Any = None, *, engine: Any = None) -> None:
        self.cfg = cfg if cfg is not None else RemoteLoaderConfig()
        self.engine = engine if engine is not None else self.cfg.url
        if not self.engine:
            raise ValueError("remote loader: give the remote engine as url in its config (or "
                             "engine=...)")
        self.session: Any = None
        self.last_stats: SyncStats | None = None
        self._queue: asyncio.Queue | None = None
        self._push: asyncio.Task | None = None
        self.loads = 0

    def adapter_loader(self, spec: Any) -> WeightLoader:
        """A LoRA adapter-only update is relayed as one too: the remote engine validates and
        installs it (``weightsync.lora_adapter``)."""
        return _AdapterRelay(self, spec.to_dict())

    async def start_update(self, start: WeightUpdateStart, *,
                           lora_adapter: dict | None = None) -> None:
        """Open the remote update (the session at the first one); an earlier remote push that
        its local update left waiting is cancelled first. ``lora_adapter``: relay an adapter
        update."""
        await self._cancel_push()
        if start.manifest is None:
            raise UpdateRefusedError(
                f"remote loader: update {start.update_id} came without a manifest; the remote "
                f"engine {self.engine!r} needs one to check the update before any byte moves")
        if self.session is None:
            from weightsync.connect import connect

            self.session = await connect(self.engine, self.cfg.strategy, api_key=self.cfg.api_key,
                                         timeout_s=self.cfg.timeout_s, rank=0, src_rank=0)
        self._queue = asyncio.Queue(maxsize=1)
        self._push = asyncio.create_task(self.session.push_chunks(
            self._chunks(self._queue), list(start.manifest), version=start.version,
            training_mode=start.training_mode, head_name_patterns=start.head_name_patterns,
            lora_adapter=lora_adapter,
        ))

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Hand a copy of the chunk to the remote push (returns once it is queued)."""
        if self._push is None or self._queue is None:
            raise WeightSyncError("remote loader: load_weights outside an update (no "
                                  "start_update)")
        chunk = WeightChunk(names=list(named_tensors),
                            tensors=[t.detach().clone() for t in named_tensors.values()])
        await self._hand_over(chunk)
        self.loads += 1

    async def finish_update(self, finish: WeightUpdateFinish) -> None:
        """End the remote update and wait for it: raises what the remote push raised."""
        if self._push is None:
            raise WeightSyncError("remote loader: finish_update outside an update")
        await self._hand_over(_END)
        push, self._push, self._queue = self._push, None, None
        self.last_stats = await push

    async def aclose(self) -> None:
        """Cancel a remote push still open and close the session."""
        await self._cancel_push()
        session, self.session = self.session, None
        if session is not None:
            await session.close()

    # -- helpers ---------------------------------------------------------------------------------
    async def _hand_over(self, item: Any) -> None:
        """Queue ``item`` for the push; if the push ended meanwhile (the remote refused or
        failed), raise its error instead of waiting forever."""
        assert self._queue is not None and self._push is not None
        put = asyncio.ensure_future(self._queue.put(item))
        await asyncio.wait({put, self._push}, return_when=asyncio.FIRST_COMPLETED)
        if put.done():
            return
        put.cancel()
        push, self._push, self._queue = self._push, None, None
        await push  # raises the remote's error
        raise WeightSyncError(f"remote loader: the remote update to {self.engine!r} ended "
                              f"before every chunk was handed over")

    @staticmethod
    async def _chunks(queue: asyncio.Queue) -> AsyncIterator[WeightChunk]:
        while True:
            item = await queue.get()
            if item is _END:
                return
            yield item

    async def _cancel_push(self) -> None:
        push, self._push, self._queue = self._push, None, None
        if push is None:
            return
        push.cancel()
        await asyncio.wait({push})  # its end, without raising its outcome here
        if not push.cancelled():
            push.exception()  # retrieved: an update left behind has no one else to tell

    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        return None


class _AdapterRelay(WeightLoader):
    """One adapter update through a ``RemoteWeightLoader``: the remote engine installs the
    adapter at its finish or not at all, so a failed relay leaves both ends on the last
    version (never torn)."""

    changes_at_finish_only = True

    def __init__(self, remote: RemoteWeightLoader, adapter: dict) -> None:
        self.remote = remote
        self.adapter = adapter

    async def start_update(self, start: WeightUpdateStart) -> None:
        await self.remote.start_update(start, lora_adapter=self.adapter)

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        await self.remote.load_weights(named_tensors)

    async def finish_update(self, finish: WeightUpdateFinish) -> None:
        await self.remote.finish_update(finish)
