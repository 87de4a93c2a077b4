"""POSIX shared-memory segments for the IPC strategies' CPU path.

Sender side (the training process) creates segments, copies tensors in and sends only their
*names*; receivers (engine processes) attach by name and build tensor views over the mapping
with ``torch.frombuffer`` (no copy). Nothing is pickled.

Ownership: the creating process owns a segment and unlinks it (``close``); Python's
``resource_tracker`` also unlinks it if that process dies. An attaching process must not let
its resource tracker unlink (or warn about) segments it does not own, so ``attach_segment``
maps it directly (``AttachedSegment``) without the tracker.

- ``SizedSegmentPool``: segments reused by size across chunks and syncs (``cuda_ipc``), free
  bytes bounded.
- ``AttachedSegments``: the receiver's cache of mappings, bounded in bytes, LRU.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import uuid
from collections import OrderedDict
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

from weightsync.errors import WeightSyncError

if TYPE_CHECKING:  # pragma: no cover
    import torch

_PREFIX = "ws"


def new_segment(nbytes: int) -> shared_memory.SharedMemory:
    """Create a segment of at least one byte with a unique name (owned by this process)."""
    name = f"{_PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=max(int(nbytes), 1))
    except OSError as e:
        raise WeightSyncError(
            f"could not create a {nbytes}-byte shared-memory segment ({e}); /dev/shm may be too "
            f"small: lower bucket_size_mb or enlarge /dev/shm (docker: --shm-size)"
        ) from e


class AttachedSegment:
    """A mapping of a segment another process created; never unlinks, never tracked.

    Opened with ``shm_open`` + ``mmap`` directly: ``multiprocessing.shared_memory`` (before
    Python 3.13) registers attached segments with the resource tracker, which a spawned child
    shares with its parent, so unregistering there would also drop the owner's registration.
    """

    def __init__(self, name: str) -> None:
        import _posixshmem

        try:
            fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise WeightSyncError(
                f"shared-memory segment {name!r} does not exist: the sender released it or died"
            ) from None
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size) if self.size else None
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def close(self) -> None:
        self.buf.release()
        if self._mmap is not None:
            self._mmap.close()


def attach_segment(name: str) -> AttachedSegment:
    """Map an existing segment (created by another process) for reading and writing."""
    return AttachedSegment(name)


def as_tensor(shm: shared_memory.SharedMemory | AttachedSegment, nbytes: int | None = None) -> torch.Tensor:
    """A uint8 tensor over the mapping (shares memory; no copy)."""
    import torch

    n = shm.size if nbytes is None else nbytes
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=n)


def close_segment(shm: shared_memory.SharedMemory | AttachedSegment, *, unlink: bool) -> None:
    """Unmap (and unlink, for the owner). A lingering tensor view keeps the mapping alive: the
    segment is then unlinked now and unmapped when the view dies."""
    try:
        shm.close()
    except BufferError:
        pass  # a torch view still exports the buffer; the mmap goes when it is collected
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class _Segment:
    """A created segment with its uint8 tensor view."""

    __slots__ = ("shm", "tensor", "capacity")

    def __init__(self, nbytes: int) -> None:
        self.shm = new_segment(nbytes)
        self.capacity = int(nbytes)
        self.tensor = as_tensor(self.shm, self.capacity)

    @property
    def name(self) -> str:
        return self.shm.name

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        close_segment(self.shm, unlink=True)


class SizedSegmentPool:
    """Segments reused by size (sender side of ``cuda_ipc``'s CPU path).

    ``acquire(nbytes)`` returns a free segment of capacity in ``[nbytes, 2 * nbytes]`` or a new
    one; ``release(seg)`` returns it. At most ``max_free_bytes`` stay cached between chunks, the
    rest is unlinked. Models repeat the same shapes layer after layer, so nearly every segment is
    reused from the second chunk on.
    """

    def __init__(self, max_free_bytes: int) -> None:
        self.max_free_bytes = int(max_free_bytes)
        self._free: list[tuple[int, int, _Segment]] = []  # (capacity, seq, seg), sorted
        self._free_bytes = 0
        self._seq = 0
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self, nbytes: int) -> _Segment:
        nbytes = max(int(nbytes), 1)
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free) and self._free[i][0] <= 2 * nbytes:
                cap, _, seg = self._free.pop(i)
                self._free_bytes -= cap
                return seg
        self.created += 1
        return _Segment(nbytes)

    def release(self, seg: _Segment) -> None:
        with self._lock:
            self._seq += 1
            bisect.insort(self._free, (seg.capacity, self._seq, seg))
            self._free_bytes += seg.capacity
            while self._free_bytes > self.max_free_bytes and self._free:
                # drop the oldest-released segment
                j = min(range(len(self._free)), key=lambda k: self._free[k][1])
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


class AttachedSegments:
    """Receiver-side cache: segment name -> uint8 tensor over its mapping.

    Bounded by ``max_bytes`` (least recently used mappings are closed first, never the one just
    asked for). A segment the sender replaced (new name) ages out; its pages are freed once both
    sides have let go.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._open: OrderedDict[str, tuple[AttachedSegment, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self.attached = 0  # attach calls so far (tests check caching)

    def get(self, name: str, min_nbytes: int) -> torch.Tensor:
        hit = self._open.get(name)
        if hit is not None and hit[0].size >= min_nbytes:
            self._open.move_to_end(name)
            return hit[1]
        if hit is not None:
            self._drop(name)
        shm = attach_segment(name)
        if shm.size < min_nbytes:
            close_segment(shm, unlink=False)
            raise WeightSyncError(
                f"shared-memory segment {name!r} has {shm.size} bytes, the request needs "
                f"{min_nbytes}"
            )
        t = as_tensor(shm)
        self._open[name] = (shm, t)
        self._bytes += shm.size
        self.attached += 1
        while self._bytes > self.max_bytes and len(self._open) > 1:
            oldest = next(iter(self._open))
            self._drop(oldest)
        return t

    def _drop(self, name: str) -> None:
        shm, t = self._open.pop(name)
        del t  # drop our view first so the mapping can close now
        self._bytes -= shm.size
        close_segment(shm, unlink=False)

    def __len__(self) -> int:
        return len(self._open)

    def close(self) -> None:
        for name in list(self._open):
            self._drop(name)
