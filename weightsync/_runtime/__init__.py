"""Machinery that several weightsync packages share (private to weightsync; one of each).

- ``threads``: every helper thread: one daemon pool (``in_thread``, ``spawn``), the ordered
  ``SerialLane``, and ``LoopThread`` (the private loop of blocking ``*_sync`` twins).
- ``copy``: barrier-free CPU byte copies (``copy_into``, ``copy_many``), large ones split over a
  few helper threads from ``threads``.
- ``shm``: POSIX shared memory: creating, mapping and unlinking segments (``create_mapped``,
  ``unlink``, ``Segment``) and the receiver's mapping cache (``AttachedSegments``).
- ``pool``: the senders' reusable transfer buffers (``BufferPool``: plain for ``broadcast``,
  shared for ``packed_cuda_ipc``; ``SizedSegmentPool`` for ``cuda_ipc``).
- ``cuda_handles``: CUDA IPC handles as plain fields and the receiver's handle cache.
- ``process_group``: a private torch.distributed group (gloo / NCCL) with its own store.
- ``vllm_compat``: the one place that knows vLLM's version-specific internals.
- ``http``: the trainer-side HTTP clients' plumbing (``LoopClients``: an httpx client per event
  loop; ``error_from_response``).
- ``trace``: the opt-in timeline of a push across processes (``WEIGHTSYNC_TRACE_DIR``; read by
  ``benchmarks/trace_timeline.py``).

Modules outside weightsync must not import from here; inside weightsync, this is the one package
whose modules other packages may import although its name is private. Nothing here is imported
by ``import weightsync``.
"""
