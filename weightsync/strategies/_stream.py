"""The streamed broadcast: one control call per update, the bytes straight into the weights.

Used by ``strategies/broadcast.py`` when ``stream: true`` (the default). The trainer announces
the whole update once (its manifest: every tensor, in the order the stream sends them) and then
broadcasts chunk after chunk as its extractor yields them; the engines validate the manifest
once, vote once and receive the whole stream inside one ``update_named_weights`` call. There is
no control round trip per chunk, no packing copy on the trainer for the large tensors, and no
receive buffer (nor the copy out of it) on the engine for tensors whose loader names where they
go.

Wire (on the broadcast group; every member derives the same sequence of collectives from the
manifest, so besides the weights only two ints per chunk cross; ``WIRE_VERSION`` 2, carried by
the request, which an engine checks before it votes):

1. **vote**: an all_reduce MIN of one int (1 = go). The sender and every receiver that accepted
   the update vote 1; an engine that refused its start votes 0 and no byte moves. While the
   vote is out, a sender whose chunks exist already (a list, a held update: the feed's
   ``early``) takes the first one and packs it, so its bytes leave as soon as the vote is go
   (an extraction waits for the vote instead: it may wait for the device). A receiver, while
   its own vote is out, reads the update's entries and, for an update of the same names as
   its last one, plans a first chunk cut as that one's was (``StreamReceiver.prepare``; header
   0 decides whether that plan is used).
2. **headers one chunk ahead**: header 0, then for each chunk ``k`` of the sender's stream the
   header of what follows it (chunk ``k + 1``'s, or the end), then chunk ``k``'s data. A header
   is ``[count, first]`` (the chunk carries manifest entries ``first .. first + count - 1``); the
   end is ``[0, chunks]``, or ``[-1, 0]`` when the sender's stream failed (the extraction
   raised, the caller cancelled): every receiver then refuses the update. So a receiver knows
   chunk ``k + 1`` before chunk ``k``'s bytes have landed and posts it while they move: the link
   never waits for a receiver's host to read a header (with the header behind its chunk, as in
   wire 1, each of a 7B update's 15 chunks waited ~2 ms for it on 2 x H100).
3. **a chunk's data**: one broadcast per *transfer* (``plan_transfers``: each tensor of at
   least ``pack_below`` bytes alone, in manifest order, then the smaller ones packed into
   buffers of at most ``pack_bytes``; both from the request), then, with checksums, one int64
   broadcast of the chunk's checksums (``weightsync.integrity``).

Receivers write a lone tensor straight into the engine tensor its loader names
(``WeightLoader.direct_target``: a contiguous view of the weight, same dtype and size) when
there is one; everything else lands in a staging buffer (grown to the largest chunk, reused)
that the loader then loads (packed small tensors, fused or sharded layouts, a copy plan's first
sync, staged updates). A receiver posts chunk ``k + 1`` before it lands chunk ``k`` (the
loader's work overlaps the next bytes; see ``StreamReceiver``), and the sender issues chunk
``k + 1`` before it waits for chunk ``k``. A receiver whose loader fails keeps receiving into
staging until the stream ends (the chunk already posted still lands in place: the update is
torn either way), so the group stays in step, and raises then. On NCCL every collective of a
chunk is issued before the first is waited for, and the host waits once per chunk; with
``grouped`` (the request's field, set from the sender's ``group_calls``) a chunk's broadcasts
are one NCCL group call, so a model of many mid-sized tensors does not pay one kernel launch
and one NCCL handshake per tensor.

Processes: ``send_stream`` runs on the sender's lane thread (the training process), fed by
``StreamFeed`` from the event loop that runs the extraction; ``StreamReceiver`` in each engine
worker, inside the endpoint's ``update_named_weights``.
"""

from __future__ import annotations

import asyncio
import operator
import queue
import time
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync._runtime import trace
from weightsync._runtime.threads import in_thread
from weightsync.errors import WeightSyncError
from weightsync.strategies._layout import align_up, as_bytes, view_as
from weightsync.types import TensorMeta, WeightChunk

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync._runtime.process_group import Group, Pending
    from weightsync.interfaces import WeightLoader

#: the stream's wire (the request's ``wire_version``; see the module docstring)
WIRE_VERSION = 2
#: tensors smaller than this are packed (the request's default ``pack_below_bytes``): one
#: broadcast for many norms, biases and small projections. On 2 x H100 (2026-11-26,
#: ``benchmarks/bench_broadcast_layouts.py``) a broadcast costs the host ~25 us to issue, the
#: copy in and out of a packed buffer ~0.7 ms per GB: qwen2-0.5b's 290 tensors took 10.3 ms as
#: one group call, 4.7 ms packed in 256 MB buffers (one flat broadcast: 2.75 ms); qwen2-7b's,
#: whose issue overlaps earlier chunks' bytes, 41.4 ms per tensor (flat 40.9) and 44.8 ms packed
#: below 64 MB (the copies cost more than the calls)
SMALL_BYTES = 16 << 20
#: the largest packed buffer (the request's default ``pack_bytes``)
PACK_BYTES = 256 << 20
#: every tensor starts at a multiple of this inside a packed or staging buffer
ALIGN = 256

