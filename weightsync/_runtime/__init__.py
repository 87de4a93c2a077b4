"""Machinery that several weightsync packages share (private to weightsync; one of each).

- ``threads``: ``in_thread`` (a blocking call on a pooled daemon thread, awaited) and
  ``SerialLane`` (one daemon thread running jobs in submission order).
- ``copy``: barrier-free CPU byte copies (``copy_into``, ``copy_many``) on a small copy pool.
- ``shm``: POSIX shared-memory segments (``Segment``, ``SizedSegmentPool``), the receiver's
  mapping cache (``AttachedSegments``).
- ``pool``: the packed sender's reusable transfer buffers (``BufferPool``).
- ``cuda_handles``: CUDA IPC handles as plain fields and the receiver's handle cache.
- ``process_group``: a private torch.distributed group (gloo / NCCL) with its own store.
- ``vllm_compat``: the one place that knows vLLM's version-specific internals.

Modules outside weightsync must not import from here; inside weightsync, this is the one package
whose modules other packages may import although its name is private. Nothing here is imported
by ``import weightsync``.
"""
