"""``VllmControlPlane`` / ``VllmTensorCommunicator``: the reward spec's two planes over a
weightsync client of vLLM engines, on weightsync's strategies.

Who calls: a publisher on the sending training rank (``RewardModelPublisher``,
``BroadcastPolicyPublisher``, or the trainer's own code written to the spec). Both adapters are
built from the same ``client`` and share the update in progress:

* ``announce_update_batch(metadata, version, extra=)`` opens one update of the client's engines
  with ``metadata`` as its manifest: the engines check every name, dtype and shape (and the
  training mode in ``extra``) and refuse, naming every offender, before any byte moves; the
  refusal raises here (with the IPC strategies, which send a one-chunk update as one call, it
  raises at the first full bucket or at the barrier instead). ``version`` None or 0: the
  engines count on.
* ``broadcast(tensor, src)`` hands the next announced tensor to the update (its shape and dtype
  must be the announced ones, else the update is aborted and nothing is published). Tensors go
  out in buckets of the client's ``bucket_size_mb`` through its strategy sender (``broadcast``
  over gloo / NCCL, or the IPC strategies), not one collective per tensor (ours: ``flush()``
  sends what is pending at once). The caller must not change a tensor before ``barrier``
  returns.
* ``barrier()`` sends what is left and waits until every engine has loaded the whole batch and
  published it; ``finalize_update()`` closes the update and returns its ``SyncStats``.

``client``: ``VLLMRewardClient``, ``VLLMChatClient``, or anything with the same two members:
``sync_loop`` (the ``LoopThread`` its weight-sync group lives on) and the coroutine
``send_update(make_chunks, manifest, mode, version, timeout_s, *, first_tensor=None)``.
``rank`` is the sending rank of weightsync's group (0); ``src`` must be it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from weightsync.config import DEFAULT_BUCKET_MB
from weightsync.errors import WeightSyncError
from weightsync.types import TensorMeta, TrainingMode, dtype_to_str

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.types import SyncStats

_END = object()

#: the update in progress of each client, shared by the two adapters built from it
_UPDATES: weakref.WeakKeyDictionary[Any, _TwoPlaneUpdate] = weakref.WeakKeyDictionary()


class VllmControlPlane:
    """The control plane of ``client``'s engines (see the module docstring). ``timeout_s``:
    the whole update, announce to barrier."""

    def __init__(self, client: Any, *, timeout_s: float = 600.0) -> None:
        _check_client(client)
        self.client = client
        self.timeout_s = timeout_s

    def announce_update_batch(
        self, metadata: list[dict[str, Any]], version: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.client.sync_loop.run(self.announce_update_batch_async(metadata, version, extra))

    async def announce_update_batch_async(
        self, metadata: list[dict[str, Any]], version: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Coroutine twin of ``announce_update_batch``."""
        metas, mode = _parse_batch(metadata, extra)
        current = _UPDATES.get(self.client)
        if current is not None and not current.done:
            raise WeightSyncError(
                f"announce_update_batch: the update announced before ({current.received} of "
                f"{len(current.metas)} tensors broadcast) is not finalized; finish it "
                f"(barrier, finalize_update) first")
        update = _TwoPlaneUpdate(self.client, metas, version or None, mode, self.timeout_s)
        _UPDATES[self.client] = update
        await self.client.sync_loop.run_async(update.begin())

    def finalize_update(self) -> SyncStats:
        return self.client.sync_loop.run(self.finalize_update_async())

    async def finalize_update_async(self) -> SyncStats:
        """Coroutine twin of ``finalize_update``: the update's ``SyncStats``."""
        update = _current(self.client, "finalize_update")
        try:
            return await self.client.sync_loop.run_async(update.end())
        finally:
            _UPDATES.pop(self.client, None)


