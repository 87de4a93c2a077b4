"""weightsync's vLLM plugin: weightsync as a backend of vLLM's weight-transfer API, an
engine-core utility that flips an update between two steps, and a prefix-cache reset that
visits only the blocks holding a hash.

vLLM loads it in each of its processes, the engine core and the workers included (the
``vllm.general_plugins`` entry point ``weightsync``; installing weightsync registers it).

``register()`` first binds the engine core of a CPU engine that ``serve-policy`` or
``serve-reward`` started to its workers' cores (``weightsync._runtime.cpu_binding``: vLLM's
engine core busy-waits on its workers and otherwise takes a core its API server and clients
need). Then it registers the ``weightsync`` backend with vLLM's weight-transfer factories
(``vllm_compat.register_transfer_backend``), so an engine started with
``weight_transfer_config={"backend": "weightsync"}`` builds its workers' transfer engines from
``weightsync.loaders.vllm_transfer_engine``. Then it gives vLLM's engine core the utility that
flips an update between two steps without pausing the scheduler
(``weightsync._runtime.vllm_flip``). Then the reset: every weight update ends with a
prefix-cache reset (the cached KV of the old weights must not be hit), and vLLM's
``BlockPool.reset_prefix_cache`` drops its hash map, then resets the hash of *every* block of
the KV cache in a Python loop: 12-15 ms per update for a 0.5B model at 30 % of an H200's memory
(117k blocks), more than the update itself. Only the blocks in the hash map hold a hash (a
block gets one when it is inserted there and loses it when it is evicted from there), usually
a few after the short prompts of an RL step.

``register()`` wraps the method: while vLLM's own implementation runs, ``self.blocks`` iterates
only the blocks of the hash map (indexing still reaches every block), so every other step of
the reset stays vLLM's own (the check that no block is in use, events, metrics). Nothing is
patched when ``WEIGHTSYNC_FAST_PREFIX_RESET=0``, or when the block pool lacks what the wrapper
relies on (a dict ``cached_block_hash_to_block._cache`` and a list ``blocks``): vLLM's reset then
runs as it is.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

ENV = "WEIGHTSYNC_FAST_PREFIX_RESET"


def register() -> None:
    """The entry point vLLM calls (at most once per process, idempotent here too)."""
    from weightsync._runtime import vllm_flip
    from weightsync._runtime.cpu_binding import bind_engine_core
    from weightsync._runtime.vllm_compat import register_transfer_backend

    bind_engine_core()  # CPU engines of our servers: the engine core on its workers' cores
    register_transfer_backend()
    vllm_flip.register()
    if os.environ.get(ENV, "1") == "0":
        return
    try:
        from vllm.v1.core.block_pool import BlockPool
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it alone
        return
    original = BlockPool.reset_prefix_cache
    if getattr(original, "_weightsync_fast", False):
        return

    @functools.wraps(original)
    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        hashed = hashed_blocks(self)
        if hashed is None:
            return original(self, *args, **kwargs)
        every = self.blocks
        self.blocks = OnlyHashed(every, hashed)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.blocks = every

    reset_prefix_cache._weightsync_fast = True  # type: ignore[attr-defined]
    BlockPool.reset_prefix_cache = reset_prefix_cache


def hashed_blocks(pool: Any) -> list[Any] | None:
    """The blocks of ``pool``'s hash map (each once), or None when the pool is not laid out as
    expected."""
    cache = getattr(getattr(pool, "cached_block_hash_to_block", None), "_cache", None)
    blocks = getattr(pool, "blocks", None)
    if not isinstance(cache, dict) or not isinstance(blocks, list):
        return None
    found: dict[int, Any] = {}
    for entry in cache.values():
        for block in (entry.values() if isinstance(entry, dict) else (entry,)):
            found[id(block)] = block
    for block_id in getattr(pool, "cached_block_hashes_by_block", None) or ():
        block = blocks[block_id]
        found[id(block)] = block
    return list(found.values())


class OnlyHashed:
    """``pool.blocks`` during a reset: iterating yields the hashed blocks only; indexing and
    ``len`` are the full list's."""

    def __init__(self, every: list[Any], hashed: list[Any]) -> None:
        self.every = every
        self.hashed = hashed

    def __iter__(self) -> Iterator[Any]:
        return iter(self.hashed)

    def __getitem__(self, index: Any) -> Any:
        return self.every[index]

    def __len__(self) -> int:
        return len(self.every)
