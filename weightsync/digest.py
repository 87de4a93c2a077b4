"""Bit-exact checks: a hash of a tensor's bytes, and of a whole state dict.

Used wherever two processes must prove they hold the same weights without shipping them: a
``LocalEngineProcess``'s ``state_digest`` call and the Ray engine actors answer with
``state_digest``; ``weightsync bench`` and the tests compare that with the sender's
``module_digest`` (``compare_digests``). Any process, any device (CUDA tensors are copied to the
CPU to hash).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any


def tensor_digest(t: Any) -> str:
    """blake2b (16 bytes, hex) of ``t``'s raw bytes in row-major order (dtype-exact)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes() if raw.numel() else b"", digest_size=16).hexdigest()


def state_digest(
    state: Mapping[str, Any], names: Iterable[str] | None = None
) -> dict[str, dict[str, Any]]:
    """``{name: {"digest", "dtype", "shape"}}`` over ``state`` (or only ``names`` of it)."""
    from weightsync.types import dtype_to_str

    keys = list(names) if names is not None else list(state)
    return {
        n: {"digest": tensor_digest(state[n]), "dtype": dtype_to_str(state[n].dtype),
            "shape": list(state[n].shape)}
        for n in keys
    }


def module_digest(module: Any) -> dict[str, dict[str, Any]]:
    """``state_digest`` of ``module.state_dict()``."""
    return state_digest(module.state_dict())


def compare_digests(
    sent: dict[str, dict[str, Any]], received: dict[str, dict[str, Any]]
) -> list[str]:
    """Names whose digest/dtype/shape differ, or that one side lacks."""
    bad = sorted(n for n in sent if received.get(n) != sent[n])
    return bad + sorted(n for n in received if n not in sent)
