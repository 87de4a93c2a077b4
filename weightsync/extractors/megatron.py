"""``megatron`` extractor: a Megatron-Core model, exported under Hugging Face names by a bridge.

Who calls: every training rank of the Megatron model (TP / PP / EP / VPP), in lockstep. The
bridge's export runs collectives (tensor-parallel all-gathers, pipeline broadcasts), so
``extract_weights`` must be iterated to the end on every rank, and so must ``metadata`` the
first time it is asked about a model (see below). Every rank gets full tensors from the bridge;
only the sending rank (``is_sender``, default: ``rank == src_rank``) keeps them, the others
drop each one as it comes.

The bridge (nothing is imported before it is used):

- Megatron-Bridge (``megatron.bridge.AutoBridge``): ``bridge.export_hf_weights(model,
  cpu=False, show_progress=False)``;
- mbridge (``mbridge.AutoBridge``): ``bridge.export_weights(model)``;
- or any callable ``export(models) -> Iterable[(hf_name, tensor)]`` (``models``: the list of
  model chunks), for a conversion of your own.

Give it as ``MegatronWeightExtractor(cfg, bridge=...)``, or name the HF checkpoint in the config
(``hf_model_path``): the bridge is then built at first use with ``AutoBridge.from_hf_pretrained``
(Megatron-Bridge, preferred when both are installed) or ``AutoBridge.from_pretrained``
(mbridge); ``bridge_package`` picks one. Neither importable is an ``ImportError`` naming both.
``model`` is what the bridge exports: one module or the list of model chunks (VPP).

What is yielded (the interface design's Megatron extractor):

- **threshold buckets, not module grouping**: HF tensors in export order, cut into chunks of at
  most ``bucket_size_mb`` (or SkyRL's ``weight_transfer_threshold_cuda_ipc_GB``; a larger tensor
  is a chunk of its own) by the base class's hooks: ``_should_group_by_module()`` is False
  unless the config's ``group_by_module`` (default False) or a subclass says otherwise;
- **packed chunks** (``pack``, default True): once a bucket is full its tensors are copied into
  one contiguous buffer per dtype and device and the chunk holds views of it
  (``WeightChunk.packed``): one allocation per bucket, contiguous tensors (the bridge's q/k/v and
  gate/up splits are strided views of a gathered fused tensor), and the bridge's temporaries
  are dropped. ``cuda_ipc`` then sends one allocation per bucket and dtype (the engine opens one
  handle, cached) and copies nothing for ``.contiguous()``;
- a name the bridge yields twice (a tied embedding whose copy the last pipeline stage holds) is
  sent once, the first time;
- floating tensors cast to ``generator_dtype`` as they stream.

Memory on the sender: buffers of chunks still alive are counted exactly (``extractor.memory``)
and the next bucket is not exported until at most ``max_live_chunks - 1`` earlier ones are
(back-pressure, as for ``fsdp``). A consumer that stops early leaves the rest of the export to
run and be dropped when the iterator is closed (``drain_on_abort``), and ``drain(model)`` covers
a sync that failed before extraction began, so no rank is left in a collective.

``metadata(model, dtype)``: exactly the names, dtypes and shapes the export yields. The bridges
offer no cheaper exact source, so the first call for a model runs one export (every rank must
call it: ``weightsync.connect`` does, on every rank) and keeps only the metadata; later calls
for the same model (same parameters, shapes and dtypes) cost nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.config import ExtractorConfig
from weightsync.extractors._gather import GatherMeter, is_sending_rank, wait_for_room
from weightsync.interfaces import WeightExtractor
from weightsync.types import TensorMeta, WeightChunk, as_dtype, dtype_to_str, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

#: ``bridge_package`` values, in the order ``auto`` tries them
BRIDGE_PACKAGES = ("megatron.bridge", "mbridge")

Export = Callable[[list[Any]], Iterable[tuple[str, "torch.Tensor"]]]


@dataclass(kw_only=True)
class MegatronExtractorConfig(ExtractorConfig):
    """``is_sender`` None: this rank is ``src_rank`` (``rank``, or ``torch.distributed``'s rank
    of the default group when None). ``hf_model_path`` / ``bridge_package``: build the bridge
    when none is given (``auto``, ``megatron.bridge`` or ``mbridge``). ``pack``: packed chunks.
    ``max_live_chunks`` / ``backpressure_timeout_s`` / ``drain_on_abort``: as for ``fsdp``."""

    type: str = "megatron"
    group_by_module: bool = False
    is_sender: bool | None = None  # type: ignore[assignment]
    src_rank: int = 0
    rank: int | None = None
    hf_model_path: str | None = None
    bridge_package: str = "auto"
    pack: bool = True
    max_live_chunks: int = 2
    backpressure_timeout_s: float = 60.0
    drain_on_abort: bool = True

    def __post_init__(self) -> None:
        if self.bridge_package not in ("auto", *BRIDGE_PACKAGES):
            raise ValueError(
                f"extractor 'megatron': bridge_package must be 'auto', "
                f"{' or '.join(repr(p) for p in BRIDGE_PACKAGES)}, got {self.bridge_package!r}"
            )
        if not self.bucket_size_mb > 0:
            raise ValueError(
                f"extractor 'megatron': bucket_size_mb must be > 0, got {self.bucket_size_mb!r}")


class MegatronWeightExtractor(WeightExtractor):
    """Megatron-Core models through Megatron-Bridge / mbridge (registered as ``megatron``)."""

    config_cls = MegatronExtractorConfig
    lockstep = True

    def __init__(self, cfg: Any = None, *, bridge: Any = None) -> None:
        super().__init__(cfg if cfg is not None else MegatronExtractorConfig())
        # threshold buckets in export order; module groups only when the config asks
        self._group_by_module = bool(getattr(self.cfg, "group_by_module", False))
        self._batch_by_threshold = True
        if bridge is None and not getattr(self.cfg, "hf_model_path", None):
            raise ValueError(
                "megatron extractor needs a bridge: MegatronWeightExtractor(cfg, bridge=...) "
                "with a Megatron-Bridge or mbridge AutoBridge (or a callable models -> "
                "(hf_name, tensor) pairs), or hf_model_path in its config"
            )
        self._bridge = bridge
        self._export: Export | None = export_function(bridge) if bridge is not None else None
        self.memory = GatherMeter()
        self.runs_started = 0  # extract_weights iterations that began (see ``drain``)
        self._metadata: tuple[tuple, list[TensorMeta]] | None = None

    @property
    def bridge(self) -> Any:
        """The bridge, built from ``hf_model_path`` at first use when none was given."""
        self._exporter()
        return self._bridge

    def _exporter(self) -> Export:
        if self._export is None:
            self._bridge = load_bridge(str(self.cfg.hf_model_path), self.cfg.bridge_package)
            self._export = export_function(self._bridge)
        return self._export

    def _sender_from_config(self) -> bool:
        return is_sending_rank(self.cfg)

    # -- the stream ----------------------------------------------------------------------------
    def _extract_raw_weights(
        self, model: Any, generator_dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` as the bridge exports them, each name once (every rank)."""
        seen: set[str] = set()
        for name, t in self._exporter()(as_model_list(model)):
            if name in seen:  # the last pipeline stage's copy of a tied embedding
                continue
            seen.add(name)
            yield name, t

    async def extract_weights(
        self, model: Any, generator_dtype: Any = None
    ) -> AsyncIterator[WeightChunk]:
        """Every rank iterates to the end; only the sender gets chunks (module docstring)."""
        dtype = as_dtype(generator_dtype)
        self.runs_started += 1
        self.memory.reset_peak()
        raw = iter(self._cast_stream(self._extract_raw_weights(model, dtype), dtype))
        if not self.is_sender:
            for _ in raw:  # lockstep collectives; a non-sending rank keeps nothing
                await asyncio.sleep(0)
            return
        own = _storages(as_model_list(model))
        chunks = iter(self._cut(raw))  # the base class's hooks: threshold buckets by default
        index, finished = 0, False
        try:
            while True:
                await self._wait_for_room(index)
                chunk = next(chunks, None)  # exports the bucket (the collectives run here)
                if chunk is None:
                    break
                yield self._finish_chunk(chunk, index, own)
                del chunk
                index += 1
            finished = True
        finally:
            if not finished and self.cfg.drain_on_abort:
                log.warning(
                    "megatron extractor: consumer stopped after %d chunk(s); exporting the rest "
                    "and dropping it so the other ranks are not left in a collective", index,
                )
                for _ in raw:
                    pass

    def drain(self, model: Any, generator_dtype: Any = None) -> None:
        """Run one export and drop it (this rank's part of the collectives), for a sender whose
        ``extract_weights`` never started because the sync failed first."""
        for _ in self._extract_raw_weights(model, as_dtype(generator_dtype)):
            pass

    def _finish_chunk(self, chunk: WeightChunk, index: int, own: set[int]) -> WeightChunk:
        if self.cfg.pack:
            packed, buffers = pack_chunk(chunk)
            for buf in buffers:
                self.memory.track(buf, index)
            return packed
        for t in chunk.tensors:
            if t.untyped_storage().data_ptr() not in own:  # not a parameter's own memory
                self.memory.track(t, index)
        return chunk

    async def _wait_for_room(self, index: int) -> None:
        await wait_for_room(self.memory, index, limit=int(self.cfg.max_live_chunks),
                            timeout_s=float(self.cfg.backpressure_timeout_s),
                            who="megatron extractor")

    # -- metadata ------------------------------------------------------------------------------
    def metadata(self, model: Any, generator_dtype: Any = None) -> list[TensorMeta]:
        """What ``extract_weights`` yields; the first call for a model runs one export on every
        rank (see the module docstring), later ones reuse it."""
        dtype = as_dtype(generator_dtype)
        key = _model_key(as_model_list(model))
        if self._metadata is None or self._metadata[0] != key:
            metas = [
                TensorMeta(n, dtype_to_str(t.dtype), list(t.shape))
                for n, t in self._extract_raw_weights(model, None)
            ]
            self._metadata = (key, metas)
        return [
            TensorMeta(m.name, dtype_to_str(dtype), list(m.shape))
            if dtype is not None and str_to_dtype(m.dtype).is_floating_point else m
            for m in self._metadata[1]
        ]


