"""The abstract contracts (summarised with the whole design in ``docs/architecture.md``).

Process map:
- trainer process(es): ``WeightExtractor`` (every training rank, in lockstep),
  ``WeightTransferSender`` (the sending rank only), ``InferenceEngineClient`` (sending rank).
- engine process(es) / workers: ``WeightTransferReceiver`` and ``WeightLoader``, driven by a
  ``weightsync.engine.WeightUpdateEndpoint``.
- ``WeightTransferStrategy`` is a factory usable on both sides; it is built from config.

One update = ``start`` (manifest validated by every engine before any byte moves) -> one request
per chunk -> ``finish`` (engines publish the new version only if every chunk landed).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from weightsync.types import (
    SyncStats,
    TensorMeta,
    TrainingMode,
    WeightChunk,
    WeightSyncInfo,
    WeightUpdateFinish,
    WeightUpdateRequest,
    WeightUpdateStart,
    dtype_to_str,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch


# --------------------------------------------------------------------------------------------
# Extractor
# --------------------------------------------------------------------------------------------


class WeightExtractor(abc.ABC):
    """Turns a training model into a stream of ``WeightChunk``s under engine names.

    Called on every training rank. For sharded models all ranks must iterate
    ``extract_weights`` to the end in lockstep (the raw iterator runs collectives); only the
    sending rank (``is_sender``) keeps tensors, the others yield nothing. The whole model is never
    materialised twice: chunks are yielded as soon as a bucket of ``bucket_size_mb`` fills.
    """

    def __init__(self, cfg: Any = None) -> None:
        from weightsync.config import ExtractorConfig

        self.cfg = cfg if cfg is not None else ExtractorConfig()

    # -- subclasses implement -----------------------------------------------------------------
    @abc.abstractmethod
    def _extract_raw_weights(
        self, model: Any, generator_dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(engine_name, full_tensor)`` one parameter at a time (collectives inside)."""

    def metadata(self, model: Any, generator_dtype: torch.dtype | None = None) -> list[TensorMeta]:
        """Cheap, non-collective list of what ``extract_weights`` will yield (for validation).

        The default walks ``_extract_raw_weights``; sharded extractors override it to read
        global shapes without gathering.
        """
        return [
            TensorMeta(n, dtype_to_str(self._cast(t, generator_dtype).dtype), list(t.shape))
            for n, t in self._extract_raw_weights(model, generator_dtype)
        ]

    @property
    def is_sender(self) -> bool:
        return bool(getattr(self.cfg, "is_sender", True))

    # -- shared machinery ----------------------------------------------------------------------
    async def extract_weights(
        self, model: Any, generator_dtype: torch.dtype | None = None
    ) -> AsyncIterator[WeightChunk]:
        raw = self._cast_stream(self._extract_raw_weights(model, generator_dtype), generator_dtype)
        groups = (
            self._group_by_module(raw)
            if getattr(self.cfg, "group_by_module", True)
            else ((n, [(n, t)]) for n, t in raw)
        )
        threshold = int(getattr(self.cfg, "bucket_size_mb", 1024) * (1 << 20))
        for chunk in self._batch_by_threshold(groups, threshold):
            if self.is_sender:
                yield chunk
            await asyncio.sleep(0)

    @staticmethod
    def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if dtype is None or t.dtype == dtype or not t.is_floating_point():
            return t
        return t.to(dtype)

    def _cast_stream(
        self, raw: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in raw:
            yield name, self._cast(t.detach(), dtype)

    @staticmethod
    def _group_by_module(
        named: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """Group consecutive parameters of one module (``a.b.weight``, ``a.b.bias`` -> ``a.b``)."""
        current: str | None = None
        group: list[tuple[str, torch.Tensor]] = []
        for name, t in named:
            module = name.rsplit(".", 1)[0] if "." in name else ""
            if group and module != current:
                yield current or "", group
                group = []
            current = module
            group.append((name, t))
        if group:
            yield current or "", group

    @staticmethod
    def _batch_by_threshold(
        groups: Iterable[tuple[str, list[tuple[str, torch.Tensor]]]], threshold_bytes: int
    ) -> Iterator[WeightChunk]:
        """Pack whole groups into chunks of at most ``threshold_bytes`` (a group larger than the
        threshold is a chunk of its own; a group is never split)."""
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        modules: list[str] = []
        size = 0
        for module, items in groups:
            gsize = sum(t.numel() * t.element_size() for _, t in items)
            if names and size + gsize > threshold_bytes:
                yield WeightChunk(names, tensors, module_name=_module_label(modules))
                names, tensors, modules, size = [], [], [], 0
            names.extend(n for n, _ in items)
            tensors.extend(t for _, t in items)
            modules.append(module)
            size += gsize
        if names:
            yield WeightChunk(names, tensors, module_name=_module_label(modules))


def _module_label(modules: list[str]) -> str | None:
    if not modules:
        return None
    return modules[0] if len(modules) == 1 else f"{modules[0]}..{modules[-1]}"


# --------------------------------------------------------------------------------------------
# Engine client (what the sender talks to)
# --------------------------------------------------------------------------------------------


class InferenceEngineClient(abc.ABC):
    """Fan-out to every inference engine of a sync group. Lives in the sending process.

    Engine ``i`` with ``w_i`` receiving workers gets ``rank_offset = 1 + sum(w_0..w_{i-1})``
    (rank 0 is the sender). All methods take and return plain JSON-safe data.
    """

    #: How many ``update_named_weights`` calls the sender may have outstanding at once. More
    #: than 1 only where every engine gets the chunk requests in call order (the call's
    #: synchronous part queues the message in order, and the engine runs them one at a time or
    #: orders them by ``chunk_index``): then chunk i+1's request travels while chunk i lands.
    max_inflight_updates: ClassVar[int] = 1

    @abc.abstractmethod
    async def get_world_sizes(self) -> list[int]:
        """Receiving workers per engine (TP x PP for vLLM, 1 for a plain module)."""

    @abc.abstractmethod
    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        """Have every engine build its receivers (returns once they joined the data plane)."""

    @abc.abstractmethod
    async def start_weight_update(self, start: dict) -> None:
        """Announce an update; engines validate its manifest and raise before any byte moves."""

    @abc.abstractmethod
    async def update_named_weights(self, request: dict) -> None:
        """One chunk: returns once every engine received and loaded it."""

    @abc.abstractmethod
    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        """Close an update; returns each engine's published version."""

    async def close_weight_transfer(self) -> None:  # noqa: B027 - optional hook
        """Tear down receivers (optional)."""

    @staticmethod
    def rank_offsets(world_sizes: list[int]) -> list[int]:
        offsets, nxt = [], 1
        for w in world_sizes:
            offsets.append(nxt)
            nxt += w
        return offsets


# --------------------------------------------------------------------------------------------
# Loader (engine side)
# --------------------------------------------------------------------------------------------


class WeightLoader(abc.ABC):
    """Puts received tensors into the engine's model. Runs in the engine (worker) process.

    ``load_weights`` must copy what it keeps: the tensors it receives may be views of transfer
    buffers that are reused after it returns.
    """

    @abc.abstractmethod
    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        """Names/shapes/dtypes the target accepts, or None when unknown (no validation)."""
        return None

    def validate(self, metas: Iterable[TensorMeta]) -> None:
        """Raise ``WeightMismatchError`` listing offenders; called before any byte moves."""
        from weightsync.validation import check_metadata

        check_metadata(metas, self.expected_metadata())

    async def start_update(self, start: WeightUpdateStart) -> None:  # noqa: B027
        """Hook before the first chunk of an update."""

    async def finish_update(self, finish: WeightUpdateFinish) -> None:  # noqa: B027
        """Hook after the last chunk landed (reset caches, re-pack kernels, ...)."""


# --------------------------------------------------------------------------------------------
# Sender / receiver
# --------------------------------------------------------------------------------------------


class WeightTransferSender(abc.ABC):
    """Ships chunks to every engine. Lives in the sending training process (rank 0).

    ``send_chunks`` runs one whole update: ``start`` (manifest check on every engine), one
    request per chunk, ``finish``. It overlaps preparing chunk i+1 (extraction, packing) with the
    transfer of chunk i. Subclasses implement ``create_request`` (may pack into transfer buffers;
    runs in a worker thread) and ``_transfer`` (moves the bytes and calls
    ``inference_client.update_named_weights``).
    """

    overlap: bool = True
    #: chunks in flight at once when the sender has no ``cfg.max_inflight_chunks``; the
    #: client's ``max_inflight_updates`` bounds it too
    max_inflight: int = 2

    @abc.abstractmethod
    def create_request(self, chunk: WeightChunk) -> WeightUpdateRequest: ...

    @abc.abstractmethod
    async def _transfer(
        self,
        chunk: WeightChunk,
        request: WeightUpdateRequest,
        inference_client: InferenceEngineClient,
    ) -> None: ...

    def _release(self, request: WeightUpdateRequest) -> None:  # noqa: B027
        """Called once a chunk's transfer completed (or failed): free its buffers."""

    async def send_chunks(
        self,
        chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk],
        inference_client: InferenceEngineClient,
        *,
        version: int | None = None,
        manifest: list[TensorMeta] | None = None,
        training_mode: TrainingMode | str | None = None,
        head_name_patterns: list[str] | None = None,
        extras: dict | None = None,
    ) -> SyncStats:
        """One whole update. ``manifest`` (derived from a list of chunks when not given) lets
        every engine refuse bad names/shapes/dtypes before any byte moves; ``training_mode`` and
        ``head_name_patterns`` travel in the start (the engines enforce the mode's name policy);
        ``extras`` is free-form data for custom loaders."""
        if manifest is None and isinstance(chunks, (list, tuple)):
            manifest = [m for c in chunks for m in c.metas()]
        stats = SyncStats(update_id=uuid.uuid4().hex)
        t0 = time.perf_counter()
        start = WeightUpdateStart(
            update_id=stats.update_id, version=version, manifest=manifest,
            training_mode=training_mode,
            head_name_patterns=list(head_name_patterns) if head_name_patterns else None,
            extras=extras or {},
        )
        await inference_client.start_weight_update(start.to_dict())
        try:
            await self._pipeline(_aiter(chunks), inference_client, stats, version)
        except BaseException as e:
            finish = WeightUpdateFinish(
                update_id=stats.update_id, version=version, num_chunks=stats.num_chunks,
                ok=False, error=f"{type(e).__name__}: {e}"[:2000],
            )
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    inference_client.finish_weight_update(finish.to_dict()), timeout=10
                )
            raise
        finish = WeightUpdateFinish(
            update_id=stats.update_id, version=version, num_chunks=stats.num_chunks
        )
        stats.versions = await inference_client.finish_weight_update(finish.to_dict())
        stats.seconds = time.perf_counter() - t0
        return stats

    async def _pipeline(
        self,
        it: AsyncIterator[WeightChunk],
        client: InferenceEngineClient,
        stats: SyncStats,
        version: int | None,
    ) -> None:
        """Up to ``window`` transfers run at once, started in chunk order; preparing the next
        chunk (extraction, packing: ``create_request`` in a thread) overlaps them. The first
        failure stops the update: no later chunk is started, and transfers still in flight are
        awaited (or cancelled on our side) before it is raised."""
        wanted = getattr(getattr(self, "cfg", None), "max_inflight_chunks", self.max_inflight)
        window = max(1, min(int(wanted), int(client.max_inflight_updates)))
        if not self.overlap:
            window = 1
        inflight: collections.deque[asyncio.Task] = collections.deque()
        nxt = await anext(it, None)
        index = 0
        try:
            while nxt is not None:
                chunk = nxt
                if self.overlap:
                    request = await self._prepare(chunk)
                else:
                    while inflight:
                        await inflight.popleft()
                    request = self.create_request(chunk)
                try:
                    nxt = await anext(it, None)
                    request.update_id = stats.update_id
                    request.chunk_index = index
                    request.is_last = nxt is None
                    request.version = version
                    while len(inflight) >= window or (inflight and _failed(inflight)):
                        await inflight.popleft()
                except BaseException:
                    self._release(request)  # its transfer never started
                    raise
                inflight.append(
                    asyncio.create_task(self._transfer_and_release(chunk, request, client))
                )
                index += 1
                stats.num_chunks = index
                stats.num_tensors += len(chunk)
                stats.total_bytes += chunk.total_size_bytes
            while inflight:
                await inflight.popleft()
        finally:
            if inflight:
                await _settle(inflight)

    async def _prepare(self, chunk: WeightChunk) -> WeightUpdateRequest:
        """``create_request`` in a worker thread. If we are cancelled meanwhile, the request
        the thread still makes is released when it is done (its buffers are not leaked)."""
        fut = asyncio.get_running_loop().run_in_executor(None, self.create_request, chunk)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._release_made)
            raise

    def _release_made(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._release(fut.result())

    async def _transfer_and_release(
        self, chunk: WeightChunk, request: WeightUpdateRequest, client: InferenceEngineClient
    ) -> None:
        try:
            await self._transfer(chunk, request, client)
        finally:
            self._release(request)

    async def close(self) -> None:  # noqa: B027
        """Release transport resources (process groups, shared buffers)."""


class WeightTransferReceiver(abc.ABC):
    """Receives one chunk's bytes and hands them to a loader. Lives in an engine worker.

    ``receive_and_load_weights`` must call ``loader.validate(request.metas())`` before it moves or
    loads any byte, and on failure must still release its peers (e.g. a collective strategy
    tells the sender to skip the data), then raise the ``WeightMismatchError``.
    """

    request_cls: ClassVar[type[WeightUpdateRequest]] = WeightUpdateRequest

    @abc.abstractmethod
    async def receive_and_load_weights(
        self, request: WeightUpdateRequest, loader: WeightLoader
    ) -> None: ...

    def _expect_own_type(self, request: WeightUpdateRequest) -> None:
        """Refuse a request of another strategy (sender and engine configured differently)."""
        if not isinstance(request, self.request_cls):
            raise ValueError(
                f"{type(self).__name__} expects a {self.request_cls.TYPE!r} request, got "
                f"{type(request).__name__}: sender and engine use different strategies"
            )

    async def refuse(self, request: WeightUpdateRequest) -> None:  # noqa: B027
        """The endpoint will not load this chunk (an earlier chunk of the update failed, or it
        came without a start). A strategy with a control collective must still take part in
        it, voting no, so that the sender and the other engines are released; others do
        nothing. Must not raise for a group that works."""

    def parse_request(self, request_dict: dict) -> WeightUpdateRequest:
        """Rebuild a request from plain data; a request of another strategy is a ValueError."""
        req = WeightUpdateRequest.from_dict(request_dict)
        if not isinstance(req, self.request_cls):
            raise ValueError(
                f"{type(self).__name__} expects a {self.request_cls.TYPE!r} request, got "
                f"{request_dict.get('type')!r}: sender and engine use different strategies"
            )
        return req

    def close(self) -> None:  # noqa: B027
        """Release transport resources."""


# --------------------------------------------------------------------------------------------
# Strategy (factory)
# --------------------------------------------------------------------------------------------


class WeightTransferStrategy(abc.ABC):
    """Builds matching sender/receiver pairs. Constructed from a typed config (``config_cls``).

    ``create_sync_info`` and ``create_sender`` run in the sending process; ``create_sender`` also
    asks every engine (through the client) to build its receiver, so that both sides join the
    data plane together. ``create_receiver`` runs in each engine worker with its
    ``rank_offset``.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type] = object

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = cfg if cfg is not None else self.config_cls()

    @abc.abstractmethod
    async def create_sync_info(
        self, cfg: Any, inference_client: InferenceEngineClient
    ) -> WeightSyncInfo: ...

    @abc.abstractmethod
    async def create_sender(
        self, cfg: Any, inference_client: InferenceEngineClient, sync_info: WeightSyncInfo
    ) -> WeightTransferSender: ...

    @abc.abstractmethod
    async def create_receiver(
        self, cfg: Any, sync_info: WeightSyncInfo, rank_offset: int
    ) -> WeightTransferReceiver: ...

    @classmethod
    @abc.abstractmethod
    def get_request_type(cls) -> type[WeightUpdateRequest]: ...

    def config_dict(self) -> dict:
        from weightsync.config import config_to_dict

        return config_to_dict(self.cfg)


def _failed(tasks: Iterable[asyncio.Task]) -> bool:
    return any(t.done() and not t.cancelled() and t.exception() is not None for t in tasks)


_SETTLE_GRACE_S = 5.0


async def _settle(tasks: collections.deque[asyncio.Task]) -> None:
    """After a failure: give transfers still in flight a short grace to end (their engines are
    mid-chunk or refusing it, and their buffers must not be reused under them), then cancel
    what is left; their outcomes are swallowed (the first error is the one raised)."""
    with contextlib.suppress(BaseException):
        _, pending = await asyncio.wait(tasks, timeout=_SETTLE_GRACE_S)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: no "never retrieved" warning
    tasks.clear()


async def _aiter(chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk]) -> AsyncIterator[WeightChunk]:
    if hasattr(chunks, "__aiter__"):
        async for c in chunks:  # type: ignore[union-attr]
            yield c
    else:
        for c in chunks:  # type: ignore[union-attr]
            yield c