class VllmTensorCommunicator:
    """The data plane of ``client``'s engines (see the module docstring)."""

    def __init__(self, client: Any) -> None:
        _check_client(client)
        self.client = client

    @property
    def rank(self) -> int:
        """This process's rank in the weight-sync group: the sender, 0."""
        return 0

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        update = _current(self.client, "broadcast")
        src = self._src(src)
        if update.needs_loop(tensor):
            self.client.sync_loop.run(update.send(tensor, src))
        else:
            update.take(tensor)  # the bucket is not full yet: nothing to send

    async def broadcast_async(self, tensor: torch.Tensor, src: int) -> None:
        """Coroutine twin of ``broadcast``."""
        update = _current(self.client, "broadcast")
        await self.client.sync_loop.run_async(update.send(tensor, self._src(src)))

    def flush(self) -> None:
        """Ours: send the tensors broadcast so far now, not when the bucket is full (a
        publisher streaming an extractor's chunks keeps its chunks, hence its memory bound)."""
        self.client.sync_loop.run(_current(self.client, "flush").flush())

    async def flush_async(self) -> None:
        """Coroutine twin of ``flush``."""
        await self.client.sync_loop.run_async(_current(self.client, "flush").flush())

    def barrier(self) -> None:
        self.client.sync_loop.run(_current(self.client, "barrier").finish())

    async def barrier_async(self) -> None:
        """Coroutine twin of ``barrier``."""
        await self.client.sync_loop.run_async(_current(self.client, "barrier").finish())

    def _src(self, src: int) -> int:
        if src != self.rank:
            raise ValueError(f"broadcast: src={src}, but this process sends as rank {self.rank} "
                             f"(pass src=comm.rank)")
        return src