# --------------------------------------------------------------------------------------------
# the bridge
# --------------------------------------------------------------------------------------------


def export_function(bridge: Any) -> Export:
    """``models -> (hf_name, tensor)`` pairs for a Megatron-Bridge or mbridge bridge, or a
    callable that already is one."""
    export_hf = getattr(bridge, "export_hf_weights", None)  # Megatron-Bridge
    if callable(export_hf):
        return lambda models: export_hf(models, cpu=False, show_progress=False)
    export = getattr(bridge, "export_weights", None)  # mbridge
    if callable(export):
        return export
    if callable(bridge):
        return bridge
    raise TypeError(
        f"megatron extractor: bridge must be a Megatron-Bridge AutoBridge (export_hf_weights), "
        f"an mbridge bridge (export_weights) or a callable models -> (hf_name, tensor) pairs; "
        f"got {type(bridge).__name__}"
    )


def load_bridge(hf_model_path: str, package: str = "auto") -> Any:
    """A bridge for the HF checkpoint at ``hf_model_path`` from the first importable package of
    ``package`` (``auto``: Megatron-Bridge, then mbridge)."""
    tried: list[str] = []
    for pkg in BRIDGE_PACKAGES if package == "auto" else (package,):
        try:
            if pkg == "megatron.bridge":
                from megatron.bridge import AutoBridge

                return AutoBridge.from_hf_pretrained(hf_model_path)
            from mbridge import AutoBridge as MBridge

            return MBridge.from_pretrained(hf_model_path)
        except ImportError as e:
            tried.append(f"{pkg}: {e}")
    raise ImportError(
        "megatron extractor: no bridge package could be imported ("
        + "; ".join(tried)
        + "). Install Megatron-Bridge (pip install megatron-bridge) or mbridge "
        "(pip install mbridge), or pass bridge=<your export function>"
    )