END, ABORT = 0, -1  # header counts that are not a chunk


# --------------------------------------------------------------------------------------------
# what one chunk's collectives are (both sides compute it from the metadata)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One broadcast of a chunk: ``members`` (indices into the chunk's tensors) at ``offsets``
    inside a buffer of ``nbytes``. ``packed``: several small tensors in one buffer (or a lone
    small one); otherwise one tensor sent from (and received into) its own memory."""

    members: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int
    packed: bool


def plan_transfers(metas: Sequence[TensorMeta], pack_below: int = SMALL_BYTES,
                   pack_bytes: int = PACK_BYTES) -> list[Transfer]:
    """The chunk's broadcasts: every tensor of at least ``pack_below`` bytes alone (chunk
    order), then the smaller ones packed in chunk order into buffers of at most
    ``pack_bytes``. Zero-size tensors take no broadcast."""
    singles: list[Transfer] = []
    packs: list[Transfer] = []
    members: list[int] = []
    offsets: list[int] = []
    pos = 0
    for i, m in enumerate(metas):
        n = m.nbytes
        if n == 0:
            continue
        if n >= pack_below:
            singles.append(Transfer((i,), (0,), n, False))
            continue
        start = align_up(pos, ALIGN)
        if members and start + n > pack_bytes:
            packs.append(Transfer(tuple(members), tuple(offsets), pos, True))
            members, offsets, start = [], [], 0
        members.append(i)
        offsets.append(start)
        pos = start + n
    if members:
        packs.append(Transfer(tuple(members), tuple(offsets), pos, True))
    return singles + packs


# --------------------------------------------------------------------------------------------
# sender: the lane thread's side
# --------------------------------------------------------------------------------------------


@dataclass
class FeedItem:
    """A chunk handed to the lane: its tensors, where it starts in the manifest, a CUDA event
    recorded after it was produced (the lane's stream waits for it; None on the CPU) and the
    manifest's entries it was checked against (its layout, as the lane plans it)."""

    chunk: WeightChunk
    first: int
    ready: Any = None
    metas: list[TensorMeta] | None = None


#: ``StreamFeed.ready``: the extraction has not made the next item yet
NOT_READY = object()


class StreamAbort:
    """Put on the feed instead of a chunk when the sender's stream failed."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class StreamFeed:
    """Chunks from the event loop (the extraction) to the lane thread (the broadcasts), at most
    ``depth`` held at once: a chunk's slot comes back when its broadcasts completed.

    ``fill(chunks, manifest)`` (event loop) checks each chunk against the manifest (a chunk
    that does not follow it is a ``ValueError``: the caller's mistake, the group stays in
    step), hands it over and finally puts the end (None) or, when the stream fails or is
    cancelled, a ``StreamAbort``; ``get`` / ``done`` are the lane's."""

    def __init__(self, depth: int = 2, *, early: bool = False) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = asyncio.Semaphore(max(1, int(depth)))
        self._loop = asyncio.get_running_loop()
        self._voted = asyncio.Event()
        self.early = bool(early)
        self.chunks = self.tensors = self.nbytes = 0

    async def fill(self, chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk],
                   manifest: Sequence[TensorMeta]) -> None:
        from weightsync.pipeline import aiter_chunks

        index = 0
        try:
            # the extraction starts once every engine voted (all are receiving): extraction
            # code that waits for the device (an .item(), a synchronize) would otherwise wait
            # for our pending vote, whose peers need this loop to send them the request.
            # ``early``: the chunks exist already (taking them touches no device): handed over
            # at once, so the lane prepares the first one while the engines vote
            if not self.early:
                await self._voted.wait()
            async for chunk in aiter_chunks(chunks):
                expected = manifest[index : index + len(chunk)]
                if [m.name for m in expected] != list(chunk.names) or any(
                        m.shape != s or m.dtype != d for m, s, d in
                        zip(expected, chunk.shape_lists, chunk.dtype_names, strict=True)):
                    raise ValueError(
                        f"streamed update: chunk {self.chunks} carries {list(chunk.names)[:3]}... "
                        f"where the manifest announced {[m.name for m in expected][:3]}... (entry "
                        f"{index} on): the chunks must follow the manifest, same order, shapes "
                        f"and dtypes")
                await self._slots.acquire()
                self._queue.put(FeedItem(chunk, index, _record_ready(chunk), expected))
                nbytes = chunk.total_size_bytes
                trace.mark("feed.chunk", chunk=self.chunks, first=index, bytes=nbytes)
                index += len(chunk)
                self.chunks += 1
                self.tensors += len(chunk)
                self.nbytes += nbytes
            if index != len(manifest):
                raise ValueError(
                    f"streamed update: the chunks carried {index} tensors, the manifest "
                    f"announced {len(manifest)}")
        except BaseException as e:
            self._queue.put(StreamAbort(e))
            trace.mark("feed.abort", chunks=self.chunks)
            raise
        self._queue.put(None)
        trace.mark("feed.end", chunks=self.chunks)

    def get(self, timeout_s: float) -> FeedItem | StreamAbort | None:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return StreamAbort(None)

    def ready(self, timeout_s: float = 0.0) -> FeedItem | StreamAbort | None | object:
        """The next item if the extraction has made it already (or makes it within
        ``timeout_s``), else ``NOT_READY``."""
        try:
            return self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return NOT_READY

    def done(self) -> None:
        """A chunk's broadcasts completed: its slot is free (called on the lane thread)."""
        self._loop.call_soon_threadsafe(self._slots.release)

    def voted(self) -> None:
        """Every member voted go (called on the lane thread): the extraction may start."""
        self._loop.call_soon_threadsafe(self._voted.set)


