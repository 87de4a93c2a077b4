"""``share_cpu_weights``: put a trainer's CPU weights in shared memory once, so that the IPC
strategies (``cuda_ipc``, ``packed_cuda_ipc``) send handles to the weights themselves instead of
copying every byte into a transfer buffer on every sync.

The CPU analogue of CUDA IPC on GPU tensors: after ``share_cpu_weights(model)`` each parameter
and buffer of ``model`` (``param.data``) is a view of a POSIX shared-memory segment that this
process owns. A sender that finds a chunk's tensor inside one of these segments
(``locate_shared``) sends ``(segment name, byte offset)``; the engine maps the segment once (its
mapping is cached across syncs) and copies straight from the trainer's memory into its own
parameters: zero copies on the sender, one on the engine. Tensors that are not inside a
registered segment (CUDA tensors, a cast to another dtype, a parameter whose ``.data`` the user
replaced, a non-contiguous tensor) silently take the normal copy path, so sharing never changes
what arrives, only how fast.

Who calls: the training process (the sending rank), once, after the model is built and before
the optimizer steps (the optimizer keeps working: it holds the same ``Parameter`` objects, and
in-place updates land in the shared memory). What must hold:

- **Sync between steps.** The engine reads the live weights while ``send_chunks`` runs; an
  optimizer step running at the same time would be read half-applied. Await the sync before the
  next step (as with CUDA IPC on GPU tensors).
- **Do not replace ``.data``** (``param.data = other``, ``model.to(...)``, ``model.half()``,
  loading a checkpoint with ``assign=True``): that tensor leaves the shared memory and is sent by
  copy again (still correct). Call ``share_cpu_weights`` again to re-share it.
- A ``Mapping`` of tensors (a state dict) is accepted; its tensor objects are re-pointed in
  place, which only helps if those are the tensors the trainer keeps using (a ``state_dict()``
  snapshot is not: pass the module).

Layout: storages (not tensors) are moved, so views and tied weights keep sharing memory; they
are packed back to back (256-byte aligned) into a few segments of about ``segment_mb`` each (a
storage larger than that gets a segment of its own). Moving costs one copy of the model, done
segment by segment (the old storage is freed as soon as nothing else holds it).

Lifetime: the process-wide registry (``locate_shared``) holds segments weakly. A segment is
unlinked (its name removed; engines drop their mappings at their next sync) when
``SharedCpuWeights.close()`` is called, when the last tensor viewing it is freed, at interpreter
exit, or by Python's resource tracker if the process dies. Unlinking never invalidates the
trainer's tensors: the mapping lives as long as they do. Engines recognise these segments by
their name prefix (``SHARED_PREFIX``) and keep them mapped across syncs while the segment exists
(``weightsync._runtime.shm.AttachedSegments``).
"""

from __future__ import annotations

import bisect
import os
import threading
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync._runtime import shm
from weightsync._runtime.shm import SHARED_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_SEGMENT_MB = 512
_ALIGN = 256


@dataclass(frozen=True)
class SharedLocation:
    """Where a tensor's ``nbytes`` bytes live: ``offset`` bytes into segment ``name`` of
    ``segment_nbytes``."""

    name: str
    offset: int
    segment_nbytes: int
    nbytes: int = 0


class _Registry:
    """Process-wide map of live shared-weight segments by address range (weak: see module doc).

    Readers use ``snapshot`` (an immutable tuple swapped under the lock on every change), so a
    lookup takes no lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segs: dict[int, tuple[int, str]] = {}  # base -> (size, name)
        self.snapshot: tuple[tuple[int, ...], tuple[tuple[int, str], ...]] = ((), ())

    def _publish(self) -> None:
        bases = tuple(sorted(self._segs))
        self.snapshot = (bases, tuple(self._segs[b] for b in bases))

    def add(self, base: int, size: int, name: str) -> None:
        with self._lock:
            self._segs[base] = (size, name)
            self._publish()

    def remove(self, name: str) -> None:
        with self._lock:
            for base, (_, n) in list(self._segs.items()):
                if n == name:
                    del self._segs[base]
            self._publish()

    def names(self) -> list[str]:
        return [n for _, n in self.snapshot[1]]


_REGISTRY = _Registry()


def locate_shared(t: torch.Tensor) -> SharedLocation | None:
    """The segment and offset holding CPU tensor ``t``'s bytes, or None (not shared, not
    contiguous, empty, or not on the CPU): then the caller copies as before."""
    return locate_many([t])[0]


def locate_many(tensors: Any) -> list[SharedLocation | None]:
    """``locate_shared`` for each tensor, with the per-tensor work kept small (senders call it
    for every tensor of every chunk)."""
    bases, segs = _REGISTRY.snapshot
    if not bases:
        return [None] * len(tensors)
    out: list[SharedLocation | None] = []
    bisect_right = bisect.bisect_right
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            out.append(None)
            continue
        nbytes = t.numel() * t.element_size()
        ptr = t.data_ptr()
        i = bisect_right(bases, ptr) - 1
        if nbytes == 0 or i < 0:
            out.append(None)
            continue
        size, name = segs[i]
        off = ptr - bases[i]
        out.append(SharedLocation(name, off, size, nbytes) if off + nbytes <= size else None)
    return out


def shared_segment_names() -> list[str]:
    """Names of this process's live shared-weight segments."""
    return _REGISTRY.names()


