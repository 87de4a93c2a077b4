"""Byte copies between CPU tensors, fast on a small busy machine.

Used by the packers (``_layout.pack_into``, the IPC senders) and the ``torch_module`` loader, in
whatever process runs them. Three measured problems, three rules (2-core AMD EPYC, glibc 2.36):

1. **No OpenMP barrier.** ``torch.Tensor.copy_`` splits large copies across intra-op threads and
   joins them at a barrier; when the trainer and an engine share a few cores every copy can wait
   a scheduler quantum there (packing a 255 MB chunk took 0.8 s with 2 threads on a loaded
   2-core machine against 0.11 s single-threaded). Plain copies here are ``memcpy``
   (numpy ``copyto`` on byte views, which releases the GIL).
2. **Avoid memcpy's 4K-aliasing slow case.** glibc's large ``memcpy`` drops from ~13 GB/s to
   ~4 GB/s when ``(dst - src) mod 4096`` is in ``(0, 1024)`` (the destination a little ahead of
   the source within a page: typical between a shared-memory segment and a torch allocation).
   Those copies use numpy's vectorised ``bitwise_or(src, 0)`` loop over 8-byte words instead
   (~9.5 GB/s, any alignment).
3. **Large copies in pieces on a few threads.** Copies above ``PARALLEL_MIN_BYTES`` are cut into
   ``PIECE_BYTES`` pieces that the caller's thread and up to ``COPY_THREADS - 1`` helper threads
   (from ``threads.spawn``'s daemon pool; at most that many helpers copy at once, over every
   caller) pull from a shared counter: no barrier per piece, a descheduled thread only delays
   its own piece. Fork-safe: a forked child starts with no helpers in use and a fresh pool.

Anything that is not a plain CPU-to-CPU same-dtype contiguous copy falls back to ``copy_``.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from weightsync._runtime.threads import spawn

if TYPE_CHECKING:  # pragma: no cover
    import torch

PIECE_BYTES = 16 << 20
PARALLEL_MIN_BYTES = 32 << 20
_ALIAS_WINDOW = 1024  # (dst - src) % 4096 in (0, _ALIAS_WINDOW): memcpy's slow case
_SMALL_BYTES = 64 << 10  # below this, batched per dtype through torch._foreach_copy_


def _default_threads() -> int:
    env = os.environ.get("WEIGHTSYNC_COPY_THREADS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


COPY_THREADS = _default_threads()
_helpers_busy = 0  # helper threads copying now, over every caller (at most COPY_THREADS - 1)
_helpers_lock = threading.Lock()


def _forget_helpers() -> None:
    """In a forked child the parent's helper threads do not exist."""
    global _helpers_busy, _helpers_lock
    _helpers_busy = 0
    _helpers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def _reserve_helpers(wanted: int) -> int:
    global _helpers_busy
    with _helpers_lock:
        n = max(0, min(wanted, COPY_THREADS - 1 - _helpers_busy))
        _helpers_busy += n
    return n


def _release_helpers(n: int) -> None:
    global _helpers_busy
    with _helpers_lock:
        _helpers_busy -= n


def _np_bytes(t: torch.Tensor):
    import torch

    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.numel() > 0
        and dst.is_contiguous()
        and src.is_contiguous()
        and not dst.is_conj() and not src.is_conj() and not src.is_neg()
    )


def _copy_bytes(d, s) -> None:
    """memcpy numpy uint8 ``s`` into ``d`` (same length), avoiding the 4K-aliasing slow case."""
    import numpy as np

    n = d.size
    diff = (d.ctypes.data - s.ctypes.data) % 4096
    if n >= (1 << 20) and 0 < diff < _ALIAS_WINDOW and d.ctypes.data % 8 == 0 == s.ctypes.data % 8:
        words = n // 8 * 8
        np.bitwise_or(s[:words].view(np.uint64), 0, out=d[:words].view(np.uint64))
        if words < n:
            np.copyto(d[words:], s[words:])
        return
    np.copyto(d, s)


def _run_pieces(pieces: list[tuple[Any, Any]]) -> None:
    """Copy every (dst, src) numpy piece, on the caller's thread plus free helper threads."""
    helpers = _reserve_helpers(len(pieces) - 1)
    if helpers <= 0:
        for d, s in pieces:
            _copy_bytes(d, s)
        return
    counter = itertools.count()

    def work() -> None:
        while (i := next(counter)) < len(pieces):
            d, s = pieces[i]
            _copy_bytes(d, s)

    def helper() -> None:
        try:
            work()
        finally:
            _release_helpers(1)

    futures = [spawn(helper, name="weightsync-copy") for _ in range(helpers)]
    try:
        work()
    finally:
        for f in futures:
            if f.cancel():  # a helper that never started has nothing left to do
                _release_helpers(1)
            else:
                f.result()


def _split(d, s, out: list[tuple[Any, Any]]) -> None:
    n = d.size
    if n < PARALLEL_MIN_BYTES or COPY_THREADS <= 1:
        out.append((d, s))
        return
    for a in range(0, n, PIECE_BYTES):
        out.append((d[a : a + PIECE_BYTES], s[a : a + PIECE_BYTES]))


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a barrier-free memcpy (split across a few threads when large) when
    both are contiguous CPU tensors of the same dtype and shape."""
    if _plain(dst, src):
        d, s = _np_bytes(dst), _np_bytes(src)
        if d.size < PARALLEL_MIN_BYTES:
            _copy_bytes(d, s)
        else:
            pieces: list[tuple[Any, Any]] = []
            _split(d, s, pieces)
            _run_pieces(pieces)
        return
    dst.copy_(src, non_blocking=dst.is_cuda and src.device != dst.device)


def copy_many(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``copy_into(dsts[i], srcs[i])`` for every i, with less per-tensor overhead: small plain
    CPU copies go through one ``torch._foreach_copy_`` per dtype, large ones are cut into pieces
    shared by the copy threads, the rest fall back to ``copy_into`` one by one."""
    import torch

    small: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    pieces: list[tuple[Any, Any]] = []
    other: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.is_cpu and src.is_cpu and dst.dtype == src.dtype:
            nbytes = dst.numel() * dst.element_size()
            if nbytes < _SMALL_BYTES:  # copy_ semantics, any layout: one call per dtype
                if nbytes:
                    ds, ss = small.setdefault(dst.dtype, ([], []))
                    ds.append(dst.detach())
                    ss.append(src.detach())
                continue
            if _plain(dst, src):
                _split(_np_bytes(dst), _np_bytes(src), pieces)
                continue
        if dst.numel() or src.numel():
            other.append((dst, src))
    for ds, ss in small.values():
        torch._foreach_copy_(ds, ss)
    if pieces:
        _run_pieces(pieces)
    for dst, src in other:
        copy_into(dst, src)
