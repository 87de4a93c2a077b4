"""How a server starts on a GPU: which device it runs on, how vLLM starts its engine core there,
how much of the card it takes, and which dtype it serves.

Callers: ``weightsync.servers.reward`` and ``weightsync.servers.policy``, in the API-server
process, before the engine starts. Nothing here initialises CUDA in that process: the device
count and the card's memory come from NVML, as vLLM's own platform code reads them, because a
process that initialised CUDA cannot fork a child that uses it (vLLM's engine core). On a GPU the
servers start vLLM's engine core with ``spawn``, as ``vllm serve`` does, so that whatever a model
or plugin imports cannot make the fork fail either. Two servers share one card by default: the
policy server asks ``POLICY_GPU_SHARE`` of it and the reward server ``REWARD_GPU_SHARE``,
together under vLLM's own default for one server; a share that the card's free memory cannot
give is lowered to what is free when it was a default, and refused, naming the flag, when it was
asked for.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from weightsync._runtime.gpu import GpuMemory, cuda_device_count

#: ``--gpu-memory-utilization`` defaults: a policy and a reward server fit on one card together
POLICY_GPU_SHARE = 0.6
REWARD_GPU_SHARE = 0.3
#: memory left free beside the engine's share: its CUDA context and the allocator's slack
HEADROOM_BYTES = 1 << 30
#: the least an engine needs beyond its weights: activations of a profile run and a KV cache
ENGINE_OVERHEAD_BYTES = 1 << 30
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_GIB = float(1 << 30)
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


class GpuBudgetError(ValueError):
    """A server's GPU memory budget does not fit: the message names the flag to change."""


def resolve_device(device: str) -> str:
    """``cpu`` or ``cuda`` for a server's ``--device`` (``auto``: ``cuda`` when a GPU is visible).

    Args:
        device: ``auto``, ``cpu`` or ``cuda``.

    Returns:
        ``cpu`` or ``cuda``.

    Raises:
        ValueError: ``device`` is none of the three.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device != "auto":
        return device
    return "cuda" if cuda_device_count() > 0 else "cpu"


def start_engine_core_with_spawn(log: logging.Logger) -> str:
    """Have vLLM start its engine core with ``spawn``, as ``vllm serve`` does, unless the user
    chose a start method: a forked engine core fails as soon as it touches CUDA if this process
    initialised CUDA first (``Cannot re-initialize CUDA in forked subprocess``).

    Args:
        log: where the choice is said.

    Returns:
        The start method vLLM will use.
    """
    chosen = os.environ.get(START_METHOD_ENV)
    if chosen:
        log.info("vLLM's engine core starts with %s (%s, set by the caller)", chosen,
                 START_METHOD_ENV)
        return chosen
    os.environ[START_METHOD_ENV] = "spawn"
    log.info("vLLM's engine core starts with spawn, as `vllm serve` does (%s=spawn): a forked "
             "engine core cannot use CUDA once this process did", START_METHOD_ENV)
    return "spawn"


def model_bytes(model_dir: str, dtype: str | None) -> int | None:
    """The bytes of a checkpoint's tensors once served as ``dtype`` (None or ``auto``: as
    stored), from its safetensors headers; None when there is no local safetensors checkpoint."""
    from weightsync._runtime.vllm_compat import checkpoint_metadata

    meta = checkpoint_metadata(model_dir)
    if not meta:
        return None
    total = 0
    for stored, shape in meta.values():
        numel = 1
        for d in shape:
            numel *= int(d)
        size = _DTYPE_BYTES.get(dtype or "", 0) or _DTYPE_BYTES.get(stored, 2)
        total += numel * size
    return total


def fit_gpu_share(asked: float | None, *, default: float, flag: str, memory: GpuMemory | None,
                  weights_bytes: int | None, what: str) -> tuple[float, str]:
    """The share of the card (vLLM's ``gpu_memory_utilization``) a server takes.

    Args:
        asked: the share the user gave, or None for ``default``.
        default: the server's default share.
        flag: the flag that sets it, named in every message.
        memory: the card's memory (``gpu_memory``), or None when it cannot be read (then the
            share is taken as it is and vLLM checks it).
        weights_bytes: the model's weights as served (``model_bytes``), or None if unknown.
        what: the server, for messages (``policy server``).

    Returns:
        ``(share, why)``: the share, and a phrase saying how it was chosen.

    Raises:
        GpuBudgetError: the asked share is more than the card has free, or the share that fits
            cannot hold the model.
    """
    share = default if asked is None else float(asked)
    if not 0.0 < share <= 1.0:
        raise GpuBudgetError(f"{flag}: a share of the GPU's memory in (0, 1], got {share:g}")
    if memory is None:
        return share, "as asked" if asked is not None else "the default"
    usable = memory.free - HEADROOM_BYTES
    why = f"{flag} {share:g}" if asked is not None else f"the {what}'s default ({flag} {share:g})"
    if share * memory.total > usable:
        fits = max(0.0, int(usable / memory.total * 100) / 100)
        if asked is not None or fits <= 0:
            raise GpuBudgetError(
                f"{what}: {flag} {share:g} asks {share * memory.total / _GIB:.1f} GiB but "
                f"{memory.describe()}: pass {flag} {fits:g} or less, or free the card")
        why = (f"lowered from the default {default:g} to the free memory ({memory.describe()}); "
               f"{flag} sets it")
        share = fits
    need = (weights_bytes or 0) + ENGINE_OVERHEAD_BYTES
    if share * memory.total < need:
        least = min(1.0, int(need / memory.total * 100 + 1) / 100)
        raise GpuBudgetError(
            f"{what}: the model needs about {need / _GIB:.1f} GiB (weights "
            f"{(weights_bytes or 0) / _GIB:.1f} GiB + {ENGINE_OVERHEAD_BYTES / _GIB:.0f} GiB for "
            f"activations and a KV cache) but {flag} {share:g} gives "
            f"{share * memory.total / _GIB:.1f} GiB ({memory.describe()}): pass {flag} {least:g} "
            "or more on a card with that much free")
    return share, why


def served_dtype_note(model_config: Any, *, asked: str | None, device: str,
                      server_default: str | None = None) -> str:
    """What the ready line says of the dtype: the dtype served and why.

    Args:
        model_config: vLLM's ``ModelConfig`` of the running engine.
        asked: the ``--dtype`` the user gave (None or ``auto``: not given).
        device: ``cpu`` or ``cuda``.
        server_default: the dtype the server picked itself on this device when none was
            given (float32 on CPU), or None when vLLM's ``auto`` chose.

    Returns:
        e.g. ``dtype float16, cast from the checkpoint's float32 by vLLM's --dtype auto on cuda
        (--dtype float32 keeps it)``.
    """
    served = _dtype_name(getattr(model_config, "dtype", None))
    hf = getattr(model_config, "hf_config", None)
    stored = _dtype_name(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None))
    if asked and asked != "auto":
        return f"dtype {served}, as --dtype asked"
    if server_default:
        return f"dtype {served}, the server's default on {device} (--dtype sets it)"
    if not stored or stored == served:
        return f"dtype {served}, the checkpoint's"
    return (f"dtype {served}, cast from the checkpoint's {stored} by vLLM's --dtype auto on "
            f"{device} (--dtype {stored} keeps it)")


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        return ""
    return str(dtype).removeprefix("torch.")