def as_model_list(model: Any) -> list[Any]:
    """One module, or the list of model chunks (VPP), as the list the bridges take."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def pack_chunk(chunk: WeightChunk) -> tuple[WeightChunk, list[torch.Tensor]]:
    """``chunk`` with its tensors copied into one flat buffer per (device, dtype), in order, and
    replaced by views of it; returns the new chunk and its buffers."""
    import torch

    from weightsync._runtime.copy import copy_many

    groups: dict[tuple[Any, torch.dtype], list[int]] = {}
    for i, t in enumerate(chunk.tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    views: list[Any] = [None] * len(chunk.tensors)
    buffers = []
    for (device, dtype), members in groups.items():
        buf = torch.empty(sum(chunk.tensors[i].numel() for i in members), dtype=dtype,
                          device=device)
        offset = 0
        for i in members:
            n = chunk.tensors[i].numel()
            views[i] = buf[offset:offset + n].view(chunk.tensors[i].shape)
            offset += n
        with torch.no_grad():
            copy_many([views[i] for i in members], [chunk.tensors[i] for i in members])
        buffers.append(buf)
    out = WeightChunk(names=list(chunk.names), tensors=views, module_name=chunk.module_name,
                      packed=True)
    return out, buffers


def _storages(models: list[Any]) -> set[int]:
    """Data pointers of the storages of every parameter and buffer of ``models``."""
    out: set[int] = set()
    for m in models:
        for t in (*m.parameters(), *m.buffers()):
            out.add(t.untyped_storage().data_ptr())
    return out


def _model_key(models: list[Any]) -> tuple:
    """What the export's names and shapes depend on: the modules and their local parameters."""
    return tuple(
        (id(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))
        for m in models
    )
