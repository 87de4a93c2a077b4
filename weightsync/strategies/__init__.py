"""Transfer strategies (DESIGN.md section 3), registered by name in ``weightsync.registry``.

- ``broadcast.py``      ``broadcast``: private torch.distributed group (gloo / NCCL), packed per
                        dtype, go/no-go vote before the bulk bytes.
- ``cuda_ipc.py``       ``cuda_ipc``: one shared buffer per tensor (CUDA IPC / POSIX shm).
- ``packed_cuda_ipc.py`` ``packed_cuda_ipc``: one shared buffer per chunk from a reusable pool.

``share_cpu_weights`` (``shared_weights.py``): move a trainer's CPU weights into shared memory
once, so the IPC strategies send handles to them instead of copying (zero copy on the sender).

Shared helpers: ``_layout`` (packing offsets/alignment), ``_shm`` (segments, receiver cache),
``_pool`` (the packed sender's buffer pool), ``_cuda_handles`` (CUDA IPC handles as plain fields),
``_process_group`` (the private group), ``_threads`` (blocking calls off the event loop).
Nothing here is imported by ``import weightsync``.
"""

from weightsync.strategies.shared_weights import (
    SharedCpuWeights,
    locate_shared,
    share_cpu_weights,
)

__all__ = ["SharedCpuWeights", "locate_shared", "share_cpu_weights"]
