"""End-to-end integrity: one 64-bit checksum per tensor, computed by the sender over the tensors
it sends and by every engine over the bytes it received.

Who calls it: ``WeightTransferSender`` (in the thread that prepares a chunk, so it overlaps the
previous chunk's transfer) when the strategy has ``checksum: true``; the engine's
``weightsync.update_sink.UpdateSink`` for every chunk whose request carries ``checksums``.

The checksum of a tensor is the sum, modulo 2**64, of its bytes read as little-endian 64-bit
words (the last partial word zero-padded), as a signed int64. Why this one: it is one read pass
at memory speed on any device, exact and independent of summation order (integer addition
wraps the same way on every device and thread count), so the trainer's GPU and an engine's CPU
agree. What it catches: any change confined to one 64-bit word (every single flipped bit or
byte, a zeroed word), a truncated or shifted tensor in practice, and tensors swapped within a
chunk (each name has its own checksum). What it misses: changes to several words whose
differences cancel exactly (two words swapped inside one tensor); it guards transport bugs and
corruption, not an adversary (the control plane's token does that). Measured costs
(``docs/benchmarks.md``), both sides together: CPU 0.12-0.14 s per GB; one H100 1.3 ms per GB at
qwen2-7b plus ~40 us per tensor. More than 2% wherever the transfer itself runs at memory speed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


def tensor_checksum_device(t: torch.Tensor) -> torch.Tensor:
    """The checksum of ``t`` as a 0-d int64 tensor on ``t``'s device (no host sync).

    One reduction kernel for a tensor whose bytes are whole, aligned 64-bit words (every
    parameter of the models we move: the per-tensor Python work is what a GPU sync of a few
    hundred tensors pays for, not the read); others take the general path."""
    import torch

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes and nbytes % 8 == 0 and t.data_ptr() % 8 == 0 and t.dtype is not torch.bool:
        return t.reshape(-1).view(torch.int64).sum()
    if nbytes == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    raw = t.reshape(-1).view(torch.uint8)
    whole = nbytes // 8 * 8
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    if whole:
        main = raw[:whole]
        if main.data_ptr() % 8:  # a view at an odd offset: int64 needs 8-byte alignment
            main = main.clone()
        total = main.view(torch.int64).sum()
    if whole < nbytes:
        tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
        tail[: nbytes - whole] = raw[whole:]
        total = total + tail.view(torch.int64)[0]
    return total


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """One checksum per tensor, in order; one host transfer per device."""
    import torch

    if not tensors:
        return []
    values = [tensor_checksum_device(t) for t in tensors]
    by_device: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        by_device.setdefault(str(v.device), []).append(i)
    out = [0] * len(values)
    for idx in by_device.values():
        for i, got in zip(idx, torch.stack([values[i] for i in idx]).tolist(), strict=True):
            out[i] = int(got)
    return out


def mismatches(
    names: Sequence[str], expected: Sequence[int], received: Mapping[str, torch.Tensor]
) -> list[str]:
    """One line per tensor of ``received`` whose checksum is not the one the sender computed
    (``expected[i]`` belongs to ``names[i]``); names missing from ``received`` are not checked
    (a receiver may hand a chunk to the loader in parts)."""
    want = dict(zip(names, expected, strict=True))
    order = [n for n in received if n in want]
    got = tensor_checksums([received[n] for n in order])
    return [
        f"{n}: checksum {g & (2**64 - 1):#018x} of the received bytes, the sender's is "
        f"{want[n] & (2**64 - 1):#018x}"
        for n, g in zip(order, got, strict=True) if g != want[n]
    ]
