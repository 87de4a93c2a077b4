"""Engine side of both IPC strategies: turn an ``IpcBufferHandle`` into a uint8 tensor.

Owned by one receiver (``CudaIpcTransferReceiver`` / ``PackedCudaIpcTransferReceiver``) in an engine worker.
Shared-memory segments are attached through the receiver's ``AttachedSegments`` cache; CUDA IPC
handles are opened once and cached (``CudaHandleCache``, created on the first CUDA handle so a
CPU-only engine never touches CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync._runtime.shm import AttachedSegments
from weightsync.types import IpcBufferHandle

if TYPE_CHECKING:  # pragma: no cover
    import torch


class IpcBufferOpener:
    def __init__(self, segments: AttachedSegments, *, max_cuda_handles: int | None = None) -> None:
        self.segments = segments
        self._max_cuda_handles = max_cuda_handles
        self._cuda: Any = None

    @property
    def epoch(self) -> int:
        """Changes whenever a mapping is dropped or a handle closed: views made under another
        epoch may point at memory that is gone."""
        return self.segments.dropped + (self._cuda.closed if self._cuda is not None else 0)

    def begin_sync(self) -> None:
        """Called at an update's first chunk (drops mappings of segments the sender removed)."""
        self.segments.begin_sync()

    def open(self, h: IpcBufferHandle) -> torch.Tensor:
        if h.kind == "shm":
            whole = self.segments.get(h.name, h.offset + h.nbytes)
            return whole[h.offset : h.offset + h.nbytes]
        if self._cuda is None:
            from weightsync._runtime.cuda_handles import CudaHandleCache

            kwargs = {} if self._max_cuda_handles is None else {"max_handles": self._max_cuda_handles}
            self._cuda = CudaHandleCache(**kwargs)
        return self._cuda.view(h)

    def close(self) -> None:
        self.segments.close()
        if self._cuda is not None:
            self._cuda.close()
