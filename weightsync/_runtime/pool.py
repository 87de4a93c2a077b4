"""The sender's reusable transfer buffers for ``packed_cuda_ipc``.

``BufferPool(num_buffers)``: slots handed out by ``acquire(nbytes, device)`` and returned by
``release``; a slot is a POSIX shm segment (CPU) or a CUDA allocation with its IPC handle
encoded once (GPU), regrown (new name / new handle) only when a chunk is bigger than it. Lives
in the training process; ``acquire`` may block (in the sender's packing thread) until the
engines finished reading an earlier chunk.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from weightsync._runtime.shm import Segment
from weightsync.errors import WeightSyncTimeout
from weightsync.types import IpcBufferHandle

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _CudaSlot:
    """A device buffer plus its IPC handle (encoded once per allocation)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        import torch

        from weightsync._runtime.cuda_handles import encode

        self.capacity = int(nbytes)
        self.tensor = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self.handle = encode(self.tensor)

    def describe(self, start: int, nbytes: int) -> IpcBufferHandle:
        h = self.handle
        return IpcBufferHandle(
            kind="cuda", nbytes=nbytes, handle=h.handle, offset=h.offset + start,
            alloc_nbytes=h.alloc_nbytes, device_uuid=h.device_uuid,
        )

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]


class _ShmSlot(Segment):
    def describe(self, start: int, nbytes: int) -> IpcBufferHandle:
        return IpcBufferHandle(
            kind="shm", nbytes=nbytes, name=self.name, offset=start, alloc_nbytes=self.capacity
        )


class BufferPool:
    """``num_buffers`` slots, each grown on demand; ``acquire`` blocks until one is free."""

    def __init__(self, num_buffers: int, *, timeout_s: float) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self.timeout_s = timeout_s
        self.slots: list[Any] = [None] * num_buffers
        self._free = list(range(num_buffers))
        self._cond = threading.Condition()
        self.created = 0

    def acquire(self, nbytes: int, device: Any) -> tuple[int, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=self.timeout_s):
                raise WeightSyncTimeout(
                    f"no free transfer buffer within {self.timeout_s:g}s: earlier chunks were "
                    f"never released (an engine stopped reading?)"
                )
            k = self._free.pop(0)
        slot = self.slots[k]
        want_cuda = device is not None and device.type == "cuda"
        fits = (
            slot is not None
            and slot.capacity >= nbytes
            and isinstance(slot, _CudaSlot) == want_cuda
            and (not want_cuda or slot.tensor.device == device)
        )
        if not fits:
            if slot is not None:
                slot.close()
            self.slots[k] = None
            size = _round_up(max(nbytes, 1), 1 << 20)
            try:
                slot = _CudaSlot(size, device) if want_cuda else _ShmSlot(size)
            except BaseException:
                self.release(k)
                raise
            self.slots[k] = slot
            self.created += 1
        return k, slot

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
