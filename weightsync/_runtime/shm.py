"""POSIX shared-memory segments for the IPC strategies' CPU path.

Sender side (the training process) creates segments, copies tensors in and sends only their
*names*; receivers (engine processes) attach by name and build tensor views over the mapping
with ``torch.frombuffer`` (no copy). Nothing is pickled.

Ownership: the creating process owns a segment (``create_mapped``) and unlinks it (``unlink``);
Python's ``resource_tracker`` also unlinks it if that process dies. An attaching process never unlinks
and never registers. Mappings are ``mmap`` objects that are never closed explicitly: they go
when the last tensor viewing them does (``Mapping``), so a late view can never dangle.

The one place that creates, maps and unlinks segments: the transfer buffers (``Segment``) and
the trainer's shared weights (``strategies.shared_weights``) both go through ``create_mapped`` /
``unlink``.

- ``AttachedSegments``: the receiver's cache of mappings: transfer buffers bounded in bytes
  (LRU, sized from the largest segment seen), shared weights kept while the sender keeps them.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING

from weightsync.errors import WeightSyncError

if TYPE_CHECKING:  # pragma: no cover
    import torch

_PREFIX = "ws"
SHARED_PREFIX = "wsw_"  # segments of a trainer's shared weights (``share_cpu_weights``)


def create_mapped(name: str, nbytes: int, *, hint: str) -> mmap.mmap:
    """Create POSIX shm segment ``name`` of ``nbytes`` bytes (exclusive, mode 0600), map it
    read-write and register it with Python's resource tracker (so it is unlinked even if this
    process dies). The caller owns it and unlinks it with ``unlink``. On failure nothing is left
    behind and the ``WeightSyncError`` names the segment; ``hint`` says what to lower when
    /dev/shm is too small (e.g. ``"lower bucket_size_mb"``)."""
    import _posixshmem
    from multiprocessing import resource_tracker

    path = "/" + name.lstrip("/")
    nbytes = max(int(nbytes), 1)
    try:
        fd = _posixshmem.shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    except OSError as e:
        raise WeightSyncError(f"could not create shared-memory segment {name!r}: {e}") from e
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except OSError as e:
        _posixshmem.shm_unlink(path)
        raise WeightSyncError(
            f"could not size and map a {nbytes}-byte shared-memory segment {name!r} ({e}); "
            f"/dev/shm may be too small: {hint} or enlarge /dev/shm (docker: --shm-size)"
        ) from e
    finally:
        os.close(fd)
    resource_tracker.register(path, "shared_memory")
    return mm


def unlink(name: str) -> None:
    """Remove segment ``name`` that this process created (``create_mapped``); existing mappings
    stay valid. Idempotent."""
    import _posixshmem
    from multiprocessing import resource_tracker

    path = "/" + name.lstrip("/")
    try:
        _posixshmem.shm_unlink(path)
    except FileNotFoundError:
        pass
    try:
        resource_tracker.unregister(path, "shared_memory")
    except Exception:  # pragma: no cover - tracker gone at interpreter exit
        pass


class Mapping:
    """A ``mmap`` of a POSIX shm segment and a uint8 tensor over it (no copy).

    Memory safety: ``torch.frombuffer`` does not pin the buffer export, so an explicit
    ``mmap.close()`` while a tensor view is alive would leave that view dangling. We never
    close the map explicitly: ``release()`` drops our references, and the map is unmapped when
    the last tensor viewing it is garbage-collected.
    """

    def __init__(self, name: str, *, mm: mmap.mmap | None = None) -> None:
        """Attach to the existing segment ``name``, or wrap ``mm``, a map of it already made
        (``create_mapped``)."""
        self.name = name.lstrip("/")
        if mm is None:
            mm = _attach(self.name)
        self.size = len(mm) if mm is not None else 0
        self.tensor: torch.Tensor | None = _tensor_over(mm, self.size)

    def release(self) -> None:
        """Drop our view; the map goes away with the last tensor that views it."""
        self.tensor = None


def _attach(name: str) -> mmap.mmap | None:
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise WeightSyncError(
            f"shared-memory segment {name!r} does not exist: the sender released it or died"
        ) from None
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size) if size else None
    finally:
        os.close(fd)


def _tensor_over(mm: mmap.mmap | None, n: int) -> torch.Tensor:
    import torch

    if mm is None or n == 0:
        return torch.empty(0, dtype=torch.uint8)
    # the tensor keeps ``mm`` alive (frombuffer holds a reference to the buffer object)
    return torch.frombuffer(mm, dtype=torch.uint8, count=n)


def attach_segment(name: str) -> Mapping:
    """Map an existing segment (created by another process) for reading and writing.

    Not registered with Python's resource tracker (only the owner unlinks)."""
    return Mapping(name)


