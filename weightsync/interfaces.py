"""The abstract contracts (summarised with the whole design in ``docs/architecture.md``).

Process map:
- trainer process(es): ``WeightExtractor`` (every training rank, in lockstep),
  ``WeightTransferSender`` (the sending rank only), ``InferenceEngineClient`` (sending rank).
- engine process(es) / workers: ``WeightTransferReceiver`` and ``WeightLoader``, driven by a
  ``weightsync.engine.WeightUpdateEndpoint``.
- ``WeightTransferStrategy`` is a factory usable on both sides; it is built from config.

One update = ``start`` (manifest validated by every engine before any byte moves) -> one request
per chunk -> ``finish`` (engines publish the new version only if every chunk landed).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, ClassVar

from weightsync.config import DEFAULT_BUCKET_MB
from weightsync.errors import WeightMismatchError
from weightsync.pipeline import (
    SendPipeline,
    SingleCallClient,
    aiter_chunks,
    batch_by_threshold,
    group_by_module,
    peek_single,
)
from weightsync.raw_weights import (
    ExtractedStream,
    RawExtraction,
    extract_raw,
    manifest_of,
    stream_manifest,
)
from weightsync.types import (
    SyncStats,
    TensorMeta,
    TrainingMode,
    WeightChunk,
    WeightSyncInfo,
    WeightUpdateFinish,
    WeightUpdateRequest,
    WeightUpdateStart,
    as_dtype,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.lora_adapter import LoRAAdapterSpec

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Extractor
# --------------------------------------------------------------------------------------------


class DesignFlag:
    """A flag of the interface design that shares its name with one of its helper methods
    (``_group_by_module``, ``_batch_by_threshold``). The design sets the flag in ``__init__``
    (``self._group_by_module = True``) and also calls the helper by that name; a plain
    attribute would make the helper unreachable. So the name is this descriptor: assigning sets
    the flag, reading gives the helper bound to the extractor, which is callable as the design's
    helper and true or false as the flag. Subclasses written to the design work unchanged."""

    def __init__(self, helper: str, default: Callable[[Any], bool]) -> None:
        self.helper = helper
        self.default = default
        self.key = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = f"_ws_flag{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        flag = obj.__dict__.get(self.key)
        return FlagHelper(getattr(obj, self.helper), self.default(obj) if flag is None else flag)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.key] = bool(value)


class FlagHelper:
    """What reading a ``DesignFlag`` gives: the helper (call it) and the flag (test it)."""

    def __init__(self, helper: Callable[..., Any], flag: bool) -> None:
        self._helper = helper
        self._flag = flag

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._helper(*args, **kwargs)

    def __bool__(self) -> bool:
        return self._flag

    def __repr__(self) -> str:
        return f"<flag {self._flag} / helper {getattr(self._helper, '__name__', '?')}>"


class WeightExtractor(abc.ABC):
    """Turns a training model into a stream of ``WeightChunk``s under engine names.

    Called on every training rank. For sharded models all ranks must iterate
    ``extract_weights`` to the end in lockstep (the raw iterator runs collectives); only the
    sending rank (``is_sender``) keeps tensors, the others yield nothing. The whole model is never
    materialised twice: chunks are yielded as soon as each is made.

    The interface design's base class, as it writes it: subclasses implement
    ``_extract_raw_weights(model, generator_dtype)`` in one of two forms, a ``dict`` of name ->
    tensor (the design's; ``async def`` or not) or a generator of ``(name, tensor)`` pairs (ours:
    one parameter at a time, so a sharded model is never whole twice). A dict is extracted once
    per update: the manifest is read from it (``prepare_update``) and the chunks are cut from it
    (``weightsync.raw_weights``). The flags ``_group_by_module`` and ``_batch_by_threshold`` (set
    them in ``__init__``, or override ``_should_group_by_module()`` /
    ``_should_batch_by_threshold()``) decide how ``extract_weights`` cuts the tensors into
    chunks, with the design's helpers ``_group_by_module(params)`` and
    ``_batch_by_threshold(chunks, threshold_gb)`` (each name is a flag and a helper at once:
    ``DesignFlag``). Both flags default to False, as the design says: every tensor is a chunk.
    Grouping keeps a module's tensors in one chunk; batching fills chunks up to
    ``threshold_bytes()`` (SkyRL's ``weight_transfer_threshold_cuda_ipc_GB``, else
    ``bucket_size_mb``). The built-in extractors set both flags in ``__init__``.
    """

    #: True when ``_extract_raw_weights`` yields the model's own tensors (not gathered or
    #: computed copies); chunks of such tensors that were not cast are marked ``borrowed``.
    #: A subclass that sometimes makes copies reports them with ``_fresh(tensor)``.
    yields_model_tensors: bool = False
    #: True when every training rank must iterate ``extract_weights`` (collectives inside),
    #: whatever the model looks like: the front door then runs it on every rank, not only on
    #: the sending one (``fsdp``, ``deepspeed``, ``megatron``)
    lockstep: bool = False

    _group_by_module = DesignFlag("_params_by_module", lambda self: False)
    _batch_by_threshold = DesignFlag("_chunks_by_threshold", lambda self: False)
    #: the extraction ``prepare_update`` made for the next ``extract_weights`` (a dict's pairs)
    _prepared: RawExtraction | None = None

    def __init__(self, cfg: Any = None) -> None:
        from weightsync.config import ExtractorConfig

        self.cfg = cfg if cfg is not None else ExtractorConfig()
        self._cfg_given = cfg is not None  # a default config states nothing of ranks
        self._fresh_ids: set[int] = set()

    # -- subclasses implement -----------------------------------------------------------------
    @abc.abstractmethod
    def _extract_raw_weights(self, model: Any, generator_dtype: torch.dtype | None) -> Any:
        """The model's full tensors under engine names: a generator of ``(name, tensor)``
        (collectives inside, one parameter at a time) or, as the interface design writes it,
        ``async def`` returning ``{name: tensor}``."""

    def metadata(self, model: Any, generator_dtype: torch.dtype | None = None) -> list[TensorMeta]:
        """Cheap, non-collective list of what ``extract_weights`` will yield (for validation).

        The default reads what ``_extract_raw_weights`` gives: a dict (the design's form) is
        kept for the next ``extract_weights`` of this model and dtype, so it is not extracted
        again; a generator is walked. Sharded extractors override it to read global shapes
        without gathering. An ``async`` ``_extract_raw_weights`` cannot run here: its manifest
        comes from ``await prepare_update(model, dtype)`` (what the front door calls)."""
        dtype = as_dtype(generator_dtype)
        kept = self._prepared
        if kept is not None and kept.made_for(model, dtype) and kept.manifest is not None:
            return list(kept.manifest)
        raw = self._extract_raw_weights(model, dtype)
        if inspect.iscoroutine(raw) or inspect.isasyncgen(raw):
            with contextlib.suppress(Exception):
                raw.close()  # type: ignore[union-attr]
            raise TypeError(
                f"{type(self).__name__}: its _extract_raw_weights is async, so metadata() cannot "
                f"run it; 'await extractor.prepare_update(model, dtype)' gives the manifest "
                f"(it extracts once, and the next extract_weights sends that extraction)")
        got = RawExtraction(model, dtype, raw, who=type(self).__name__)
        if got.manifest is not None:
            self._prepared = got
            return list(got.manifest)
        return manifest_of(got.take(), dtype, who=type(self).__name__)

    async def prepare_update(
        self, model: Any, generator_dtype: torch.dtype | None = None
    ) -> list[TensorMeta]:
        """The manifest of the update the next ``extract_weights(model, generator_dtype)``
        yields. An extractor whose ``_extract_raw_weights`` returns a dict (the interface
        design's form, ``async`` or not) extracts here, once: the manifest is read from the
        dict and the next ``extract_weights`` cuts its chunks from the same dict (call
        ``discard_prepared`` when the update will not be sent). An extractor with its own
        ``metadata`` gets that; a generator is walked. Every rank of a sharded model calls it
        in lockstep (a dict's extraction may gather)."""
        self.discard_prepared()
        if type(self).metadata is not WeightExtractor.metadata:
            return self.metadata(model, generator_dtype)
        got = await extract_raw(self, model, generator_dtype)
        if got.manifest is None:
            return manifest_of(got.take(), got.dtype, who=type(self).__name__)
        self._prepared = got
        return list(got.manifest)

    def discard_prepared(self) -> None:
        """Drop the extraction ``prepare_update`` kept (an update that will not be sent)."""
        self._prepared = None

    def held_update(
        self, model: Any, generator_dtype: torch.dtype | None = None, *, check: bool = True
    ) -> tuple[list[WeightChunk], list[TensorMeta]] | None:
        """The chunks and manifest of this rank's last extraction when they are still exactly
        what ``metadata`` + ``extract_weights`` would give now and cost nothing to hold (views
        of the model's own tensors), else None (the default: extract). The front door asks
        this first on the sending rank: a held update needs no extraction pass after the
        engines accepted it. ``check`` False: the last update made for this model and dtype
        without comparing the model now with it (the caller calls ``check_held`` before a
        byte of it is sent). Never a collective."""
        return None

    def check_held(self, model: Any, generator_dtype: torch.dtype | None = None) -> bool:
        """Whether ``held_update(model, generator_dtype)`` would give the update held now
        (see there); False by default."""
        return False

    @property
    def is_sender(self) -> bool:
        """Whether this rank keeps the chunks: as set on the extractor (the front door sets it
        for an extractor whose config does not say, and on every rank for ``every_rank``
        IPC), else as its config says (``_sender_from_config``)."""
        told = self.__dict__.get("_ws_is_sender")
        return self._sender_from_config() if told is None else told

    @is_sender.setter
    def is_sender(self, value: bool) -> None:
        self.__dict__["_ws_is_sender"] = bool(value)

    def _sender_from_config(self) -> bool:
        """The config's ``is_sender`` (default True: a process of one rank sends)."""
        return bool(_cfg_value(self.cfg, "is_sender", True))

    def states_sender(self) -> bool:
        """Whether the config given (or the extractor's class) decides ``is_sender``; False for
        an extractor written to the interface design, whose config knows nothing of ranks."""
        given = getattr(self, "_cfg_given", True)
        return ((given and _cfg_value(self.cfg, "is_sender", None) is not None)
                or type(self)._sender_from_config is not WeightExtractor._sender_from_config)

    # -- the design's hooks and helpers ------------------------------------------------------
    def _should_group_by_module(self) -> bool:
        """Keep each module's parameters in one chunk (default: the ``_group_by_module`` flag)."""
        return bool(self._group_by_module)

    def _should_batch_by_threshold(self) -> bool:
        """Put several groups in one chunk up to the threshold (default: the
        ``_batch_by_threshold`` flag)."""
        return bool(self._batch_by_threshold)

    def _params_by_module(self, params: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
        """The design's ``_group_by_module(params)``: module name -> its parameter names, in
        order (``a.b.weight``, ``a.b.bias`` -> ``a.b``)."""
        out: dict[str, list[str]] = {}
        for module, items in group_by_module(params.items()):
            out.setdefault(module, []).extend(n for n, _ in items)
        return out

    def _chunks_by_threshold(
        self, chunks: Iterable[WeightChunk], threshold_gb: float
    ) -> Iterator[list[WeightChunk]]:
        """The design's ``_batch_by_threshold(chunks, threshold_gb)``: consecutive chunks in
        lists of at most ``threshold_gb`` GB (a chunk larger than that is a list of its own)."""
        limit = float(threshold_gb) * (1 << 30)
        batch: list[WeightChunk] = []
        size = 0
        for chunk in chunks:
            n = int(chunk.total_size_bytes or 0)
            if batch and size + n > limit:
                yield batch
                batch, size = [], 0
            batch.append(chunk)
            size += n
        if batch:
            yield batch

    def threshold_bytes(self) -> int:
        """The batching threshold: SkyRL's ``weight_transfer_threshold_cuda_ipc_GB`` (at the top
        of the config or under ``generator``) when set, else ``bucket_size_mb``."""
        gb = _cfg_value(self.cfg, "weight_transfer_threshold_cuda_ipc_GB", None)
        if gb is None:
            gb = _cfg_value(_cfg_value(self.cfg, "generator", None),
                            "weight_transfer_threshold_cuda_ipc_GB", None)
        if gb is not None:
            return int(float(gb) * (1 << 30))
        return int(float(_cfg_value(self.cfg, "bucket_size_mb", DEFAULT_BUCKET_MB)) * (1 << 20))

    # -- shared machinery ----------------------------------------------------------------------
    def extract_weights(
        self, model: Any, generator_dtype: torch.dtype | None = None
    ) -> ExtractedStream:
        """Chunks cut as the hooks say (by default one per tensor), yielded as soon as one is
        made; only the sending rank gets them. An async iterator (``async for``); its
        ``manifest()`` is the update's manifest when ``_extract_raw_weights`` gives a dict
        (``weightsync.raw_weights``). A dict ``prepare_update`` kept for this model and dtype
        is used, not extracted again."""
        return ExtractedStream(self, model, generator_dtype)

    async def _raw_extraction(self, model: Any, generator_dtype: Any) -> RawExtraction:
        """The extraction ``prepare_update`` / ``metadata`` kept for this model and dtype
        (taken: it serves one update), else a new one."""
        kept, self._prepared = self._prepared, None
        if kept is not None and kept.made_for(model, as_dtype(generator_dtype)):
            return kept
        return await extract_raw(self, model, generator_dtype)

    async def _chunk_stream(
        self, raw: RawExtraction | None, model: Any, generator_dtype: Any
    ) -> AsyncIterator[WeightChunk]:
        """The body of ``extract_weights``: ``raw`` (or a new extraction) cut into chunks."""
        if raw is None:
            raw = await self._raw_extraction(model, generator_dtype)
        chunks = self._cut(self._cast_stream(raw.take(), raw.dtype))
        async for chunk in aiter_chunks(chunks):
            fresh = self._fresh_ids
            ids = [id(t) for t in chunk.tensors]
            chunk.borrowed = self.yields_model_tensors and not any(i in fresh for i in ids)
            fresh.difference_update(ids)
            if self.is_sender:
                yield chunk
            await asyncio.sleep(0)
        self._fresh_ids.clear()

    def _cut(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightChunk]:
        """``(name, tensor)`` pairs -> chunks as the hooks say: whole modules when
        ``_should_group_by_module()``, several up to ``threshold_bytes()`` when
        ``_should_batch_by_threshold()``, else one chunk per group. Lazy: a chunk is made when
        asked for."""
        if self._should_group_by_module():
            groups: Iterable[Any] = group_by_module(named)
        else:
            groups = ((n, [(n, t)]) for n, t in named)
        if self._should_batch_by_threshold():
            return batch_by_threshold(groups, self.threshold_bytes())
        return (WeightChunk([n for n, _ in items], [t for _, t in items], module_name=m)
                for m, items in groups)

    def _fresh(self, t: torch.Tensor) -> torch.Tensor:
        """Mark ``t`` as a copy made for this sync (its chunk is not ``borrowed``)."""
        self._fresh_ids.add(id(t))
        return t

    @staticmethod
    def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if dtype is None or t.dtype == dtype or not t.is_floating_point():
            return t
        return t.to(dtype)

    def _cast_stream(
        self, raw: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        fresh = self._fresh_ids
        for name, t in raw:
            d = t.detach()
            out = self._cast(d, dtype)
            if out is not d or id(t) in fresh:  # a cast, or a copy the subclass made
                fresh.discard(id(t))
                fresh.add(id(out))
            yield name, out


def _cfg_value(cfg: Any, key: str, default: Any) -> Any:
    """``cfg.key`` of a dataclass, mapping or OmegaConf node (``default`` when absent)."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    try:
        value = getattr(cfg, key)
    except Exception:  # noqa: BLE001 - an OmegaConf node in struct mode raises its own error
        return default
    return default if value is None else value


# --------------------------------------------------------------------------------------------
# Engine client (what the sender talks to)
# --------------------------------------------------------------------------------------------


class InferenceEngineClient(abc.ABC):
    """Fan-out to every inference engine of a sync group. Lives in the sending process.

    Engine ``i`` with ``w_i`` receiving workers gets ``rank_offset = 1 + sum(w_0..w_{i-1})``
    (rank 0 is the sender). All methods take and return plain JSON-safe data.
    """

    #: How many ``update_named_weights`` calls the sender may have outstanding at once. More
    #: than 1 only where every engine gets the chunk requests in call order (the call's
    #: synchronous part queues the message in order, and the engine runs them one at a time or
    #: orders them by ``chunk_index``): then chunk i+1's request travels while chunk i lands.
    max_inflight_updates: int = 1

    @abc.abstractmethod
    async def get_world_sizes(self) -> list[int]:
        """Receiving workers per engine (TP x PP for vLLM, 1 for a plain module)."""

    @abc.abstractmethod
    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        """Have every engine build its receivers (returns once they joined the data plane)."""

    @abc.abstractmethod
    async def start_weight_update(self, start: dict) -> None:
        """Announce an update; engines validate its manifest and raise before any byte moves."""

    @abc.abstractmethod
    async def update_named_weights(self, request: dict) -> None:
        """One chunk: returns once every engine received and loaded it."""

    @abc.abstractmethod
    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        """Close an update; returns each engine's published version."""

    async def close_weight_transfer(self) -> None:  # noqa: B027 - optional hook
        """Tear down receivers (optional)."""

    #: True when ``apply_update`` reaches every engine (``weightsync.engine`` ``apply_update``)
    supports_apply_update: bool = False

    async def apply_update(
        self, start: dict | None, requests: list[dict], finish: dict
    ) -> list[int | None]:
        """A whole update in one call per engine (optional; see ``supports_apply_update``):
        start (None: made already by ``start_weight_update``), every request in order, finish;
        returns each engine's published version."""
        raise NotImplementedError(f"{type(self).__name__} does not carry apply_update")

    @staticmethod
    def rank_offsets(world_sizes: list[int]) -> list[int]:
        offsets, nxt = [], 1
        for w in world_sizes:
            offsets.append(nxt)
            nxt += w
        return offsets


# --------------------------------------------------------------------------------------------
# Loader (engine side)
# --------------------------------------------------------------------------------------------


class WeightLoader(abc.ABC):
    """Puts received tensors into the engine's model. Runs in the engine (worker) process.

    ``load_weights`` must copy what it keeps: the tensors it receives may be views of transfer
    buffers that are reused after it returns.
    """

    #: True for a loader that only keeps what ``load_weights`` gives it and changes what the
    #: engine serves in ``finish_update`` alone, all or nothing (an adapter loader): a failed
    #: update then leaves the engine serving its last version, never torn
    changes_at_finish_only: bool = False

    @abc.abstractmethod
    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    async def load_borrowed(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """``load_weights`` of views the sender keeps valid and unchanged until the update's
        finish returned: the receiver says they stay so until the engine call that carried
        them returns (``cuda_ipc``: the trainer's own memory, held until the engines
        answered), and the endpoint's sink forwards them here only when that call carries the
        finish too (``apply_update``). A loader that installs at finish may keep them instead
        of copying, and must have read them when its ``finish_update`` returns. Default:
        ``load_weights``."""
        await self.load_weights(named_tensors)

    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        """Names/shapes/dtypes the target accepts, or None when unknown (no validation)."""
        return None

    def validate(self, metas: Iterable[TensorMeta]) -> None:
        """Raise ``WeightMismatchError`` listing offenders; called before any byte moves."""
        from weightsync.validation import check_metadata

        check_metadata(metas, self.expected_metadata())

    def direct_target(self, meta: TensorMeta) -> torch.Tensor | None:
        """Where the bytes of ``meta`` may be written as they arrive: a contiguous tensor of the
        engine's own weights with ``meta``'s dtype and shape (a view of a parameter), or None
        (default) to take them through ``load_weights``. A transport that can receive into
        given memory (the streamed broadcast) then skips its receive buffer and the copy out
        of it; it calls ``loaded_in_place`` once the bytes landed. Asked only during an
        in-place update, in the update's thread."""
        return None

    def stage_weights(self, named_tensors: dict[str, torch.Tensor]) -> bool:
        """A staged update's chunk (the weights must not change before its finish): keep it
        beside the weights in the loader's own form and return True, or return False (the
        default) and the caller keeps a copy and hands it to ``load_weights`` at the finish.
        Returns after the tensors were read (they may be views of reused buffers)."""
        return False

    def commit_staged(self) -> None:  # noqa: B027
        """Publish every chunk ``stage_weights`` kept in this update (the staged update's
        finish; the device's copies have run when it returns)."""

    def discard_staged(self) -> None:  # noqa: B027
        """Forget the chunks ``stage_weights`` kept in this update (it failed)."""

    def loaded_in_place(self, names: Sequence[str]) -> None:  # noqa: B027
        """``names`` were written straight into the tensors ``direct_target`` gave (the device
        work has completed): what ``load_weights`` would do after copying (bookkeeping, tied
        copies) happens here."""

    def adapter_loader(self, spec: LoRAAdapterSpec) -> WeightLoader:
        """The loader of one LoRA adapter-only update (``weightsync.lora_adapter``): the
        endpoint gives it an update whose start carries ``lora_adapter`` (staged, installed at
        finish). The default refuses: this engine serves no LoRA adapters."""
        from weightsync.errors import UpdateRefusedError

        raise UpdateRefusedError(
            f"{type(self).__name__} takes no LoRA adapter updates (adapter {spec.name!r}); a "
            f"vLLM engine started with enable_lora=True does, or push merged weights (the "
            f"lora_merge extractor)")

    async def start_update(self, start: WeightUpdateStart) -> None:  # noqa: B027
        """Hook before the first chunk of an update."""

    async def finish_update(self, finish: WeightUpdateFinish) -> None:  # noqa: B027
        """Hook after the last chunk landed (reset caches, re-pack kernels, ...)."""


# --------------------------------------------------------------------------------------------
# Sender / receiver
# --------------------------------------------------------------------------------------------


class WeightTransferSender(abc.ABC):
    """Ships chunks to every engine. Lives in the sending training process (rank 0).

    ``send_chunks`` runs one whole update: ``start`` (manifest check on every engine), one
    request per chunk, ``finish``. It overlaps preparing chunk i+1 (extraction, packing) with the
    transfer of chunk i. Subclasses implement ``create_request`` (may pack into transfer buffers;
    runs in a worker thread) and ``_transfer`` (moves the bytes and calls
    ``inference_client.update_named_weights``).
    """

    overlap: bool = True
    #: chunks in flight at once when the sender has no ``cfg.max_inflight_chunks``; the
    #: client's ``max_inflight_updates`` bounds it too
    max_inflight: int = 2
    #: an update of one chunk goes to the engines as one ``apply_update`` call (start, chunk
    #: and finish in one round trip) when the client supports it
    single_call: bool = True

    @abc.abstractmethod
    def create_request(self, chunk: WeightChunk) -> WeightUpdateRequest: ...

    @abc.abstractmethod
    async def _transfer(
        self,
        chunk: WeightChunk,
        request: WeightUpdateRequest,
        inference_client: InferenceEngineClient,
    ) -> None: ...

    def _release(self, request: WeightUpdateRequest) -> None:  # noqa: B027
        """Called once a chunk's transfer completed (or failed): free its buffers."""

    async def send_chunks(
        self,
        chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk],
        inference_client: InferenceEngineClient,
        *,
        version: int | None = None,
        manifest: list[TensorMeta] | None = None,
        training_mode: TrainingMode | str | None = None,
        head_name_patterns: list[str] | None = None,
        extras: dict | None = None,
        delta: dict | None = None,
        lora_adapter: dict | None = None,
    ) -> SyncStats:
        """One whole update. ``manifest`` (derived from a list of chunks when not given) lets
        every engine refuse bad names/shapes/dtypes before any byte moves; ``training_mode`` and
        ``head_name_patterns`` travel in the start (the engines enforce the mode's name policy);
        ``extras`` is free-form data for custom loaders; ``delta`` makes it a delta update
        (``weightsync.delta``: the chunks are its wire tensors); ``lora_adapter``
        (``LoRAAdapterSpec.to_dict()``) makes it a LoRA adapter-only update (the chunks are the
        adapter's ``lora_A`` / ``lora_B``; ``weightsync.lora_adapter``)."""
        if manifest is None and isinstance(chunks, (list, tuple)):
            manifest = [m for c in chunks for m in c.metas()]
        elif manifest is None:  # an extractor's dict: its manifest, from the same extraction
            manifest = await stream_manifest(chunks)
        stats = SyncStats(update_id=uuid.uuid4().hex)
        t0 = time.perf_counter()
        cfg = getattr(self, "cfg", None)
        start = self.start_message(stats.update_id, version, manifest, training_mode,
                                   head_name_patterns, extras, delta=delta,
                                   lora_adapter=lora_adapter)
        stream = self._coalesce(chunks, held=isinstance(chunks, (list, tuple)))
        # a delta's start goes out alone: every engine accepts its base before any applies it
        against_base = delta is not None and delta.get("base_version") is not None
        if self.single_call and not against_base and getattr(
                inference_client, "supports_apply_update", False):
            only, stream = await peek_single(stream)
            if only is not None:
                return await self._send_single(only, inference_client, start, stats, t0)
        await inference_client.start_weight_update(start.to_dict())
        try:
            await self._pipeline(inference_client).run(
                stream, stats, _stamper(stats.update_id, version)
            )
        except BaseException as e:
            finish = WeightUpdateFinish(
                update_id=stats.update_id, version=version, num_chunks=stats.num_chunks,
                ok=False, error=f"{type(e).__name__}: {e}"[:2000],
            )
            with contextlib.suppress(Exception):  # best effort: the failure is the news
                await asyncio.wait_for(
                    inference_client.finish_weight_update(finish.to_dict()),
                    timeout=float(getattr(cfg, "timeout_s", 10.0)),
                )
            raise
        finish = WeightUpdateFinish(
            update_id=stats.update_id, version=version, num_chunks=stats.num_chunks
        )
        stats.versions = list(await inference_client.finish_weight_update(finish.to_dict()))
        stats.seconds = time.perf_counter() - t0
        return stats

    def start_message(
        self, update_id: str, version: int | None, manifest: list[TensorMeta] | None,
        training_mode: TrainingMode | str | None, head_name_patterns: list[str] | None,
        extras: dict | None, *, delta: dict | None = None, lora_adapter: dict | None = None,
    ) -> WeightUpdateStart:
        """The update's start, with this sender's per-update options (``staged``, the idle
        limit it promises)."""
        cfg = getattr(self, "cfg", None)
        return WeightUpdateStart(
            update_id=update_id, version=version, manifest=manifest,
            training_mode=training_mode,
            head_name_patterns=list(head_name_patterns) if head_name_patterns else None,
            extras=extras or {}, staged=bool(getattr(cfg, "staged", False)),
            idle_timeout_s=getattr(cfg, "idle_timeout_s", None), delta=delta,
            lora_adapter=lora_adapter,
        )

    async def _send_single(
        self, chunk: WeightChunk, client: InferenceEngineClient, start: WeightUpdateStart,
        stats: SyncStats, t0: float,
    ) -> SyncStats:
        """An update of one chunk as one ``apply_update`` call; the engines run the same start /
        chunk / finish steps (and close the update themselves if the chunk fails)."""
        finish = WeightUpdateFinish(update_id=start.update_id, version=start.version,
                                    num_chunks=1)
        one = SingleCallClient(client, start.to_dict(), finish.to_dict())
        # one chunk: no transfer to overlap its request with; a cheap one is made on the loop
        # (no hop to a worker thread and back on the update's path)
        await self._pipeline(one, overlap=not self.prepares_inline(chunk)).run(
            [chunk], stats, _stamper(start.update_id, start.version))
        assert one.versions is not None
        stats.versions = one.versions
        stats.seconds = time.perf_counter() - t0
        return stats

    def prepares_inline(self, chunk: WeightChunk) -> bool:
        """Hook: whether ``create_request(chunk)`` is cheap enough to run on the event loop
        when nothing overlaps it (an update of one chunk). Default: no (it may pack
        megabytes)."""
        return False

    def _coalesce(
        self, chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk], *, held: bool
    ) -> AsyncIterable[WeightChunk] | Iterable[WeightChunk]:
        """Hook: the chunks as this sender sends them (``held``: the caller passed a list, so
        every tensor exists already). The default sends them as they come."""
        return chunks

    def _pipeline(self, client: InferenceEngineClient, *,
                  overlap: bool = True) -> SendPipeline:
        """The pipeline for one update: ``cfg.max_inflight_chunks`` (else ``max_inflight``)
        chunks at once, bounded by what the client allows (``max_inflight_updates``);
        requests made in a worker thread if the sender ``overlap``s and ``overlap``."""
        wanted = getattr(getattr(self, "cfg", None), "max_inflight_chunks", self.max_inflight)
        window = max(1, min(int(wanted), int(client.max_inflight_updates)))

        async def transfer(chunk: WeightChunk, request: WeightUpdateRequest) -> None:
            await self._transfer(chunk, request, client)

        prepare = self.create_request
        if getattr(getattr(self, "cfg", None), "checksum", False):
            prepare = self._request_with_checksums
        return SendPipeline(prepare=prepare, transfer=transfer, release=self._release,
                            window=window, overlap=self.overlap and overlap)

    def _request_with_checksums(self, chunk: WeightChunk) -> WeightUpdateRequest:
        """``create_request`` plus one checksum per tensor of the chunk as the trainer holds it
        (``weightsync.integrity``), so packing, the transport and the engine's receive are all
        covered. Runs where ``create_request`` runs (a worker thread, overlapping the previous
        chunk's transfer)."""
        from weightsync.integrity import tensor_checksums

        request = self.create_request(chunk)
        try:
            request.checksums = tensor_checksums(chunk.tensors)
        except BaseException:
            self._release(request)
            raise
        return request

    async def close(self) -> None:  # noqa: B027
        """Release transport resources (process groups, shared buffers)."""


class WeightTransferReceiver(abc.ABC):
    """Receives one chunk's bytes and hands them to a loader. Lives in an engine worker.

    ``receive_and_load_weights`` is a template: it refuses a request of another strategy, has
    the loader validate the chunk's metadata before any byte moves (on a mismatch it calls
    ``refuse`` so a collective strategy's peers are released, then raises the
    ``WeightMismatchError``), and only then calls the strategy's ``_receive_and_load``. So no
    strategy can forget the check, and none repeats it.
    """

    request_cls: ClassVar[type[WeightUpdateRequest]] = WeightUpdateRequest

    async def receive_and_load_weights(
        self, request: WeightUpdateRequest, loader: WeightLoader
    ) -> None:
        if not isinstance(request, self.request_cls):
            raise ValueError(
                f"{type(self).__name__} expects a {self.request_cls.TYPE!r} request, got "
                f"{type(request).__name__}: sender and engine use different strategies"
            )
        try:
            if not (request.validated or self._known_valid(request, loader)):
                loader.validate(request.metas())
        except WeightMismatchError:
            try:
                await self.refuse(request)
            except Exception as e:  # the data plane is gone too; the mismatch is the news
                log.warning("refusing chunk %s failed: %s", request.chunk_index, e)
            raise
        await self._receive_and_load(request, loader)

    def _known_valid(self, request: WeightUpdateRequest, loader: WeightLoader) -> bool:
        """True when ``loader`` already accepted exactly this request's metadata (a receiver
        that caches decoded requests may know); the check is then not repeated."""
        return False

    @abc.abstractmethod
    async def _receive_and_load(self, request: WeightUpdateRequest, loader: WeightLoader) -> None:
        """Move the chunk's bytes (the metadata was validated) and ``loader.load_weights``
        them. A chunk that another engine refused raises without loading anything."""

    async def refuse(self, request: WeightUpdateRequest) -> None:  # noqa: B027
        """The endpoint will not load this chunk (an earlier chunk of the update failed, or it
        came without a start). A strategy with a control collective must still take part in
        it, voting no, so that the sender and the other engines are released; others do
        nothing. Must not raise for a group that works."""

    def parse_request(self, request_dict: dict) -> WeightUpdateRequest:
        """Rebuild a request from plain data; a request of another strategy is a ValueError."""
        req = WeightUpdateRequest.from_dict(request_dict)
        if not isinstance(req, self.request_cls):
            raise ValueError(
                f"{type(self).__name__} expects a {self.request_cls.TYPE!r} request, got "
                f"{request_dict.get('type')!r}: sender and engine use different strategies"
            )
        return req

    def close(self) -> None:  # noqa: B027
        """Release transport resources."""


# --------------------------------------------------------------------------------------------
# Strategy (factory)
# --------------------------------------------------------------------------------------------


class WeightTransferStrategy(abc.ABC):
    """Builds matching sender/receiver pairs. Constructed from a typed config (``config_cls``).

    ``create_sync_info`` and ``create_sender`` run in the sending process; ``create_sender`` also
    asks every engine (through the client) to build its receiver, so that both sides join the
    data plane together. ``create_receiver`` runs in each engine worker with its
    ``rank_offset``.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type] = object

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = cfg if cfg is not None else self.config_cls()

    @abc.abstractmethod
    async def create_sync_info(
        self, cfg: Any, inference_client: InferenceEngineClient
    ) -> WeightSyncInfo: ...

    @abc.abstractmethod
    async def create_sender(
        self, cfg: Any, inference_client: InferenceEngineClient, sync_info: WeightSyncInfo
    ) -> WeightTransferSender: ...

    @abc.abstractmethod
    async def create_receiver(
        self, cfg: Any, sync_info: WeightSyncInfo, rank_offset: int
    ) -> WeightTransferReceiver: ...

    @classmethod
    @abc.abstractmethod
    def get_request_type(cls) -> type[WeightUpdateRequest]: ...

    def config_dict(self) -> dict:
        from weightsync.config import config_to_dict

        return config_to_dict(self.cfg)

    def own_config(self, cfg: Any) -> Any:
        """The config a ``create_*`` call should use: ``cfg`` when it is this strategy's own
        config (``config_cls``), else the strategy's. Code written to the interface design
        passes its whole trainer config (a SkyRL ``DictConfig``) to these calls; the strategy's
        own settings came with its construction."""
        return cfg if isinstance(cfg, self.config_cls) else self.cfg


def _stamper(update_id: str, version: int | None) -> Any:
    def stamp(request: WeightUpdateRequest, index: int, is_last: bool) -> None:
        request.update_id = update_id
        request.chunk_index = index
        request.is_last = is_last
        request.version = version

    return stamp
