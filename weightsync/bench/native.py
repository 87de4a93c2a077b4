"""vLLM's own weight-transfer engine (``vllm.distributed.weight_transfer``, vLLM 0.26) driven
through its own API, as the reference rows of ``weightsync.bench.vllm_sync``.

The engine must have been started with ``weight_transfer_config={"backend": "nccl" | "ipc"}``
(``EngineSpec.native_backend``). One sync is what its RL examples do::

    llm.start_weight_update()                        # layer-wise reload begins
    llm.update_weights({"update_info": {...}})       # NCCL: concurrently with the trainer's
    <Engine>.trainer_send_weights(named, args)       #   broadcast; IPC: called per chunk by
    llm.finish_weight_update()                       #   trainer_send_weights itself

Known pitfalls, handled here:

* ``ipc_engine`` imports ``ray`` at module level. Without Ray (the GPU image has none) a stand-in
  module that only exists to be imported is put first on ``sys.path`` and ``PYTHONPATH`` before
  the engine starts (``ensure_ray_importable``); the IPC rows pass a callable ``send_mode`` so
  Ray is never used.
* IPC handles are torch reduction tuples; they reach the engine process only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set by ``prepare_native_env`` before the engine
  starts).
* The packed IPC mode refuses a tensor larger than its buffer (1 GiB by default) and the error
  leaves the engine unusable; Qwen2-7B's embedding is 1.09 GB. The packed IPC row therefore
  uses a buffer of ``max(1 GiB, largest tensor)`` and says so in its note.

Runs in the benchmark (trainer) process; GPU only (vLLM's engines are NCCL / CUDA IPC only).
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import asdict
from typing import Any

GIB = 1 << 30

_RAY_STANDIN = '''"""Stand-in so that vllm.distributed.weight_transfer.ipc_engine imports without Ray.
Written by weightsync.bench.native; any use of Ray fails."""
'''


def ensure_ray_importable() -> str | None:
    """Make ``import ray`` work in this process and in engine processes started after this
    call; returns the stand-in's directory, or None when Ray is installed."""
    try:
        import ray  # noqa: F401

        return None
    except ImportError:
        pass
    import sys

    root = tempfile.mkdtemp(prefix="ws-ray-standin-")
    os.makedirs(os.path.join(root, "ray"))
    with open(os.path.join(root, "ray", "__init__.py"), "w") as f:
        f.write(_RAY_STANDIN)
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return root


def prepare_native_env() -> None:
    """Call before starting an engine that runs vLLM's IPC backend."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    ensure_ray_importable()


def _join(t: threading.Thread, errors: list[BaseException], what: str, timeout_s: float) -> None:
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"vLLM native engine: {what} did not return within {timeout_s:g}s")
    if errors:
        raise errors[0]


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by _join
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


class NativeNcclSync:
    """The trainer side of vLLM's NCCL engine (``NCCLWeightTransferEngine``), packed mode."""

    def __init__(self, llm: Any, *, timeout_s: float = 300.0, packed: bool = True,
                 buffer_bytes: int = GIB) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        from weightsync.testing.servers import free_port

        self.llm = llm
        self.timeout_s = timeout_s
        self.packed = packed
        self.buffer_bytes = int(buffer_bytes)
        self.engine_cls = NCCLWeightTransferEngine
        world = 1 + len(llm.collective_rpc("bench_noop"))
        port = free_port()
        info = {"master_address": "127.0.0.1", "master_port": port, "world_size": world}
        t, errs = _in_thread(
            llm.init_weight_transfer_engine, {"init_info": {**info, "rank_offset": 1}}
        )
        self.group = NCCLWeightTransferEngine.trainer_init(info)
        _join(t, errs, "init_weight_transfer_engine", timeout_s)
        self.note = (f"vLLM NCCLWeightTransferEngine, packed={packed}, "
                     f"{self.buffer_bytes / GIB:g} GiB buffers x 2")

    def sync(self, named: list[tuple[str, Any]]) -> None:
        import torch

        update = {
            "names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "packed": self.packed,
            "packed_buffer_size_bytes": self.buffer_bytes,
        }
        self.llm.start_weight_update()
        t, errs = _in_thread(self.llm.update_weights, {"update_info": update})
        self.engine_cls.trainer_send_weights(
            iter(named), {"group": self.group, "packed": self.packed,
                          "packed_buffer_size_bytes": self.buffer_bytes},
        )
        torch.cuda.synchronize()
        _join(t, errs, "update_weights", self.timeout_s)
        self.llm.finish_weight_update()

    def close(self) -> None:
        self.group = None


class NativeIpcSync:
    """The trainer side of vLLM's IPC engine (``IPCWeightTransferEngine``): ``packed=False``
    sends every handle in one call; ``packed=True`` chunks through one reusable buffer."""

    def __init__(self, llm: Any, *, packed: bool = False, buffer_bytes: int = GIB,
                 largest_tensor_bytes: int = 0) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        self.llm = llm
        self.packed = packed
        self.engine_cls = IPCWeightTransferEngine
        self.buffer_bytes = max(int(buffer_bytes), int(largest_tensor_bytes))
        llm.init_weight_transfer_engine({"init_info": {}})
        self.note = "vLLM IPCWeightTransferEngine, " + (
            f"packed, one {self.buffer_bytes / GIB:.2f} GiB buffer"
            + (" (raised from 1 GiB to fit the largest tensor)" if self.buffer_bytes > buffer_bytes
               else "")
            if packed else "unpacked (one handle per tensor, one call)"
        )

    def sync(self, named: list[tuple[str, Any]]) -> None:
        llm = self.llm

        def send(update_info: Any) -> None:
            llm.update_weights({"update_info": asdict(update_info)})

        llm.start_weight_update()
        self.engine_cls.trainer_send_weights(
            iter(named), {"send_mode": send, "packed": self.packed,
                          "packed_buffer_size_bytes": self.buffer_bytes},
        )
        llm.finish_weight_update()

    def close(self) -> None:
        pass
