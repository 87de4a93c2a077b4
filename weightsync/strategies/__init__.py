"""Transfer strategies, registered by name in ``weightsync.registry`` (the contracts they
implement: ``weightsync.interfaces``, ``docs/architecture.md``).

- ``broadcast.py``      ``broadcast``: private torch.distributed group (gloo / NCCL), packed per
                        dtype, go/no-go vote before the bulk bytes.
- ``cuda_ipc.py``       ``cuda_ipc``: one shared buffer per tensor (CUDA IPC / POSIX shm).
- ``packed_cuda_ipc.py`` ``packed_cuda_ipc``: one shared buffer per chunk from a reusable pool.

``share_cpu_weights`` (``shared_weights.py``): move a trainer's CPU weights into shared memory
once, so the IPC strategies send handles to them instead of copying (zero copy on the sender).

Private helpers of this package: ``_layout`` (packing offsets/alignment), ``_ipc_open`` (the
IPC receivers' handle opener). Machinery shared with other packages (threads, copies, shared
memory, buffer pool, CUDA handles, the private process group) is in ``weightsync._runtime``.
Nothing here is imported by ``import weightsync``.
"""

from weightsync.strategies.shared_weights import (
    SharedCpuWeights,
    locate_shared,
    share_cpu_weights,
)

__all__ = ["SharedCpuWeights", "locate_shared", "share_cpu_weights"]
