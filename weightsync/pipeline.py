"""The machinery between a model and the engines: bucketing, and the bounded send pipeline.

Trainer side only (the sending rank, but for ``send_extracted``). Its jobs, all public:

* **Bucketing** turns ``(engine_name, tensor)`` pairs into ``WeightChunk`` s:
  ``group_by_module`` keeps one module's parameters together (``a.b.weight`` and ``a.b.bias``),
  ``batch_by_threshold`` packs whole groups into chunks of at most a byte threshold (a group
  bigger than the threshold is a chunk of its own; a group is never split), and ``make_chunks``
  does both. Extractors use them for their stream; callers that hold plain tensors (the front
  door given a state dict, the reward client) use ``make_chunks``.
* ``SendPipeline`` runs the chunk transfers of one update for a ``WeightTransferSender``. The
  rules it keeps (the sender's and the engines' correctness rests on them):

  - **order**: transfers start in chunk order (each one's synchronous prefix runs before the
    next starts, so a client that queues a message there delivers them in order);
  - **window**: at most ``window`` transfers are under way at once; preparing the next chunk
    (extraction, packing in a worker thread) overlaps them;
  - **one outcome per request**: every request that was prepared is either transferred or
    released, never both and never neither, so a collective strategy's votes and a pool's
    buffers stay in step: a request prepared but never transferred (the update failed meanwhile,
    the stream raised, the caller was cancelled, even while the worker thread was still packing)
    is released;
  - **first failure stops**: no later chunk starts; transfers already under way get a short
    grace to end (their engines may still read the buffers or be in a collective), then are
    cancelled on our side; the first failure in chunk order is raised. A cancelled ``run``
    settles the same way.

  Why not ``asyncio.TaskGroup``: it cancels every sibling at once on the first failure, which
  would release buffers an engine is still reading and skip votes peers wait for.
* ``send_extracted`` runs one extraction of a model per update on every training rank: the
  sending rank sends the stream, the others take part in the gathers, and no rank is left in a
  collective when the send fails early.
* Fewer round trips: ``coalesce`` merges the chunks of the trainer's own tensors,
  ``peek_single`` / ``SingleCallClient`` send a one-chunk update as one ``apply_update`` call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from weightsync.config import DEFAULT_BUCKET_MB
from weightsync.types import SyncStats, WeightChunk, WeightUpdateRequest

if TYPE_CHECKING:  # pragma: no cover
    import torch

T = TypeVar("T")

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]

# --------------------------------------------------------------------------------------------
# bucketing
# --------------------------------------------------------------------------------------------


def group_by_module(
    named: NamedTensors,
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


def batch_by_threshold(
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


def make_chunks(
    named: NamedTensors, *, bucket_size_mb: float = DEFAULT_BUCKET_MB, by_module: bool = True
) -> Iterator[WeightChunk]:
    """``(name, tensor)`` pairs -> chunks of at most ``bucket_size_mb`` (module groups kept whole
    when ``by_module``; otherwise one group per tensor)."""
    groups = group_by_module(named) if by_module else ((n, [(n, t)]) for n, t in named)
    return batch_by_threshold(groups, int(float(bucket_size_mb) * (1 << 20)))


def _module_label(modules: list[str]) -> str | None:
    if not modules:
        return None
    return modules[0] if len(modules) == 1 else f"{modules[0]}..{modules[-1]}"


# --------------------------------------------------------------------------------------------
# the send pipeline
# --------------------------------------------------------------------------------------------

Prepare = Callable[[WeightChunk], WeightUpdateRequest]
Transfer = Callable[[WeightChunk, WeightUpdateRequest], Awaitable[None]]
Release = Callable[[WeightUpdateRequest], None]
Stamp = Callable[[WeightUpdateRequest, int, bool], None]

#: how long transfers still under way may take to end after another one failed
SETTLE_GRACE_S = 5.0


class SendPipeline:
    """One update's chunk transfers, at most ``window`` at once (see the module docstring).

    ``prepare(chunk) -> request`` makes a chunk's request (may pack into transfer buffers; runs
    in a worker thread when ``overlap``); ``transfer(chunk, request)`` moves its bytes and has
    the engines load it; ``release(request)`` frees what ``prepare`` took (called exactly once
    per prepared request: after its transfer, or instead of it). ``overlap=False`` prepares on
    the event loop and only once every earlier transfer ended (one chunk at a time).
    """

    def __init__(
        self,
        *,
        prepare: Prepare,
        transfer: Transfer,
        release: Release,
        window: int = 2,
        overlap: bool = True,
        settle_grace_s: float = SETTLE_GRACE_S,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.prepare = prepare
        self.transfer = transfer
        self.release = release
        self.window = 1 if not overlap else int(window)
        self.overlap = overlap
        self.settle_grace_s = settle_grace_s

    async def run(
        self,
        chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk],
        stats: SyncStats,
        stamp: Stamp,
    ) -> None:
        """Transfer every chunk. ``stamp(request, index, is_last)`` fills the request's update
        fields before its transfer starts; ``stats`` counts the chunks started (so a failed
        update's finish can say how many)."""
        it = aiter_chunks(chunks)
        inflight: collections.deque[asyncio.Task] = collections.deque()
        nxt = await anext(it, None)
        index = 0
        try:
            while nxt is not None:
                chunk = nxt
                if self.overlap:
                    request = await self._prepare_in_thread(chunk)
                else:
                    await _drain(inflight)
                    request = self.prepare(chunk)
                try:
                    nxt = await anext(it, None)  # extraction of the next chunk overlaps too
                    stamp(request, index, nxt is None)
                    while len(inflight) >= self.window or (inflight and _any_failed(inflight)):
                        await _await_oldest(inflight)  # raises the first failure in chunk order
                except BaseException:
                    self.release(request)  # prepared, never transferred
                    raise
                inflight.append(asyncio.create_task(self._transfer_then_release(chunk, request)))
                index += 1
                stats.num_chunks = index
                stats.num_tensors += len(chunk)
                stats.total_bytes += chunk.total_size_bytes
            await _drain(inflight)
        finally:
            if inflight:
                await self._settle(inflight)

    async def _prepare_in_thread(self, chunk: WeightChunk) -> WeightUpdateRequest:
        """``prepare`` in a worker thread. If we are cancelled meanwhile, the request the thread
        still makes is released once it is made (its buffers are not leaked)."""
        fut = asyncio.get_running_loop().run_in_executor(None, self.prepare, chunk)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._release_made)
            raise

    def _release_made(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())

    async def _transfer_then_release(self, chunk: WeightChunk, request: WeightUpdateRequest) -> None:
        try:
            await self.transfer(chunk, request)
        finally:
            self.release(request)

    async def _settle(self, tasks: collections.deque[asyncio.Task]) -> None:
        """After a failure or a cancellation: give transfers still under way a short grace to
        end, then cancel what is left; their outcomes are swallowed (the first error is the one
        raised)."""
        with contextlib.suppress(BaseException):
            _, pending = await asyncio.wait(tasks, timeout=self.settle_grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: no "never retrieved" warning
        tasks.clear()


# --------------------------------------------------------------------------------------------
# one extraction per update, on every rank
# --------------------------------------------------------------------------------------------


async def send_extracted(
    extractor: Any,  # a WeightExtractor (interfaces imports this module: no type import back)
    model: Any,
    generator_dtype: Any,
    send: Callable[[Callable[[], AsyncIterator[WeightChunk]]], Awaitable[T]],
) -> T | None:
    """One extraction of ``model`` for one update, on this training rank (every rank of a
    sharded model calls it in lockstep). The sending rank (``extractor.is_sender``) gives
    ``send`` a function that starts the chunk stream (``extract_weights``) and returns what
    ``send`` returns; the other ranks run their part of the gathers, keep nothing and return
    None. When ``send`` fails before the stream started (a refused manifest, a group that did
    not form), the sending rank still runs its gathers (the extractor's ``drain``), so the other
    ranks are never left waiting in a collective. Callers: the front door (``connect``), the
    reward publisher."""
    if not extractor.is_sender:
        async for _ in extractor.extract_weights(model, generator_dtype):
            pass  # lockstep gathers; a non-sending rank keeps nothing
        return None
    started = getattr(extractor, "runs_started", None)  # a gathering extractor counts its runs
    try:
        return await send(lambda: extractor.extract_weights(model, generator_dtype))
    except BaseException:
        if started is not None and extractor.runs_started == started:
            extractor.drain(model, generator_dtype)  # never started: run the gathers anyway
        discard = getattr(extractor, "discard_prepared", None)
        if discard is not None:  # a prepared extraction never sent is not kept
            discard()
        raise


# --------------------------------------------------------------------------------------------
# fewer round trips: coalescing chunks, one call for a one-chunk update
# --------------------------------------------------------------------------------------------


async def coalesce(
    chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk],
    mergeable: Callable[[WeightChunk], bool],
) -> AsyncIterator[WeightChunk]:
    """Merge runs of consecutive ``mergeable`` chunks into one chunk each (names and tensors
    concatenated, in order); other chunks pass through unchanged and in place. Only for chunks
    whose tensors cost nothing to hold (``WeightChunk.borrowed``, or a list the caller holds
    anyway): a merged chunk keeps all of them alive until it is sent."""
    names: list[str] = []
    tensors: list[Any] = []
    async for chunk in aiter_chunks(chunks):
        if mergeable(chunk):
            names.extend(chunk.names)
            tensors.extend(chunk.tensors)
            continue
        if names:
            yield WeightChunk(names, tensors, module_name="(coalesced)", borrowed=True)
            names, tensors = [], []
        yield chunk
    if names:
        yield WeightChunk(names, tensors, module_name="(coalesced)", borrowed=True)