def _record_ready(chunk: WeightChunk) -> Any:
    """A CUDA event after the chunk's tensors were produced on this thread's stream."""
    first = next((t for t in chunk.tensors if t.is_cuda), None)
    if first is None:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(first.device))
    return event


class Staging:
    """One growing uint8 buffer on a device, reused chunk after chunk (a chunk's collectives
    complete before the next chunk uses it), and the views of it that chunks were cut into:
    every update of one model cuts its chunks alike, so a chunk's views are made once and kept
    until the buffer is replaced (``views``; ~4.5 us of host time per tensor otherwise, on both
    sides, every update)."""

    #: the most chunk layouts kept (a 7B model streams 15 chunks into each of two buffers)
    MAX_LAYOUTS = 256

    def __init__(self, device: Any) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._views: dict[Any, Any] = {}

    def get(self, nbytes: int) -> torch.Tensor:
        import torch

        if self._buf is None or self._buf.numel() < nbytes:
            self._views.clear()  # they hold the old buffer's memory
            self._buf = None  # free the old one before the bigger one
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return self._buf[:nbytes]

    def views(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` (views of this buffer for one chunk layout, named by ``key``), made the
        first time and kept until the buffer is replaced or closed."""
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= self.MAX_LAYOUTS:
                self._views.clear()
            found = self._views[key] = build()
        return found

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    def close(self) -> None:
        self._views.clear()
        self._buf = None


@dataclass(frozen=True)
class ChunkLayout:
    """A chunk's transfers (``plan_transfers``) for one run of manifest entries (``metas``:
    the first found with them), and a number that names it in ``Staging.views`` keys (unique
    within its ``ChunkLayouts``)."""

    serial: int
    metas: list[TensorMeta]
    transfers: list[Transfer]


class ChunkLayouts:
    """Chunk layouts worked out once (both sides), by the entries a chunk carries: looked up
    first by the entries' identity, so an update whose entries are the very objects of an
    earlier one (the front door's held manifest on the sender; a layout reference's entries on
    a receiver, ``BroadcastTransferReceiver.parse_request``) finds its layout without a look
    at them (~0.5 ms of host time for an adapter's 400 tensors, every update), then by their
    names, dtypes and shapes (a manifest made anew for the same model: its layout, and the
    views cut for it, are the same)."""

    #: the most entries kept, of either kind (a 7B model streams 15 chunks)
    MAX_LAYOUTS = 256

    def __init__(self) -> None:
        self._by_ids: dict[tuple, tuple[list[TensorMeta], ChunkLayout]] = {}
        self._by_content: dict[tuple, ChunkLayout] = {}
        self._serial = 0

    def of(self, metas: list[TensorMeta], pack_below: int, pack_bytes: int) -> ChunkLayout:
        ids = (tuple(map(id, metas)), pack_below, pack_bytes)
        hit = self._by_ids.get(ids)
        if hit is not None and all(map(operator.is_, hit[0], metas)):
            return hit[1]
        content = (tuple((m.name, m.dtype, tuple(m.shape)) for m in metas), pack_below,
                   pack_bytes)
        found = self._by_content.get(content)
        if found is None:
            if len(self._by_content) >= self.MAX_LAYOUTS:
                self._by_content.clear()
            self._serial += 1
            found = self._by_content[content] = ChunkLayout(
                self._serial, list(metas), plan_transfers(metas, pack_below, pack_bytes))
        if len(self._by_ids) >= self.MAX_LAYOUTS:
            self._by_ids.clear()
        self._by_ids[ids] = (list(metas), found)  # held: their ids stay theirs
        return found


def send_stream(group: Group, feed: StreamFeed, *, checksum: bool, idle_timeout_s: float,
                packs: Sequence[Staging], grouped: bool = False, overlap: bool = True,
                pack_below: int = SMALL_BYTES, pack_bytes: int = PACK_BYTES,
                layouts: ChunkLayouts | None = None) -> bool | str:
    """The sender's whole update on the lane thread (see the module docstring): True when every
    chunk went out, ``"aborted"`` when the stream failed (the receivers were told), False when a
    receiver voted no (nothing moved). A failed collective raises (the group is out of step).

    Chunk ``k``'s data goes out after the header of what follows it, so the sender takes chunk
    ``k + 1`` from the feed before it sends chunk ``k``: it holds up to three feed slots (chunk
    ``k - 1`` in flight, ``k``, ``k + 1``). When chunk ``k + 1`` is not made yet, chunk
    ``k - 1`` is waited for and released first: an extractor that bounds the chunks alive
    (the sharded ones' ``max_live_chunks``, 2 by default) may be waiting for its memory.
    ``grouped``: each chunk's broadcasts go out as one NCCL group call (the request says so,
    and the receivers issue theirs the same way). Chunk ``k`` is issued before chunk ``k - 1``
    is waited for; it packs its small tensors (below ``pack_below`` bytes, in buffers of at
    most ``pack_bytes``) into ``packs[k % 2]`` (two buffers: the one chunk ``k + 2`` reuses is
    free by then), and its feed slot comes back once it completed. ``overlap`` False: each
    chunk is waited for before the next one's data is issued
    (``BroadcastConfig.overlap_chunks``). ``layouts``: the sender's chunk layouts, kept from
    one update to the next (a new cache if None)."""
    layouts = layouts if layouts is not None else ChunkLayouts()
    with group.on_device():
        vote = group.start_all_reduce_min(1)
        item, early = _while_voting(group, feed, vote, packs[0], checksum=checksum,
                                    pack_below=pack_below, pack_bytes=pack_bytes,
                                    layouts=layouts)
        if group.finish_all_reduce_min(vote) == 0:
            trace.mark("lane.vote", go=False)
            return False
        trace.mark("lane.vote", go=True)
        feed.voted()
        if item is NOT_READY:
            item = feed.get(idle_timeout_s)
        pending = _start_header(group, item, 0)  # header 0
        chunks = 0
        prev: list[Pending] | None = None  # the chunk before: issued, not waited for
        while isinstance(item, FeedItem):
            nxt = feed.ready()
            if nxt is NOT_READY:
                # the extraction may be waiting for memory that chunk k - 1 still holds (a
                # sharded extractor keeps at most max_live_chunks alive): let it go first
                if prev is not None:
                    group.finish_all(prev)
                    trace.mark("lane.chunk.done", chunk=chunks - 1)
                    feed.done()
                    prev = None
                nxt = feed.get(idle_timeout_s)
            pending += _start_header(group, nxt, chunks + 1)  # what follows chunk k
            trace.mark("lane.chunk.begin", chunk=chunks)
            if early is not None:  # chunk 0, prepared while the vote was out
                bufs, early = early, None
            else:
                bufs = _prepare_chunk(group, item, packs[chunks % 2], checksum=checksum,
                                      pack_below=pack_below, pack_bytes=pack_bytes,
                                      layouts=layouts)
            pending += group.start_broadcasts(bufs, 0, grouped=grouped)
            del bufs
            trace.mark("lane.chunk.end", chunk=chunks)
            if prev is not None:
                group.finish_all(prev)
                trace.mark("lane.chunk.done", chunk=chunks - 1)
                feed.done()
                prev = None
            if overlap:
                prev = pending
            else:
                group.finish_all(pending)
                trace.mark("lane.chunk.done", chunk=chunks)
                feed.done()
            pending = []
            item = nxt
            chunks += 1
        group.finish_all((prev or []) + pending)
        if prev is not None:
            trace.mark("lane.chunk.done", chunk=chunks - 1)
            feed.done()
        trace.mark("lane.end", chunks=chunks, aborted=item is not None)
        return True if item is None else "aborted"


def _while_voting(group: Group, feed: StreamFeed, vote: Pending, pack: Staging, *,
                  checksum: bool, pack_below: int, pack_bytes: int,
                  layouts: ChunkLayouts) -> tuple[Any, Any]:
    """While the vote is out: with an ``early`` feed, take the first chunk as soon as it is
    handed over and prepare it (``_prepare_chunk``: its small tensors packed, into ``pack``,
    the one chunk 0 uses), so that once every member voted go its bytes leave at once.
    -> ``(the item taken or NOT_READY, chunk 0's buffers or None)``; a chunk prepared for a
    vote that comes out no is dropped (nothing was sent)."""
    if not feed.early:
        return NOT_READY, None
    item: Any = NOT_READY
    deadline = time.monotonic() + vote.timeout.total_seconds()  # then the vote's wait raises
    while item is NOT_READY and not vote.work.is_completed() and time.monotonic() < deadline:
        item = feed.ready(200e-6)
    if not isinstance(item, FeedItem):
        return item, None
    bufs = _prepare_chunk(group, item, pack, checksum=checksum, pack_below=pack_below,
                          pack_bytes=pack_bytes, layouts=layouts)
    trace.mark("lane.chunk.early", chunk=0)
    return item, bufs


def _prepare_chunk(group: Group, item: FeedItem, pack: Staging, *, checksum: bool,
                   pack_below: int, pack_bytes: int,
                   layouts: ChunkLayouts) -> list[torch.Tensor]:
    """One chunk's buffers, in the order its broadcasts go out: its small tensors packed into
    ``pack``, the others as they are, then, with ``checksum``, its checksums. The caller
    issues them (``Group.start_broadcasts``) and drops the list: once issued, the chunk's
    tensors are held by the returned ``Pending`` s and the feed item only. The chunk's layout
    is the manifest entries the feed checked it against (``layouts``: planned once)."""
    import torch

    chunk = item.chunk
    if item.ready is not None:
        torch.cuda.current_stream(group.device).wait_event(item.ready)
    layout = layouts.of(item.metas if item.metas is not None else chunk.metas(), pack_below,
                        pack_bytes)
    transfers = layout.transfers
    places, need = buffer_places(transfers, lambda k, tr: tr.packed)
    packed = pack.get(need) if need else None
    if packed is not None:
        _pack(pack, packed, layout, places, chunk)
        trace.mark("lane.chunk.packed", bytes=need)
    bufs = []
    for tr, at in zip(transfers, places, strict=True):
        if tr.packed:
            assert packed is not None
            bufs.append(packed[at : at + tr.nbytes])
        else:
            bufs.append(_on_device(as_bytes(chunk.tensors[tr.members[0]]), group))
    if checksum:
        from weightsync.integrity import tensor_checksums

        sums = torch.tensor(tensor_checksums(chunk.tensors), dtype=torch.int64,
                            device=group.device)
        bufs.append(sums.view(torch.uint8))
    return bufs


def buffer_places(transfers: list[Transfer],
                  takes_room: Callable[[int, Transfer], bool]) -> tuple[list[int], int]:
    """Where each transfer sits in one buffer that holds every transfer ``takes_room(k, tr)``
    says needs room (aligned, in order), and that buffer's size; -1 for the others. The sender
    makes room for its packed transfers, a receiver for every transfer not received in place."""
    places, need = [], 0
    for k, tr in enumerate(transfers):
        if not takes_room(k, tr):
            places.append(-1)
            continue
        need = align_up(need, ALIGN)
        places.append(need)
        need += tr.nbytes
    return places, need


def _pack(staging: Staging, buf: torch.Tensor, layout: ChunkLayout, places: list[int],
          chunk: WeightChunk) -> None:
    """Copy the chunk's small tensors into their packed places (one batched copy per dtype; the
    destination views are the buffer's, kept for the chunk's layout)."""
    import torch

    transfers, metas = layout.transfers, layout.metas

    def build() -> list[tuple[list[Any], list[int]]]:
        by_dtype: dict[Any, tuple[list[Any], list[int]]] = {}
        for tr, at in zip(transfers, places, strict=True):
            if not tr.packed:
                continue
            for i, off in zip(tr.members, tr.offsets, strict=True):
                dst = view_as(buf, at + off, metas[i])
                ds, idx = by_dtype.setdefault(dst.dtype, ([], []))
                ds.append(dst)
                idx.append(i)
        return list(by_dtype.values())

    tensors = chunk.tensors
    for ds, idx in staging.views(("pack", layout.serial), build):
        # a source on another device is copied across by the same call (its per-pair path)
        torch._foreach_copy_(ds, [tensors[i] for i in idx])


def _start_header(group: Group, item: FeedItem | StreamAbort | None,
                  chunks: int) -> list[Pending]:
    """Broadcast the header of ``item`` (the next chunk, the end after ``chunks`` chunks, or
    the abort)."""
    import torch

    if isinstance(item, FeedItem):
        values = [len(item.chunk), item.first]
    else:
        values = [END, chunks] if item is None else [ABORT, 0]
    header = torch.tensor(values, dtype=torch.int64, device=group.device)
    started = [group.start_broadcast(header.view(torch.uint8), src=0)]
    trace.mark("lane.header", count=values[0], first=values[1])
    return started


def _on_device(b: torch.Tensor, group: Group) -> torch.Tensor:
    dev = group.device
    return b.to(dev) if dev is not None and b.device != dev else b


# --------------------------------------------------------------------------------------------
# receiver: inside the engine's update_named_weights
# --------------------------------------------------------------------------------------------


@dataclass
class ChunkPlan:
    """How a receiver takes one chunk: its entries, its transfers, the engine tensors lone
    transfers land in (by transfer index) and each other transfer's place in staging (-1: in
    place) with the staging it needs."""

    metas: list[TensorMeta]
    transfers: list[Transfer]
    targets: dict[int, Any]
    places: list[int]
    need: int
    serial: int = 0  # its ChunkLayout's


@dataclass
class Prepared:
    """What ``StreamReceiver.prepare`` did while the vote was out: the update's entries and,
    when it could guess the first chunk (``first`` entries), that chunk's plan."""

    metas: list[TensorMeta]
    first: int = 0
    chunk: ChunkPlan | None = None


@dataclass
class Posted:
    """A chunk whose broadcasts a receiver has posted and not yet landed: its number in the
    stream, its entries, where its bytes go, the collectives to finish, the staging slot it
    holds and the box its checksums arrive in."""

    number: int
    metas: list[TensorMeta]
    staged: dict[str, Any]
    direct: dict[str, Any]
    pending: list[Any]
    slot: int
    box: Any = None


class StreamReceiver:
    """Receives one streamed update into ``sink`` (the endpoint's ``UpdateSink``): lone tensors
    into their ``direct_target`` when the sink gives one, the rest into a staging buffer and
    then ``sink.load_weights``. ``header_timeout_s``: how long to wait for the sender's next
    chunk (its extraction runs meanwhile).

    Chunk ``k + 1`` is posted before chunk ``k`` is landed (its staged tensors loaded), so the
    loader's work overlaps the next chunk's bytes; the two use the two staging buffers in turn
    (``staging``, ``spare``). A chunk that needs more than ``OVERLAP_STAGING`` bytes of staging
    (a first update, before the loader knew where tensors go, stages whole chunks) waits until
    the chunk before it landed and uses ``staging``, so the engine never holds two large
    buffers. A buffer is kept between updates unless it is more than four times what the last
    update needed. ``overlap`` False: each chunk lands before the next is posted."""

    #: the most staging a chunk may need and still be posted while the one before it lands
    OVERLAP_STAGING = 128 << 20

    def __init__(self, group: Group, staging: Staging, *, header_timeout_s: float,
                 overlap: bool = True) -> None:
        self.group = group
        self.overlap = overlap
        self.staging = staging
        self.spare = Staging(staging.device)
        self.header_timeout_s = header_timeout_s
        self.direct = 0  # tensors written straight into the weights (cumulative)
        self.largest = 0
        # the last update's names and its first header's count: an update of the same names
        # is expected to cut its first chunk alike (``prepare``)
        self._last_first: tuple[list[str], int] | None = None
        self.layouts = ChunkLayouts()

    def prepare(self, request: Any, sink: WeightLoader,
                metas: list[TensorMeta] | None = None) -> Prepared:
        """The work that does not wait for the sender, done while the vote is out (the caller
        runs it on the engine's thread between issuing its vote and waiting for it): the
        update's entries (``metas`` when the caller holds them decoded: the entries of a layout
        it keeps, the same objects every update, so their chunks' plans are kept too) and,
        when the last update had the same names, the receive plan of a first chunk cut as that
        one's was (checked against the real header before use)."""
        metas = request.metas() if metas is None else metas
        trace.mark("recv.metas", tensors=len(metas))
        last, first = self._last_first or (None, 0)
        if last is None or last != request.names or not 0 < first <= len(metas):
            return Prepared(metas)
        pack = (int(request.pack_below_bytes), int(request.pack_bytes))
        chunk = self._plan(metas[:first], pack, sink, None, self.layouts)
        trace.mark("recv.chunk.planned", chunk=0, tensors=first)
        return Prepared(metas, first, chunk)

    async def run(self, request: Any, sink: WeightLoader, prepared: Prepared | None = None) -> None:
        if prepared is None:
            prepared = self.prepare(request, sink)
        self.largest = 0  # the most staging one chunk of this update needed
        try:
            await self._run(request, sink, prepared)
        finally:
            trace.mark("recv.end")
            for buf in (self.staging, self.spare):
                if buf.nbytes > 4 * max(self.largest, 1 << 20):
                    buf.close()  # a first update staged everything; later ones need little

    def close(self) -> None:
        self.staging.close()
        self.spare.close()

    async def _run(self, request: Any, sink: WeightLoader, prepared: Prepared) -> None:
        metas = prepared.metas
        index = chunks = 0
        failure: BaseException | None = None
        held: Posted | None = None  # posted, not landed yet
        checksum = request.checksums is not None
        grouped = bool(getattr(request, "grouped", False))
        pack = (int(request.pack_below_bytes), int(request.pack_bytes))
        header = await in_thread(self._wait_header, await in_thread(self._post_header))
        if header[1] == 0 and header[0] > 0:
            self._last_first = (list(request.names), header[0])
        while True:
            count, first = header
            if count in (END, ABORT) and held is not None:
                failure = await self._land_posted(sink, held, failure, last=count == END)
                held = None
            if count == END:
                if first != chunks or index != len(metas):
                    raise WeightSyncError(
                        f"streamed update {request.update_id}: the sender ended after {first} "
                        f"chunk(s) and {index} of {len(metas)} tensors")
                break
            if count == ABORT:
                raise WeightSyncError(
                    f"update {request.update_id}: the sender aborted its stream after {chunks} "
                    f"chunk(s) (its extraction failed or it was cancelled); the update is refused"
                ) from failure
            if first != index or count < 0 or index + count > len(metas):
                raise WeightSyncError(
                    f"streamed update {request.update_id}: header [{count}, {first}] after "
                    f"{index} of {len(metas)} tensors: sender and engine are out of step")
            if chunks == 0 and prepared.chunk is not None and count == prepared.first:
                plan = prepared.chunk  # cut while the vote was out, as the header says
            else:
                plan = self._plan(metas[index : index + count], pack, sink, failure,
                                  self.layouts)
            if held is not None and plan.need > self.OVERLAP_STAGING:
                failure = await self._land_posted(sink, held, failure)  # no second large buffer
                held = None
            slot = 0 if held is None else 1 - held.slot
            # the next header, then this chunk's data: the order the sender issues them in
            trace.mark("recv.chunk.post.begin", chunk=chunks, direct=len(plan.targets),
                       staged=plan.need)
            after, posted = await in_thread(self._post_chunk, chunks, plan, slot, checksum,
                                            grouped)
            trace.mark("recv.chunk.post.end", chunk=chunks)
            if held is not None:
                failure = await self._land_posted(sink, held, failure)  # overlaps `posted`'s bytes
                held = None
            if self.overlap:
                held = posted
            else:
                failure = await self._land_posted(sink, posted, failure)
            index += count
            chunks += 1
            header = await in_thread(self._wait_header, after)
        if failure is not None:
            raise failure

    async def _land_posted(self, sink: Any, posted: Posted,
                           failure: BaseException | None, *, last: bool = False
                           ) -> BaseException | None:
        """Wait for ``posted``'s collectives, then hand it to the sink unless an earlier chunk
        failed; -> the update's failure so far (a loader's failure is kept, not raised: the
        receiver goes on receiving so the group stays in step). ``last``: the update's last
        chunk (the sender's end came): its staged views are lent (``load_borrowed``), since no
        later chunk of this update writes into its staging and the next update waits for
        this call to return."""
        sums = await in_thread(self._finish, posted)
        if failure is not None:
            return failure
        trace.mark("recv.land.begin", chunk=posted.number)
        try:
            await _land(sink, posted.number, posted.metas, posted.staged, posted.direct, sums,
                        lend=last)
            self.direct += len(posted.direct)
        except BaseException as e:
            return e
        return None

    def _finish(self, posted: Posted) -> list[int] | None:
        group = self.group
        with group.on_device():
            group.finish_all(posted.pending)
            sums = None if posted.box is None else [int(x) for x in posted.box.tolist()]
        trace.mark("recv.finish", chunk=posted.number)
        return sums

    def _post_header(self) -> tuple[torch.Tensor, list[Any]]:
        """Post the receive of the sender's next header (gloo: received here; it may wait up to
        ``header_timeout_s`` for the sender's extraction)."""
        import torch

        group = self.group
        with group.on_device():
            header = torch.empty(2, dtype=torch.int64, device=group.device)
            pending = [group.start_broadcast(header.view(torch.uint8), src=0,
                                             timeout_s=self.header_timeout_s)]
        trace.mark("recv.header.posted")
        return header, pending

    def _wait_header(self, posted: tuple[torch.Tensor, list[Any]]) -> tuple[int, int]:
        header, pending = posted
        group = self.group
        with group.on_device():
            group.finish_all(pending)
            count, first = header.tolist()
        trace.mark("recv.header", count=count, first=first)
        return int(count), int(first)

    @staticmethod
    def _plan(metas: list[TensorMeta], pack: tuple[int, int], sink: Any,
              failure: BaseException | None, layouts: ChunkLayouts) -> ChunkPlan:
        """How one chunk of ``metas`` is received: its transfers (``layouts``: planned once),
        which land in place (none after a loader failure: the rest of the stream goes to
        staging) and where the others sit in staging."""
        layout = layouts.of(metas, *pack)
        transfers = layout.transfers
        targets = {} if failure is not None else _direct_targets(sink, metas, transfers)
        places, need = buffer_places(transfers, lambda k, tr, t=targets: k not in t)
        return ChunkPlan(layout.metas, transfers, targets, places, need, layout.serial)

    def _post_chunk(
        self, number: int, plan: ChunkPlan, slot: int, checksum: bool, grouped: bool,
    ) -> tuple[tuple[torch.Tensor, list[Any]], Posted]:
        """Post the receive of the next header, then every broadcast of the chunk (as one NCCL
        group call when the sender's request says ``grouped``) into its direct targets and
        staging slot ``slot``, without waiting (gloo completes them here)."""
        import torch

        metas, transfers, targets = plan.metas, plan.transfers, plan.targets
        places, need = plan.places, plan.need
        after = self._post_header()
        group = self.group
        self.largest = max(self.largest, need)
        direct: dict[str, Any] = {}
        with group.on_device():
            staging = self.staging if slot == 0 else self.spare
            buf = staging.get(need) if need else None
            parts: dict[int, Any] = {}
            staged: dict[str, Any] = {}
            if buf is not None:
                # the chunk's layout and where its transfers sit name its views of the buffer
                parts, staged = staging.views(
                    ("recv", plan.serial, tuple(places)),
                    lambda: _staged_views(buf, transfers, places, metas))
            trace.mark("recv.chunk.views")
            bufs = []
            for k, tr in enumerate(transfers):
                if places[k] < 0:
                    dst = targets[k]
                    direct[metas[tr.members[0]].name] = dst
                    bufs.append(as_bytes(dst))
                else:
                    bufs.append(parts[k])
            box = None
            if checksum:
                box = torch.empty(len(metas), dtype=torch.int64, device=group.device)
                bufs.append(box.view(torch.uint8))
            pending = group.start_broadcasts(bufs, 0, grouped=grouped)
        return after, Posted(number, metas, staged, direct, pending, slot, box)


def _staged_views(buf: torch.Tensor, transfers: list[Transfer], places: list[int],
                  metas: list[TensorMeta]) -> tuple[dict[int, Any], dict[str, Any]]:
    """The staging buffer cut for one chunk: each staged transfer's bytes (by transfer index)
    and each staged tensor's view (by name)."""
    parts: dict[int, Any] = {}
    views: dict[str, Any] = {}
    for k, tr in enumerate(transfers):
        at = places[k]
        if at < 0:
            continue
        part = parts[k] = buf[at : at + tr.nbytes]
        for i, off in zip(tr.members, tr.offsets, strict=True):
            views[metas[i].name] = view_as(part, off, metas[i])
    return parts, views


def _direct_targets(sink: Any, metas: list[TensorMeta], transfers: list[Transfer]) -> dict[int, Any]:
    """Transfer index -> the engine tensor a lone tensor may be received into."""
    find: Callable[[TensorMeta], Any] | None = getattr(sink, "direct_target", None)
    if find is None:
        return {}
    out = {}
    for k, tr in enumerate(transfers):
        if not tr.packed:
            dst = find(metas[tr.members[0]])
            if dst is not None:
                out[k] = dst
    return out


async def _land(sink: Any, index: int, metas: list[TensorMeta], staged: dict[str, Any],
                direct: dict[str, Any], sums: list[int] | None, *, lend: bool = False) -> None:
    """Hand chunk ``index`` of the stream to the sink: checksums first, then what landed in
    place, then the staged tensors to the loader: ``staged`` itself when ``lend`` (the views
    kept for the chunk's layout, the same dict every update: a loader that keeps lent views
    knows it again), else a dict of its own."""
    if sums is not None:
        sink.expect_checksums([m.name for m in metas], sums, chunk=index)
        trace.mark("recv.checksums", chunk=index)
    if direct:
        await sink.landed_in_place(direct)
        trace.mark("recv.in_place", chunk=index, tensors=len(direct))
    if staged:
        if lend:
            await sink.load_borrowed(staged)
        else:
            await sink.load_weights(dict(staged))
        trace.mark("recv.load", chunk=index, tensors=len(staged), lent=lend)