class Segment:
    """A transfer buffer this process created and owns: registered with the resource tracker
    (so it is unlinked even if this process dies), unlinked by ``close``."""

    __slots__ = ("mapping", "capacity", "_closed")

    def __init__(self, nbytes: int) -> None:
        name = f"{_PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        mm = create_mapped(name, nbytes, hint="lower bucket_size_mb")
        self.mapping = Mapping(name, mm=mm)
        self.capacity = int(nbytes)
        self._closed = False

    @property
    def name(self) -> str:
        return self.mapping.name

    @property
    def tensor(self) -> torch.Tensor:
        t = self.mapping.tensor
        assert t is not None, "segment already closed"
        return t[: self.capacity]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.mapping.release()
        unlink(self.name)


class AttachedSegments:
    """Receiver-side cache: segment name -> uint8 tensor over its mapping.

    Two kinds of segments:

    - **Transfer buffers** (the senders' pools): bounded by bytes, least recently used dropped
      first (their memory is unmapped once no tensor views it any more, see ``Mapping``). The
      bound is ``max(max_bytes, min_slots x the largest segment seen)``, so a pool of
      ``min_slots - 1`` slots plus one regrown slot never re-maps in steady state, however much
      larger than the bucket a chunk (an embedding) is.
    - **Shared weights** (names starting with ``SHARED_PREFIX``: the trainer's own
      parameters, see ``share_cpu_weights``): not counted against the bound (their pages are the
      trainer's, a mapping adds none) and kept across syncs for as long as the sender keeps the
      segment: ``begin_sync`` (called by receivers on each update's first chunk) drops mappings
      whose segment the sender has unlinked.

    A segment the sender replaced (new name) ages out; its pages are freed once both sides have
    let go.
    """

    def __init__(self, max_bytes: int, *, min_slots: int = 1) -> None:
        self.max_bytes = int(max_bytes)
        self.min_slots = max(int(min_slots), 1)
        self._open: OrderedDict[str, Mapping] = OrderedDict()
        self._pinned: dict[str, Mapping] = {}
        self._bytes = 0
        self._largest = 0
        self.attached = 0  # attach calls so far (tests check caching)
        self.dropped = 0  # mappings dropped so far (views made before may be stale)

    @property
    def bound_bytes(self) -> int:
        return max(self.max_bytes, self.min_slots * self._largest)

    def get(self, name: str, min_nbytes: int) -> torch.Tensor:
        pinned = name.startswith(SHARED_PREFIX)
        hit = self._pinned.get(name) if pinned else self._open.get(name)
        if hit is not None and hit.size >= min_nbytes:
            if not pinned:
                self._open.move_to_end(name)
            return hit.tensor  # type: ignore[return-value]
        if hit is not None:
            self._drop(name)
        m = attach_segment(name)
        if m.size < min_nbytes:
            m.release()
            raise WeightSyncError(
                f"shared-memory segment {name!r} has {m.size} bytes, the request needs "
                f"{min_nbytes}"
            )
        self.attached += 1
        t = m.tensor
        if pinned:
            self._pinned[name] = m
            return t  # type: ignore[return-value]
        self._open[name] = m
        self._bytes += m.size
        self._largest = max(self._largest, m.size)
        while self._bytes > self.bound_bytes and len(self._open) > 1:
            self._drop(next(iter(self._open)))
        return t  # type: ignore[return-value]

    def begin_sync(self) -> None:
        """Drop shared-weight mappings whose segment no longer exists (the trainer closed it,
        re-shared its model, or died). One ``shm_open`` probe per mapped segment."""
        for name in [n for n in self._pinned if not segment_exists(n)]:
            self._drop(name)

    def _drop(self, name: str) -> None:
        self.dropped += 1
        m = self._pinned.pop(name, None)
        if m is None:
            m = self._open.pop(name)
            self._bytes -= m.size
        m.release()

    @property
    def pinned(self) -> list[str]:
        return list(self._pinned)

    def __len__(self) -> int:
        return len(self._open) + len(self._pinned)

    def close(self) -> None:
        for name in [*self._open, *self._pinned]:
            self._drop(name)


def segment_exists(name: str) -> bool:
    """Whether POSIX shm segment ``name`` still exists (opened read-only and closed at once)."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # exists, but we may not open it read-only: keep the mapping
    os.close(fd)
    return True