async def peek_single(
    chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk],
) -> tuple[WeightChunk | None, AsyncIterator[WeightChunk]]:
    """``(the only chunk, None-stream)`` when ``chunks`` holds exactly one chunk, else ``(None,
    the same chunks)`` (at most two were read ahead: they are yielded again first)."""
    it = aiter_chunks(chunks)
    first = await anext(it, None)
    second = await anext(it, None) if first is not None else None
    if first is not None and second is None:
        return first, aiter_chunks(())

    async def again() -> AsyncIterator[WeightChunk]:
        for c in (first, second):
            if c is not None:
                yield c
        async for c in it:
            yield c

    return None, again()


class SingleCallClient:
    """An ``InferenceEngineClient`` for one update of exactly one chunk, over a client that
    supports ``apply_update``: ``update_named_weights(request)`` sends the held-back start, the
    chunk and the finish as one ``apply_update`` call (issued before it returns, as a client's
    ``update_named_weights`` must be); ``versions`` is what the engines published. The sender
    runs its usual transfer against this client, so its data plane (a broadcast's vote and
    bytes) runs as it always does. Lives in the sending process for one update."""

    max_inflight_updates = 1

    def __init__(self, inner: Any, start: dict, finish: dict) -> None:
        self.inner = inner
        self.start = start
        self.finish = finish
        self.versions: list[int | None] | None = None

    def update_named_weights(self, request: dict) -> asyncio.Future:
        answer = self.inner.apply_update(self.start, [request], self.finish)

        async def done() -> None:
            self.versions = list(await answer)

        return asyncio.ensure_future(done())


async def _await_oldest(inflight: collections.deque[asyncio.Task]) -> None:
    """Wait for the oldest transfer; it leaves the window only once it ended well (a failed or
    interrupted one stays for ``_settle``). Shielded: cancelling us does not cancel it."""
    await asyncio.shield(inflight[0])
    inflight.popleft()


async def _drain(inflight: collections.deque[asyncio.Task]) -> None:
    while inflight:
        await _await_oldest(inflight)


def _any_failed(tasks: Iterable[asyncio.Task]) -> bool:
    return any(t.done() and not t.cancelled() and t.exception() is not None for t in tasks)


async def aiter_chunks(chunks: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[Any]:
    """``chunks`` (an iterable or an async iterable) as an async iterator."""
    if hasattr(chunks, "__aiter__"):
        async for c in chunks:  # type: ignore[union-attr]
            yield c
    else:
        for c in chunks:  # type: ignore[union-attr]
            yield c
