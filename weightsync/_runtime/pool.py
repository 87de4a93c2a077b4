"""The senders' reusable transfer buffers: one pool for every strategy that packs chunks.

``BufferPool(num_buffers, shared=...)``: slots handed out by ``acquire(nbytes, device)`` and
returned by ``release``, each regrown (a new allocation; for shared slots a new name / handle)
only when a chunk is bigger than it or wants another device. Lives in the training process;
``acquire`` may block (in the sender's packing thread) until the engines finished with an earlier
chunk, and gives up with ``WeightSyncTimeout`` after ``timeout_s``.

- ``shared=False``: plain uint8 tensors on the requested device (``broadcast``'s pack buffers).
- ``shared=True``: buffers another process opens by name or handle (``packed_cuda_ipc``): a
  POSIX shm ``Segment`` on the CPU, a CUDA allocation with its IPC handle encoded once on a GPU;
  ``slot.describe(start, nbytes)`` gives the ``IpcBufferHandle`` of a byte range.

Memory is bounded by ``num_buffers`` x the largest chunk (rounded up to 1 MiB).

``SizedSegmentPool``: shm segments reused by size across chunks and syncs (``cuda_ipc``'s CPU
path: one segment per tensor, so a fixed number of slots does not fit), free bytes bounded.
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any

from weightsync._runtime.shm import Segment
from weightsync.errors import WeightSyncTimeout
from weightsync.types import IpcBufferHandle

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _TensorSlot:
    """A plain uint8 tensor on a device (not shared with other processes)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        import torch

        self.capacity = int(nbytes)
        self.tensor = torch.empty(self.capacity, dtype=torch.uint8, device=device)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]


class _CudaSlot(_TensorSlot):
    """A device buffer plus its IPC handle (encoded once per allocation)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        from weightsync._runtime.cuda_handles import encode

        super().__init__(nbytes, device)
        self.handle = encode(self.tensor)

    def describe(self, start: int, nbytes: int) -> IpcBufferHandle:
        h = self.handle
        return IpcBufferHandle(
            kind="cuda", nbytes=nbytes, handle=h.handle, offset=h.offset + start,
            alloc_nbytes=h.alloc_nbytes, device_uuid=h.device_uuid,
        )


class _ShmSlot(Segment):
    __slots__ = ()

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def describe(self, start: int, nbytes: int) -> IpcBufferHandle:
        return IpcBufferHandle(
            kind="shm", nbytes=nbytes, name=self.name, offset=start, alloc_nbytes=self.capacity
        )


class BufferPool:
    """``num_buffers`` slots, each grown on demand; ``acquire`` blocks until one is free."""

    def __init__(self, num_buffers: int, *, timeout_s: float, shared: bool) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self.timeout_s = timeout_s
        self.shared = shared
        self.slots: list[Any] = [None] * num_buffers
        self._free = list(range(num_buffers))
        self._cond = threading.Condition()
        self.created = 0

    def acquire(self, nbytes: int, device: Any) -> tuple[int, Any]:
        """-> ``(k, slot)``: a free slot of at least ``nbytes`` on ``device`` (None: the CPU);
        ``slot.tensor`` is its uint8 buffer. Give it back with ``release(k)``."""
        import torch

        device = torch.device("cpu") if device is None else torch.device(device)
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=self.timeout_s):
                raise WeightSyncTimeout(
                    f"no free transfer buffer within {self.timeout_s:g}s: earlier chunks were "
                    f"never released (an engine stopped reading?)"
                )
            k = self._free.pop(0)
        slot = self.slots[k]
        if slot is None or slot.capacity < nbytes or slot.device != device:
            if slot is not None:
                slot.close()
            self.slots[k] = None
            size = _round_up(max(nbytes, 1), 1 << 20)
            try:
                slot = self._new_slot(size, device)
            except BaseException:
                self.release(k)
                raise
            self.slots[k] = slot
            self.created += 1
        return k, slot

    def _new_slot(self, nbytes: int, device: torch.device) -> Any:
        if not self.shared:
            return _TensorSlot(nbytes, device)
        if device.type == "cuda":
            return _CudaSlot(nbytes, device)
        if device.type != "cpu":
            raise ValueError(f"shared transfer buffers live on the CPU or a CUDA GPU, not {device}")
        return _ShmSlot(nbytes)

    def release(self, k: int) -> None:
        with self._cond:
            if k not in self._free:
                self._free.append(k)
                self._cond.notify()

    @property
    def nbytes(self) -> int:
        return sum(s.capacity for s in self.slots if s is not None)

    def close(self) -> None:
        for i, s in enumerate(self.slots):
            if s is not None:
                s.close()
                self.slots[i] = None


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class SizedSegmentPool:
    """Segments reused by size (sender side of ``cuda_ipc``'s CPU path).

    ``acquire(nbytes)`` returns a free segment of capacity in ``[nbytes, 2 * nbytes]`` or a new
    one; ``release(seg)`` returns it. At most ``max_free_bytes`` (plus the largest segment seen,
    with ``room_for_largest``) stay cached between chunks, the rest is unlinked. Models repeat the same shapes layer after
    layer, so nearly every segment is reused from the second chunk on. When over the bound the
    most recently released segment goes first: a sync walks the model in the same order every
    time, so the segments released early in one sync (an embedding larger than the bucket) are
    the ones the next sync asks for first; dropping the oldest would recreate them every sync.
    """

    def __init__(self, max_free_bytes: int, *, room_for_largest: bool = False) -> None:
        self.max_free_bytes = int(max_free_bytes)
        self.room_for_largest = room_for_largest
        self._free: list[tuple[int, int, Segment]] = []  # (capacity, seq, seg), sorted
        self._free_bytes = 0
        self._seq = 0
        self._largest = 0
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self, nbytes: int) -> Segment:
        nbytes = max(int(nbytes), 1)
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free) and self._free[i][0] <= 2 * nbytes:
                cap, _, seg = self._free.pop(i)
                self._free_bytes -= cap
                return seg
        self.created += 1
        return Segment(nbytes)

    def release(self, seg: Segment) -> None:
        with self._lock:
            self._seq += 1
            bisect.insort(self._free, (seg.capacity, self._seq, seg))
            self._free_bytes += seg.capacity
            if self.room_for_largest:
                self._largest = max(self._largest, seg.capacity)
            while self._free_bytes > self.max_free_bytes + self._largest and self._free:
                # drop the most recently released segment (see the class docstring)
                j = max(range(len(self._free)), key=lambda k: self._free[k][1])
                cap, _, old = self._free.pop(j)
                self._free_bytes -= cap
                old.close()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def close(self) -> None:
        with self._lock:
            for _, _, seg in self._free:
                seg.close()
            self._free.clear()
            self._free_bytes = 0
