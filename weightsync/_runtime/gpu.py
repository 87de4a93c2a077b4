"""GPUs seen from a process that must not initialise CUDA: how many there are and how much
memory one of them has free, read through NVML as vLLM's platform code reads them.

Callers: the servers' start-up (``weightsync.servers._gpu``) and ``weightsync demo``, in
processes that later start vLLM engine cores (a process that initialised CUDA cannot fork a
child that uses it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_GIB = float(1 << 30)


def cuda_device_count() -> int:
    """GPUs this process may use, counted without initialising CUDA (torch reads NVML before
    CUDA is initialised; it falls back to the CUDA runtime only where NVML fails).

    Returns:
        The number of visible CUDA devices; 0 on a CPU build of torch.
    """
    import torch

    if not torch.cuda._is_compiled():
        return 0
    return int(torch.cuda.device_count())


@dataclass(frozen=True)
class GpuMemory:
    """One card's memory as NVML reports it, in bytes."""

    index: int  # the card's index among the visible ones
    total: int
    free: int

    def describe(self) -> str:
        return (f"GPU {self.index}: {self.free / _GIB:.1f} of {self.total / _GIB:.1f} GiB free, "
                f"{(self.total - self.free) / _GIB:.1f} GiB held by other processes")


def gpu_memory(visible_index: int = 0) -> GpuMemory | None:
    """The memory of the ``visible_index``-th card this process sees (``CUDA_VISIBLE_DEVICES``
    applied), read through NVML without initialising CUDA; None where NVML is not available."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: the engine will say so itself
        return None
    try:
        handle = _visible_handle(nvml, visible_index)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuMemory(visible_index, int(info.total), int(info.free))
    except Exception:  # noqa: BLE001 - an entry NVML cannot map: leave the check to vLLM
        return None
    finally:
        nvml.nvmlShutdown()


def _nvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py, which vLLM's CUDA build requires

        return pynvml
    except ImportError:
        pass
    try:
        from vllm.third_party import pynvml  # type: ignore[no-redef]

        return pynvml
    except ImportError:
        return None


def _visible_handle(nvml: Any, visible_index: int) -> Any:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return nvml.nvmlDeviceGetHandleByIndex(visible_index)
    entry = [e.strip() for e in visible.split(",") if e.strip()][visible_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)
