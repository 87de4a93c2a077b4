"""Bit-exact checks of a whole model without copying it to the host.

``tensor_checksums(named)`` computes one 64-bit checksum per tensor on the tensor's own device:
the raw bits (viewed as integers of the element size) times a position-dependent odd weight,
summed with wrap-around in int64, in blocks of ``BLOCK`` elements so the temporary memory stays
bounded (two int64 blocks, 256 MiB). Two tensors with the same checksum hold the same bits in
the same places unless a collision happens (any single changed element, swapped rows or a
shifted range changes it). A 15 GB model takes well under a second on a GPU; nothing crosses to
the host but one integer per tensor.

``expected_engine_tensors(named, packed, ...)`` turns checkpoint-format tensors (HF names, what
a trainer sends) into what a vLLM worker holds after ``load_weights``: fused layers concatenated
in ``packed_modules_mapping`` order (``qkv_proj`` <- q/k/v, ``gate_up_proj`` <- gate/up) and,
for tensor parallelism, the worker's slice (column-parallel layers and embeddings along dim 0,
row-parallel ``o_proj`` / ``down_proj`` along dim 1, 1-D norms replicated). The engine side
(``weightsync.bench.vllm_engine.BenchWorkerExtension.bench_checksums``) computes the same
checksum over each parameter, narrowed to the expected shape (vLLM pads vocabularies).

Callers: the benchmark process and the benchmark's vLLM workers; both import this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

BLOCK = 1 << 24  # elements per block (16 Mi): two int64 temporaries of 128 MiB each
_MULT = 0x9E3779B1  # odd 32-bit multiplier: position weights are a cheap integer hash of the index
_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "dense_4h_to_h")

_weights_cache: dict[Any, Any] = {}


def _position_weights(device: Any) -> torch.Tensor:
    import torch

    key = str(device)
    w = _weights_cache.get(key)
    if w is None:
        idx = torch.arange(BLOCK, dtype=torch.int64, device=device)
        w = (idx * _MULT) % (1 << 31) * 2 + 1  # odd, position dependent
        _weights_cache[key] = w
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    flat = t.detach().contiguous().reshape(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(as_int)


def tensor_checksum_device(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on ``t``'s device (no host sync)."""
    import torch

    bits = _bits(t)
    w = _position_weights(bits.device)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    n = bits.numel()
    for k, start in enumerate(range(0, n, BLOCK)):
        block = bits[start : start + BLOCK].to(torch.int64)
        part = (block * w[: block.numel()]).sum()
        total += part * (2 * k + 1) + block.numel()
    return total


def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """``{name: checksum}``; one host transfer at the end per device."""
    import torch

    names, values = [], []
    for name, t in named:
        names.append(name)
        values.append(tensor_checksum_device(t))
    if not values:
        return {}
    by_device: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        by_device.setdefault(str(v.device), []).append(i)
    out: dict[str, int] = {}
    for idx in by_device.values():
        got = torch.stack([values[i] for i in idx]).tolist()
        for i, g in zip(idx, got, strict=True):
            out[names[i]] = int(g)
    return out


def fused_name(name: str, packed: Mapping[str, list[str]]) -> tuple[str, int, int]:
    """``(engine name, index in the fused layer, members)`` of a checkpoint name:
    ``...q_proj.weight`` -> ``("...qkv_proj.weight", 0, 3)``; unfused names map to themselves."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    for fused, members in packed.items():
        if parts and parts[-1] in members:
            parts[-1] = fused
            return ".".join(parts) + "." + leaf, list(members).index(module.split(".")[-1]), len(members)
    return name, 0, 1


def tp_slice(name: str, t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The part of checkpoint tensor ``t`` that TP worker ``tp_rank`` of ``tp_size`` holds."""
    if tp_size == 1:
        return t
    module = name.rsplit(".", 1)[0]
    leaf = module.rsplit(".", 1)[-1]
    if t.dim() == 1 and ("norm" in name or leaf in _ROW_PARALLEL):
        return t  # norms and row-parallel biases are replicated
    dim = 1 if (leaf in _ROW_PARALLEL and t.dim() == 2) else 0
    if t.shape[dim] % tp_size:  # fewer KV heads than ranks and the like: replicated
        return t
    return t.chunk(tp_size, dim=dim)[tp_rank]


def expected_engine_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    packed: Mapping[str, list[str]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a vLLM worker should hold, from checkpoint-format ``named`` (see the module
    docstring). Fused members must arrive together in ``named`` order of the model (they do in
    HF order); each fused tensor is built once, then dropped."""
    import torch

    pending: dict[str, list[Any]] = {}
    for name, t in named:
        ename, idx, members = fused_name(name, packed)
        part = tp_slice(name, t, tp_rank, tp_size)
        if members == 1:
            yield ename, part
            continue
        slots = pending.setdefault(ename, [None] * members)
        slots[idx] = part
        if all(s is not None for s in slots):
            del pending[ename]
            yield ename, torch.cat(slots, dim=0)
    if pending:
        raise ValueError(f"fused layers missing members: {sorted(pending)[:5]}")