class _TwoPlaneUpdate:
    """One announced update: a chunk stream the client's sender consumes on its loop."""

    def __init__(self, client: Any, metas: list[TensorMeta], version: int | None,
                 mode: TrainingMode | None, timeout_s: float) -> None:
        cfg = getattr(client, "strategy_cfg", None) or {}
        self.client = client
        self.metas = metas
        self.version = version
        self.mode = mode
        self.timeout_s = timeout_s
        self.bucket_bytes = int(float(cfg.get("bucket_size_mb", DEFAULT_BUCKET_MB)) * (1 << 20))
        self.received = 0
        self.done = False
        self.stats: SyncStats | None = None
        self._names: list[str] = []
        self._tensors: list[Any] = []
        self._bytes = 0
        self._queue: asyncio.Queue | None = None
        self._asked: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._failed: BaseException | None = None

    # -- either thread --------------------------------------------------------------------------
    def _problem(self, tensor: Any) -> str:
        """Why ``tensor`` cannot be the next announced one ("" if it can)."""
        if self._failed is not None:
            return f"the update already failed: {self._failed}"
        if self.received >= len(self.metas):
            return f"{self.received + 1} tensors for a batch of {len(self.metas)} announced"
        meta = self.metas[self.received]
        shape, dtype = list(tensor.shape), dtype_to_str(tensor.dtype)
        if shape != list(meta.shape) or dtype != meta.dtype:
            return (f"tensor {self.received} ({meta.name}) was announced as {meta.dtype} "
                    f"{list(meta.shape)}, got {dtype} {shape}")
        return ""

    def needs_loop(self, tensor: Any) -> bool:
        """Taking ``tensor`` fills the bucket or fails the update: work for the client's loop."""
        if self._problem(tensor):
            return True
        return self._bytes + tensor.numel() * tensor.element_size() >= self.bucket_bytes

    def take(self, tensor: Any) -> None:
        """Add the next announced tensor to the bucket (it is not full after it)."""
        self._names.append(self.metas[self.received].name)
        self._tensors.append(tensor)
        self._bytes += tensor.numel() * tensor.element_size()
        self.received += 1

    # -- on the client's loop ------------------------------------------------------------------
    async def begin(self) -> None:
        """Start the update and wait until the engines accepted its start (a refusal raises
        here) or the sender asks for the first chunk."""
        self._queue = asyncio.Queue(maxsize=1)
        self._asked = asyncio.Event()
        stream = self._stream()
        self._task = asyncio.ensure_future(self.client.send_update(
            lambda: stream, self.metas, self.mode, self.version, self.timeout_s))
        asked = asyncio.ensure_future(self._asked.wait())
        try:
            await asyncio.wait({asked, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            asked.cancel()
        if self._task.done():
            self.done = True
            self._task.result()  # the refusal

    async def _stream(self) -> AsyncIterator[Any]:
        from weightsync.types import WeightChunk

        assert self._queue is not None and self._asked is not None
        while True:
            self._asked.set()
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            names, tensors = item
            yield WeightChunk(names, tensors)

    async def _put(self, item: Any) -> None:
        assert self._queue is not None and self._task is not None
        put = asyncio.ensure_future(self._queue.put(item))
        await asyncio.wait({put, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            self.done = True
            self._task.result()  # the update failed: its error
            raise WeightSyncError("the update ended before all announced tensors were sent")

    async def send(self, tensor: Any, src: int) -> None:
        """``broadcast`` on the client's loop: check, take, send the bucket once full."""
        problem = self._problem(tensor)
        if problem:
            await self._abort(ValueError(f"broadcast: {problem}; the update was aborted, "
                                         f"nothing published"))
        self.take(tensor)
        if self._bytes >= self.bucket_bytes:
            await self.flush()

    async def flush(self) -> None:
        if self._names:
            item = (self._names, self._tensors)
            self._names, self._tensors, self._bytes = [], [], 0
            await self._put(item)

    async def finish(self) -> None:
        """Send the rest and wait for the engines to publish the update (the barrier)."""
        assert self._task is not None
        if self._failed is not None:
            raise self._failed
        if self.received != len(self.metas):
            missing = len(self.metas) - self.received
            await self._abort(ValueError(
                f"barrier after {self.received} of {len(self.metas)} announced tensors "
                f"({missing} never broadcast, first {self.metas[self.received].name}); the "
                f"update was aborted, nothing published"))
        if not self.done:
            await self.flush()
            await self._put(_END)
        self.done = True
        self.stats = await self._task

    async def end(self) -> SyncStats:
        if self.stats is None:
            await self.finish()
        assert self.stats is not None
        return self.stats

    async def _abort(self, error: BaseException) -> None:
        """End the update unpublished (the sender closes it as failed), then raise ``error``."""
        if self._failed is None:
            self._failed = error
        if self._task is not None and not self._task.done():
            self._names, self._tensors, self._bytes = [], [], 0
            try:
                await self._put(error)  # the stream raises it in the sender: finish(ok=False)
            except BaseException:  # noqa: BLE001 - the update failed anyway; ours is the news
                pass
        self.done = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        raise error


def _check_client(client: Any) -> None:
    missing = [m for m in ("sync_loop", "send_update") if not hasattr(client, m)]
    if missing:
        raise TypeError(
            f"{type(client).__name__} cannot back the two planes: it has no {missing} (use "
            f"weightsync.reward.VLLMRewardClient or weightsync.policy.VLLMChatClient)")


def _current(client: Any, what: str) -> _TwoPlaneUpdate:
    update = _UPDATES.get(client)
    if update is None:
        raise WeightSyncError(f"{what}: no update announced; call "
                              f"announce_update_batch(metadata, version) first")
    return update


def _parse_batch(
    metadata: list[dict[str, Any]], extra: dict[str, Any] | None
) -> tuple[list[TensorMeta], TrainingMode | None]:
    if not isinstance(metadata, list) or not metadata:
        raise ValueError("metadata: a non-empty list of {name, dtype, shape}")
    metas = []
    for i, item in enumerate(metadata):
        if not isinstance(item, dict):
            raise ValueError(f"metadata[{i}]: expected {{name, dtype, shape}}, got "
                             f"{type(item).__name__}")
        metas.append(TensorMeta.from_dict({**item, "shape": list(item.get("shape", ()))}))
    extra = dict(extra or {})
    mode = extra.pop("training_mode", None)
    if extra:
        raise ValueError(f"extra: unknown field(s) {sorted(extra)}; an update carries "
                         f"training_mode")
    return metas, TrainingMode.parse(mode) if mode is not None else None
