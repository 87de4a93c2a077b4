"""Shared machinery of the sharded extractors (``fsdp``, ``deepspeed``).

Who calls: every training rank of a sharded model, in lockstep. A subclass says how to read a
parameter's global shape (no communication) and how to gather one module's parameters (a
collective); this base plans the buckets from metadata, gathers bucket by bucket, keeps the
gathered tensors only on the sending rank and bounds what is alive there:

- **Plan first, from metadata.** Module groups (a module's own parameters and persistent
  buffers, each tied weight once; single tensors when ``_should_group_by_module()`` is False)
  and the buckets they fall into are computed from global shapes before anything is gathered,
  with the same packing rule as ``weightsync.pipeline.batch_by_threshold`` (whole groups, at
  most ``bucket_size_mb`` unless one group is larger; a group per bucket when
  ``_should_batch_by_threshold()`` is False). Every rank computes the
  same plan, so every rank runs the same collectives in the same order.
- **Never gather ahead.** A bucket is gathered only when the consumer asks for the next chunk,
  and (back-pressure) only once at most ``max_live_chunks - 1`` earlier chunks are still alive:
  on the sender the gathered bytes alive at once stay within ``max_live_chunks`` buckets (2 by
  default: the chunk being transferred and the one being gathered). Liveness is measured
  exactly, by finalizers on the gathered tensors' storages (``GatherMeter``).
- **Non-senders keep nothing.** They run the same collectives and drop each result at once.
- **Aborts stay in lockstep.** If the consumer stops early (an engine refused a chunk), the
  remaining buckets are still gathered and dropped when the iterator is closed, so the other
  ranks are not left waiting in a collective (``drain_on_abort``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.config import ExtractorConfig
from weightsync.extractors._design_keys import split_config
from weightsync.extractors.lora_layers import lora_merges
from weightsync.interfaces import WeightExtractor
from weightsync.naming import engine_names, is_lora_param, tied_aliases
from weightsync.types import TensorMeta, WeightChunk, as_dtype, dtype_to_str

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ShardedExtractorConfig(ExtractorConfig):
    """Fields shared by the sharded extractors.

    ``is_sender`` None means "this rank == ``src_rank``" (rank from ``rank`` or, when that is
    None, ``torch.distributed.get_rank()`` of the default group).
    """

    is_sender: bool | None = None  # type: ignore[assignment]
    src_rank: int = 0
    rank: int | None = None
    include_buffers: bool = True  # persistent buffers too (state_dict semantics, like ``hf``)
    max_live_chunks: int = 2  # gathered chunks alive at once on the sender; 0: no back-pressure
    backpressure_timeout_s: float = 60.0
    drain_on_abort: bool = True
    adapter_name: str = "default"
    name_patterns: list[str] | None = None  # only engine names matching (e.g. the head); None: all


# --------------------------------------------------------------------------------------------
# Exact accounting of gathered memory
# --------------------------------------------------------------------------------------------


class GatherMeter:
    """Bytes of gathered tensors alive right now, their peak, and how many chunks hold some.

    ``track(t, chunk)`` registers the storage of a tensor the extractor allocated; a finalizer on
    the storage removes it when the last tensor/view using it dies, wherever that happens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.gathered_bytes = 0
        self._storages: dict[int, tuple[int, int]] = {}  # id(storage) -> (nbytes, chunk)
        self._chunk_live: dict[int, int] = {}

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.gathered_bytes = 0

    def track(self, t: torch.Tensor, chunk: int) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._storages:
                return
            self._storages[key] = (nbytes, chunk)
            self._chunk_live[chunk] = self._chunk_live.get(chunk, 0) + 1
            self.live_bytes += nbytes
            self.gathered_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes, chunk = self._storages.pop(key, (0, -1))
            self.live_bytes -= nbytes
            left = self._chunk_live.get(chunk, 0) - 1
            if left > 0:
                self._chunk_live[chunk] = left
            else:
                self._chunk_live.pop(chunk, None)

    def live_chunks(self, *, excluding: int | None = None) -> int:
        with self._lock:
            return sum(1 for c in self._chunk_live if c != excluding)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"live_bytes": self.live_bytes, "peak_bytes": self.peak_bytes,
                    "gathered_bytes": self.gathered_bytes}


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass
class PlannedTensor:
    name: str  # engine name
    source: Any  # the (sharded) parameter or buffer
    shape: list[int]
    dtype: torch.dtype  # after the cast to the generator dtype
    extra: list[Any] = field(default_factory=list)  # gathered with it (LoRA A/B of a base weight)
    merge: Callable[[torch.Tensor, bool, list[torch.Tensor]], torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class PlannedGroup:
    module: str
    items: list[PlannedTensor]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


class GatheringExtractor(WeightExtractor):
    """Base of ``fsdp`` and ``deepspeed``; see the module docstring for the rules."""

    config_cls = ShardedExtractorConfig
    backend_name = "sharded"
    lockstep = True

    def __init__(self, cfg: Any = None) -> None:
        own, design = split_config(cfg, self.config_cls)
        super().__init__(own)
        #: the interface design's flags read from a trainer config (None: not given one)
        self.design_flags = design
        if design is not None:
            self._group_by_module = design.group_by_module
            self._batch_by_threshold = design.batch_by_threshold
        else:  # module groups as the config says, whole groups batched up to bucket_size_mb
            self._group_by_module = bool(getattr(self.cfg, "group_by_module", True))
            self._batch_by_threshold = True
        self.memory = GatherMeter()
        self.runs_started = 0  # extract_weights iterations that began (see ``drain``)

    # -- subclasses implement -----------------------------------------------------------------
    def _global_shape(self, t: Any) -> list[int]:
        """Global (unsharded) shape of a parameter, without communication."""
        return list(t.shape)

    def _source_dtype(self, t: Any) -> torch.dtype:
        return t.dtype

    def _gather(self, sources: list[Any], keep: bool) -> list[tuple[torch.Tensor, bool] | None]:
        """Collective on every rank: full tensors of one module's parameters, in order.

        Returns ``(tensor, fresh)`` per source (``fresh``: newly allocated, counted by the
        meter; otherwise it is the parameter's own memory) when ``keep``, else a list of None.
        A returned tensor must stay valid after this call returns.
        """
        raise NotImplementedError

    def _check_model(self, model: Any) -> None:  # noqa: B027
        """Raise a clear error for models this backend cannot extract."""

    # -- rank ------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return config_rank(self.cfg)

    def _sender_from_config(self) -> bool:
        return is_sending_rank(self.cfg)

    # -- planning (no communication) -----------------------------------------------------------
    def plan(self, model: Any, generator_dtype: Any = None) -> list[PlannedGroup]:
        """Module groups in a deterministic order, equal on every rank; no communication."""
        self._check_model(model)
        dtype = as_dtype(generator_dtype)
        entries = _named_entries(model, include_buffers=self.cfg.include_buffers)
        merges = lora_merges(model)
        if merges is not None:  # PEFT LoRA: adapters are gathered with their base and merged
            entries = [e for e in entries if not is_lora_param(e[1])]
        merges = merges or {}
        aliases = tied_aliases((n, t) for _, n, t in entries)
        mapping = engine_names(
            (n for _, n, _ in entries), adapter_name=self.cfg.adapter_name
        )
        wanted = name_filter(self.cfg.name_patterns)
        grouped = self._should_group_by_module()
        seen: set[str] = set()
        groups: list[PlannedGroup] = []
        by_module: dict[str, PlannedGroup] = {}
        for module, full, t in entries:
            kept = aliases.get(full, full)
            name = mapping.get(kept)
            if name is None or name in seen or not wanted(name):
                continue
            seen.add(name)
            src_dtype = self._source_dtype(t)
            out_dtype = dtype if (dtype is not None and src_dtype.is_floating_point) else src_dtype
            item = PlannedTensor(name, t, self._global_shape(t), out_dtype)
            if full in merges:
                item.extra, item.merge = merges[full]
            key = module if grouped else full
            group = by_module.get(key)
            if group is None:
                label = name.rsplit(".", 1)[0] if "." in name else ""
                group = by_module[key] = PlannedGroup(label, [])
                groups.append(group)
            group.items.append(item)
        return groups

    def buckets(self, groups: list[PlannedGroup]) -> list[list[PlannedGroup]]:
        """Pack whole groups into buckets of at most ``threshold_bytes()`` (``bucket_size_mb``;
        a larger group alone) when ``_should_batch_by_threshold()``, else a group per bucket."""
        if not self._should_batch_by_threshold():
            return [[g] for g in groups]
        threshold = self.threshold_bytes()
        out: list[list[PlannedGroup]] = []
        cur: list[PlannedGroup] = []
        size = 0
        for g in groups:
            if cur and size + g.nbytes > threshold:
                out.append(cur)
                cur, size = [], 0
            cur.append(g)
            size += g.nbytes
        if cur:
            out.append(cur)
        return out

    def metadata(self, model: Any, generator_dtype: Any = None) -> list[TensorMeta]:
        """Engine names, dtypes after the cast and global shapes; no gather, no collective."""
        return [
            TensorMeta(i.name, dtype_to_str(i.dtype), list(i.shape))
            for g in self.plan(model, generator_dtype)
            for i in g.items
        ]

    # -- gathering ------------------------------------------------------------------------------
    def _gather_bucket(
        self, bucket: list[PlannedGroup], index: int, keep: bool
    ) -> WeightChunk | None:
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        for group in bucket:
            sources: list[Any] = []
            starts: list[int] = []
            for item in group.items:
                starts.append(len(sources))
                sources.append(item.source)
                sources.extend(item.extra)
            got = self._gather(sources, keep)
            if not keep:
                continue
            for item, start in zip(group.items, starts, strict=True):
                pair = got[start]
                assert pair is not None
                t, fresh = pair
                t = t.detach()
                if item.merge is not None:
                    extras = [got[start + 1 + j][0] for j in range(len(item.extra))]  # type: ignore[index]
                    t, fresh = item.merge(t, fresh, extras), True
                if fresh:
                    self.memory.track(t, index)
                if t.dtype != item.dtype:
                    t = t.to(item.dtype)
                    self.memory.track(t, index)
                if list(t.shape) != item.shape:
                    raise RuntimeError(
                        f"{self.backend_name} extractor: gathered {item.name!r} has shape "
                        f"{list(t.shape)} but its metadata says {item.shape}"
                    )
                names.append(item.name)
                tensors.append(t)
            del got
        if not keep:
            return None
        labels = [g.module for g in bucket]
        label = labels[0] if len(labels) == 1 else f"{labels[0]}..{labels[-1]}"
        return WeightChunk(names, tensors, module_name=label)

    def _extract_raw_weights(
        self, model: Any, generator_dtype: Any
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Sync form (every rank, lockstep): one ``(name, tensor)`` at a time on the sender."""
        keep = self.is_sender
        for index, bucket in enumerate(self.buckets(self.plan(model, generator_dtype))):
            for group in bucket:
                chunk = self._gather_bucket([group], index, keep)
                if chunk is not None:
                    yield from zip(chunk.names, chunk.tensors, strict=True)

    async def extract_weights(
        self, model: Any, generator_dtype: Any = None
    ) -> AsyncIterator[WeightChunk]:
        """Every rank iterates to the end; only the sender gets chunks (see module docstring)."""
        buckets = self.buckets(self.plan(model, generator_dtype))
        keep = self.is_sender
        self.memory.reset_peak()
        self.runs_started += 1
        done = 0
        try:
            for index, bucket in enumerate(buckets):
                if keep:
                    await self._wait_for_room(index)
                chunk = self._gather_bucket(bucket, index, keep)
                done = index + 1
                if chunk is not None:
                    yield chunk
                    del chunk
                await asyncio.sleep(0)
        finally:
            if done < len(buckets) and self.cfg.drain_on_abort:
                log.warning(
                    "%s extractor: consumer stopped after %d of %d chunks; gathering the rest "
                    "and dropping it so the other ranks are not left in a collective",
                    self.backend_name, done, len(buckets),
                )
                for bucket in buckets[done:]:
                    self._gather_bucket(bucket, -1, keep=False)

    def drain(self, model: Any, generator_dtype: Any = None) -> None:
        """Run every gather of one extraction and drop the results (every rank's part of the
        collectives). For a sender whose ``extract_weights`` was never started because the
        sync failed first (e.g. the engine refused the manifest), so that the other ranks,
        which iterate regardless, are not left waiting in a collective."""
        for bucket in self.buckets(self.plan(model, generator_dtype)):
            self._gather_bucket(bucket, -1, keep=False)

    async def _wait_for_room(self, index: int) -> None:
        await wait_for_room(self.memory, index, limit=int(self.cfg.max_live_chunks),
                            timeout_s=float(self.cfg.backpressure_timeout_s),
                            who=f"{self.backend_name} extractor")


async def wait_for_room(
    meter: GatherMeter, index: int, *, limit: int, timeout_s: float, who: str
) -> None:
    """Back-pressure on the sending rank: wait until at most ``limit - 1`` chunks other than
    ``index`` hold tensors counted by ``meter`` (``limit <= 0``: no wait). Gives up with a
    warning after ``timeout_s`` (a consumer that keeps its chunks), and at once when no other
    task runs that could free one."""
    if limit <= 0:
        return
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while meter.live_chunks(excluding=index) > limit - 1:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if not others:
            return  # nothing else runs that could free a chunk: the consumer keeps them
        if time.monotonic() > deadline:
            log.warning(
                "%s: %d earlier chunks still alive after %.0f s; extracting the next one "
                "anyway (the consumer keeps chunks; memory is no longer bounded by "
                "max_live_chunks)", who, meter.live_chunks(excluding=index), timeout_s,
            )
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def config_rank(cfg: Any) -> int:
    """``cfg.rank``, or this process's rank in the default ``torch.distributed`` group (0 when
    there is none)."""
    if getattr(cfg, "rank", None) is not None:
        return int(cfg.rank)
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_sending_rank(cfg: Any) -> bool:
    """``cfg.is_sender`` when set, else whether this rank (``config_rank``) is ``cfg.src_rank``:
    the rule of every extractor of a model sharded over ranks."""
    explicit = getattr(cfg, "is_sender", None)
    if explicit is not None:
        return bool(explicit)
    return config_rank(cfg) == int(getattr(cfg, "src_rank", 0))


def name_filter(patterns: list[str] | None) -> Any:
    """Predicate over engine names: everything, or names matching one of ``patterns``
    (``compile_patterns``: substring, or ``re:<regex>``)."""
    if not patterns:
        return lambda name: True
    from weightsync.naming import compile_patterns

    compiled = compile_patterns(patterns)
    return lambda name: any(p.search(name) for p in compiled)


def _named_entries(model: Any, *, include_buffers: bool) -> list[tuple[str, str, Any]]:
    """``(module_name, full_name, tensor)`` of every parameter (all aliases) and, optionally,
    persistent buffer, module by module in ``named_modules`` order."""
    out: list[tuple[str, str, Any]] = []
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out.append((prefix, pre + n, p))
        if include_buffers:
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for n, b in mod._buffers.items():
                if b is not None and n not in skip:
                    out.append((prefix, pre + n, b))
    return out