class _SharedSegment:
    """One segment: created, mapped, registered; ``drop`` unlinks it (idempotent, owner pid only).

    Only weak references to the ``mmap`` are kept, so the segment goes away with the tensors."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.name = f"{SHARED_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self.nbytes = int(nbytes)
        mm = shm.create_mapped(self.name, self.nbytes, hint="lower segment_mb")
        self.tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8, count=self.nbytes)
        _REGISTRY.add(self.tensor.data_ptr(), self.nbytes, self.name)
        # runs when the last tensor viewing the map is freed, on drop(), or at exit
        self._finalizer = weakref.finalize(mm, _unlink, self.name, os.getpid())
        del mm

    def drop(self) -> None:
        self._finalizer()


def _unlink(name: str, owner_pid: int) -> None:
    _REGISTRY.remove(name)
    if os.getpid() == owner_pid:  # a forked child never unlinks its parent's segments
        shm.unlink(name)


class SharedCpuWeights:
    """What ``share_cpu_weights`` returns: the segments it made and what went into them.

    ``close()`` unlinks the segments (the trainer's tensors keep working; later syncs copy again).
    Also a context manager."""

    def __init__(self, segments: list[_SharedSegment], num_tensors: int, nbytes: int,
                 skipped: list[str]) -> None:
        self._segments = segments
        self.segment_names = [s.name for s in segments]
        self.num_tensors = num_tensors  # tensors now viewing shared memory
        self.nbytes = nbytes  # bytes of storage moved
        self.skipped = skipped  # names left where they were (not CPU / not plain tensors)

    def close(self) -> None:
        for s in self._segments:
            s.drop()
        self._segments = []

    def __enter__(self) -> SharedCpuWeights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SharedCpuWeights({self.num_tensors} tensors, {self.nbytes / 1e6:.1f} MB in "
                f"{len(self.segment_names)} segments)")


def share_cpu_weights(
    model_or_state_dict: Any, *, segment_mb: float = DEFAULT_SEGMENT_MB
) -> SharedCpuWeights:
    """Move every CPU parameter and buffer of ``model_or_state_dict`` (a ``torch.nn.Module`` or
    a mapping of tensors) into shared-memory segments, in place; see the module docstring.

    Tensors already shared, on another device, empty, or not plain strided tensors (sparse,
    quantized, DTensor, ...) are left alone and listed in ``skipped`` (empty ones excepted).
    Values, dtypes, shapes, strides, ``requires_grad`` and gradients are unchanged; tensors that
    shared a storage (tied weights, views) still do.
    """
    import torch

    if segment_mb <= 0:
        raise ValueError(f"segment_mb must be > 0, got {segment_mb}")
    named = _named_tensors(model_or_state_dict)
    # group by storage: views and tied weights move together and keep sharing
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    storages: dict[tuple[int, int], Any] = {}
    seen: set[int] = set()
    skipped: list[str] = []
    for name, t in named:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not _movable(t):
            skipped.append(name)
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or locate_shared(_whole(st)) is not None:
            continue
        key = (st.data_ptr(), st.nbytes())
        groups.setdefault(key, []).append(t)
        storages[key] = st
    # plan: storages back to back, a new segment when the current one would pass segment_mb
    limit = int(segment_mb * (1 << 20))
    plans: list[list[tuple[int, tuple[int, int]]]] = [[]]
    sizes = [0]
    for key in groups:
        n = key[1]
        start = _align(sizes[-1])
        if plans[-1] and start + n > limit:
            plans.append([])
            sizes.append(0)
            start = 0
        plans[-1].append((start, key))
        sizes[-1] = start + n
    segments: list[_SharedSegment] = []
    moved = 0
    try:
        for plan, size in zip(plans, sizes, strict=True):
            if not plan:
                continue
            seg = _SharedSegment(size)
            segments.append(seg)
            whole = seg.tensor
            assert whole is not None
            dst_storage = whole.untyped_storage()
            with torch.no_grad():
                for start, key in plan:
                    st = storages.pop(key)
                    _copy_bytes(whole[start : start + key[1]], _whole(st))
                    for t in groups.pop(key):
                        item = t.element_size()
                        t.data = torch.empty(0, dtype=t.dtype).set_(
                            dst_storage, (start // item) + t.storage_offset(), t.shape, t.stride()
                        )
                        moved += 1
                    del st
            seg.tensor = None  # only the moved tensors hold the map now
    except BaseException:
        for s in segments:
            s.drop()
        raise
    return SharedCpuWeights(segments, moved, sum(sizes), skipped)


def _named_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(obj, torch.nn.Module):
        out = []
        for prefix, mod in obj.named_modules(remove_duplicate=False):
            pre = f"{prefix}." if prefix else ""
            out += [(pre + n, p) for n, p in mod._parameters.items() if p is not None]
            out += [(pre + n, b) for n, b in mod._buffers.items() if b is not None]
        return out
    if isinstance(obj, Mapping):
        bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"share_cpu_weights: state dict values must be tensors; not: {bad[:5]}")
        return [(str(k), v) for k, v in obj.items()]
    raise TypeError(
        f"share_cpu_weights needs a torch.nn.Module or a mapping of tensors, got "
        f"{type(obj).__name__}"
    )


def _movable(t: torch.Tensor) -> bool:
    import torch

    data = t.data
    return (
        type(data) is torch.Tensor
        and data.device.type == "cpu"
        and data.layout == torch.strided
        and not data.is_quantized
        and not data.is_conj()
        and not data.is_neg()
    )


def _whole(st: Any) -> torch.Tensor:
    """uint8 tensor over a whole untyped storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    from weightsync._runtime.copy import copy_into

    copy_into(dst, src)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
