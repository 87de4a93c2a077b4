"""Packing layout: where each tensor of a chunk lives inside flat per-dtype byte buffers.

Used by both sides of the packed transports (``broadcast`` with ``packed=True`` and
``packed_cuda_ipc``). The layout is a pure function of the request's metadata (names, dtypes,
shapes in request order) and ``align_bytes``, so sender and receivers compute the same one
without shipping offsets (``broadcast``) or check the offsets they were sent
(``packed_cuda_ipc``).

Rules: tensors are grouped by dtype in order of first appearance; inside a group they keep
request order; every tensor starts at a multiple of ``max(align_bytes, itemsize)`` from its
group's start; every group starts at such a multiple inside the whole chunk buffer. Zero-size tensors
take no bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync._runtime.copy import copy_many
from weightsync.types import TensorMeta, dtype_itemsize

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_ALIGN = 256


def align_up(n: int, align: int) -> int:
    if align <= 0:
        raise ValueError(f"alignment must be > 0, got {align}")
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class DtypeGroup:
    """One flat buffer: ``nbytes`` bytes of dtype ``dtype`` starting at byte ``start`` of the
    whole chunk buffer; ``members`` are indices into the request's tensors."""

    dtype: str
    start: int
    nbytes: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class PackedLayout:
    """``group_of[i]`` / ``offsets[i]``: group and byte offset (from the group start) of tensor
    ``i``; ``total_nbytes`` is the size of one buffer that holds every group back to back."""

    metas: tuple[TensorMeta, ...]
    groups: tuple[DtypeGroup, ...]
    group_of: tuple[int, ...]
    offsets: tuple[int, ...]
    total_nbytes: int
    align_bytes: int

    def tensor_views(self, group_buffers: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Name -> view of dtype/shape into ``group_buffers[g]`` (uint8, one per group); no copy."""
        if len(group_buffers) != len(self.groups):
            raise ValueError(f"need {len(self.groups)} group buffers, got {len(group_buffers)}")
        out = {}
        for i, m in enumerate(self.metas):
            out[m.name] = view_as(group_buffers[self.group_of[i]], self.offsets[i], m)
        return out

    def split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        """The uint8 slices of one whole-chunk buffer that hold each group."""
        return [whole[g.start : g.start + g.nbytes] for g in self.groups]


def plan_layout(metas: Sequence[TensorMeta], align_bytes: int = DEFAULT_ALIGN) -> PackedLayout:
    """Compute the layout of ``metas`` (request order); see the module docstring for the rules."""
    if align_bytes <= 0 or align_bytes & (align_bytes - 1):
        raise ValueError(f"align_bytes must be a power of two > 0, got {align_bytes}")
    order: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        order.setdefault(m.dtype, []).append(i)
    group_of = [0] * len(metas)
    offsets = [0] * len(metas)
    groups = []
    start = 0
    for dtype, members in order.items():
        align = max(align_bytes, dtype_itemsize(dtype))  # a view needs itemsize alignment
        g = len(groups)
        pos = 0
        for i in members:
            n = metas[i].nbytes
            if n:
                pos = align_up(pos, align)
            group_of[i] = g
            offsets[i] = pos
            pos += n
        start = align_up(start, align)
        groups.append(DtypeGroup(dtype, start, pos, tuple(members)))
        start += pos
    return PackedLayout(
        tuple(metas), tuple(groups), tuple(group_of), tuple(offsets), start, align_bytes
    )


def view_as(buf: torch.Tensor, offset: int, meta: TensorMeta) -> torch.Tensor:
    """A view of ``meta.dtype``/``meta.shape`` over ``buf`` (uint8, 1-D) at byte ``offset``."""
    from weightsync.types import str_to_dtype

    dtype = str_to_dtype(meta.dtype)
    n = meta.nbytes
    if offset < 0 or offset + n > buf.numel():
        raise ValueError(
            f"{meta.name}: bytes [{offset}, {offset + n}) outside a buffer of {buf.numel()} bytes"
        )
    if n == 0:
        return buf.new_empty(meta.shape, dtype=dtype)
    raw = buf[offset : offset + n]
    if dtype.itemsize > 1 and (buf.storage_offset() + offset) % dtype.itemsize:
        raise ValueError(f"{meta.name}: offset {offset} is not aligned to {dtype.itemsize} bytes")
    return raw.view(dtype).view(meta.shape)


def views_into(
    raws: Sequence[torch.Tensor],
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    buffer_index: Sequence[int],
    offsets: Sequence[int],
) -> dict[str, torch.Tensor]:
    """``{name: view_as(raws[buffer_index[i]], offsets[i], meta_i)}`` for a whole request, with
    the same checks (bounds, alignment) and less per-tensor work (receivers of many small
    tensors spend most of their time here)."""
    import math

    from weightsync.types import str_to_dtype

    base = [r.storage_offset() for r in raws]
    sizes = [r.numel() for r in raws]
    out: dict[str, torch.Tensor] = {}
    for name, dt, shape, bi, off in zip(names, dtypes, shapes, buffer_index, offsets, strict=True):
        dtype = str_to_dtype(dt)
        item = dtype.itemsize
        n = math.prod(shape) * item
        raw = raws[bi]
        if off < 0 or off + n > sizes[bi]:
            raise ValueError(
                f"{name}: bytes [{off}, {off + n}) outside a buffer of {sizes[bi]} bytes"
            )
        if n == 0:
            out[name] = raw.new_empty(list(shape), dtype=dtype)
            continue
        if item > 1 and (base[bi] + off) % item:
            raise ValueError(f"{name}: offset {off} is not aligned to {item} bytes")
        out[name] = raw[off : off + n].view(dtype).view(shape)
    return out


def pack_into(
    layout: PackedLayout, tensors: Sequence[torch.Tensor], group_buffers: Sequence[torch.Tensor]
) -> None:
    """Copy ``tensors`` (request order) into their places in ``group_buffers`` (uint8)."""
    dsts, srcs = [], []
    for i, t in enumerate(tensors):
        m = layout.metas[i]
        if m.nbytes == 0:
            continue
        dsts.append(view_as(group_buffers[layout.group_of[i]], layout.offsets[i], m))
        srcs.append(t)
    copy_many(dsts, srcs)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view (or copy, if ``t`` is not contiguous) of ``t``'s bytes."""
    import torch

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
