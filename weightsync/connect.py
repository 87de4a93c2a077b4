"""The front door: one object in the trainer that pushes weights into running engines.

    import weightsync as ws

    sync = await ws.connect(["http://127.0.0.1:8000"], strategy="broadcast", api_key=TOKEN)
    stats = await sync.push(model, version=step)    # every step
    await sync.close()                               # or: async with ws.connect(...) as sync:

Who calls it: the training process. ``connect`` returns a ``SyncSession`` (await it, or use it
as an ``async with``); ``connect_sync`` is the blocking twin for synchronous training loops (a
``BlockingSyncSession`` on a private event-loop thread, also a context manager).

``engines``: one or several of an ``http(s)://`` URL (a policy or reward server's control
plane), an in-process vLLM ``LLM`` / ``AsyncLLM`` (with the worker extension), a Ray actor handle
(``WeightSyncEngineMixin``), a ``LocalEngineProcess``, an in-process ``WeightUpdateEndpoint``,
or any ``weightsync.clients.Channel``. Several fan out in one push (``FanOutClient``).

``strategy``: a registered name (``"broadcast"``, ``"packed_cuda_ipc"``, ...), a preset name
(``"broadcast_nccl"``), a YAML path (a preset or a bare strategy mapping), a mapping
(``{"type": "broadcast", "backend": "gloo", "bucket_size_mb": 8}``) or a ``StrategyConfig``. When
a strategy with a ``backend`` (broadcast) is not told one, the backend follows the tensors: gloo
for CPU, NCCL for CUDA. It is read from the model at the first push (the sender is built then),
or at connect when ``device=`` is given; a complete config builds the sender at connect, so an
unreachable engine fails there.

``push(model_or_state_dict, version=, training_mode=)``: a model goes through the extractor its
kind needs (``weightsync.extractors.auto``: DeepSpeed -> ``deepspeed``, FSDP2 -> ``fsdp``, PEFT
with LoRA -> ``lora_merge``, else ``hf``; ``extractor=`` at connect overrides, as a name, a
config or an extractor object, e.g. a ``MegatronWeightExtractor(bridge=...)`` holding its
bridge, whose model is one Megatron module or the list of its chunks, or one written to the
interface design with only ``_extract_raw_weights`` returning a dict: extracted once a push,
the manifest read from that dict; its config saying nothing of ranks, it takes its role from
``connect``'s ``rank`` / ``src_rank``, ``weightsync.extractor_ranks``); a mapping of
name -> tensor is sent as given (names normalised to engine names, chunked by the strategy's
bucket size). The training mode (``TrainingMode`` / ``"head_only"`` / ...) is checked here
before anything moves, travels in the update's start, and the engines enforce it; head-only
pushes of a model send only the head. Returns ``SyncStats`` (bytes, chunks, tensors, seconds,
the version each engine serves, the engines' names). ``connect(..., delta=True)`` (or ``push(...,
delta=True)``) sends only what changed since the version the engines serve, exactly, with a
full update when an engine cannot apply it (``weightsync.delta``; ``stats.delta`` says how it
went). ``push_chunks(chunks, manifest, ...)`` sends
chunks the caller made (engine names, an iterable or a stream) the same way, on the sending
rank.

After a failed push the session stays usable where the transport allows:

* a refusal (``WeightMismatchError``, a stale version, an engine that is torn or refuses the
  call: ``UpdateRefusedError`` / ``UpdateIncompleteError``) moved nothing on the data plane:
  the next push goes out on the same group;
* anything else (an engine died, a timeout, a broken collective, another sender took a
  server's receivers, a cancelled push) drops the sender: the next push builds a new group with
  the same engines. If an engine is gone for good that push fails with ``EngineDiedError``
  naming it: connect again without it.

Sharded trainers (FSDP2, DeepSpeed ZeRO, Megatron): every training rank calls ``connect`` and
``push`` in lockstep with the same arguments. Only the sending rank (``is_sender``, default ``rank ==
src_rank``; ``rank`` defaults to ``torch.distributed``'s) reaches the engines; the others join
the extractor's gathers and ``push`` returns None there. An unsharded model is pushed by the
sending rank alone (the others return None at once). With an IPC strategy (``cuda_ipc``,
``packed_cuda_ipc``) and a sharded model on more than one rank, every rank keeps the gathered
tensors and sends handles to its own copy (``every_rank``, ``strategies/_every_rank.py``): rank
0 gathers them with ``all_gather_object`` and talks to the engines, and each engine worker reads
the copy on its own GPU (a hybrid engine never pulls every byte from rank 0's GPU);
``every_rank: false`` in the strategy config turns it off, ``every_rank: true`` turns it on for
any model pushed on every rank (each rank its own replica, e.g. data parallel).

The low-level path stays for power users: ``build_strategy`` -> ``create_sync_info`` ->
``create_sender`` -> ``send_chunks`` over a ``FanOutClient``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync._runtime import trace
from weightsync.config import (
    DEFAULT_BUCKET_MB,
    broadcast_backend,
    resolve_extractor,
    resolve_strategy,
    strategy_needs_backend,
)
from weightsync.errors import (
    CommunicatorReplacedError,
    UpdateIncompleteError,
    UpdateRefusedError,
    WeightMismatchError,
)
from weightsync.extractor_ranks import (
    EVERY_RANK_STRATEGIES,
    SHARDED_KINDS,
    adopt_sender,
    runs_on_every_rank,
    send_from_every_rank,
)
from weightsync.raw_weights import discard_prepared, update_manifest
from weightsync.types import SyncStats, TensorMeta, TrainingMode

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.clients import FanOutClient

#: failures after which the data plane is still in step: the session keeps its sender
_REFUSALS = (WeightMismatchError, ValueError, UpdateRefusedError, UpdateIncompleteError)


def connect(
    engines: Any,
    strategy: Any = "broadcast",
    *,
    api_key: str | None = None,
    extractor: Any = None,
    device: str | None = None,
    timeout_s: float | None = None,
    rank: int | None = None,
    src_rank: int = 0,
    is_sender: bool | None = None,
    names: Sequence[str] | None = None,
    delta: bool = False,
    quantize: Any = None,
) -> Connecting:
    """Connect the trainer to ``engines`` (see the module docstring). Await the result for a
    ``SyncSession``, or use it as ``async with connect(...) as sync``. ``delta``: every push
    sends only what changed since the engines' version (``push(..., delta=)`` per push).
    ``quantize``: the engines serve an FP8 checkpoint: its directory (or a
    ``weightsync.fp8.Fp8Layout``); every push is quantised to it on the sending rank, on the
    tensors' device (``weightsync.fp8``)."""
    return Connecting(lambda: SyncSession.open(
        engines, strategy, api_key=api_key, extractor=extractor, device=device,
        timeout_s=timeout_s, rank=rank, src_rank=src_rank, is_sender=is_sender, names=names,
        delta=delta, quantize=quantize,
    ))


def connect_sync(engines: Any, strategy: Any = "broadcast", **kwargs: Any) -> BlockingSyncSession:
    """``connect`` for synchronous code: a ``BlockingSyncSession`` (``push``, ``close``, a
    context manager) whose calls run on a private event-loop thread."""
    return BlockingSyncSession(engines, strategy, **kwargs)


class Connecting:
    """What ``connect`` returns: awaitable (-> ``SyncSession``) and an async context manager
    (closes the session on exit)."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._session: SyncSession | None = None

    def __await__(self) -> Generator[Any, None, SyncSession]:
        return self._open().__await__()

    async def _open(self) -> SyncSession:
        if self._session is None:
            self._session = await self._make()
        return self._session

    async def __aenter__(self) -> SyncSession:
        return await self._open()

    async def __aexit__(self, *exc: Any) -> None:
        if self._session is not None:
            await self._session.close()


class SyncSession:
    """A trainer's connection to its engines (build it with ``connect``)."""

    def __init__(
        self, *, client: FanOutClient | None, strategy_cfg: dict[str, Any],
        extractor_cfg: dict[str, Any] | None, device: str | None, rank: int, src_rank: int,
        is_sender: bool, extractor: Any = None, delta: bool = False, fp8: Any = None,
    ) -> None:
        self.client = client
        self.strategy_cfg = strategy_cfg
        self.extractor_cfg = extractor_cfg
        self.device = device
        self.rank, self.src_rank, self.is_sender = rank, src_rank, is_sender
        self.strategy: Any = None
        self.sender: Any = None
        self.closed = False
        # (key, extractor, the model it is for: kept alive so its id is not reused)
        self._extractor: tuple[tuple, Any, Any] | None = None
        # whether the model held its update at the last push that looked (a model whose
        # tensors are replaced every step is compared first, not while the call travels: a
        # failed check there costs the engines a refused update)
        self._held_last = True
        self.given_extractor = extractor  # an extractor object given to connect, used as is
        self.delta = bool(delta)  # pushes are delta updates unless a push says otherwise
        # every training rank sends its own copy (IPC every_rank); None: decided at the first push
        self.every_rank: bool | None = None
        self.tracker: Any = None  # weightsync.delta.DeltaTracker, made at the first delta push
        self.fp8 = fp8  # weightsync.fp8.Fp8Layout: the engines serve FP8; every push quantised
        self._sharded: tuple[Any, bool] | None = None  # (model, whether it is sharded)

    @classmethod
    async def open(
        cls, engines: Any, strategy: Any, *, api_key: str | None, extractor: Any,
        device: str | None, timeout_s: float | None, rank: int | None, src_rank: int,
        is_sender: bool | None, names: Sequence[str] | None, delta: bool = False,
        quantize: Any = None,
    ) -> SyncSession:
        from weightsync.fp8 import resolve_layout

        fp8 = resolve_layout(quantize)  # a bad directory fails here, before any connection
        if fp8 is not None and delta:
            raise ValueError("connect: delta=True with quantize (FP8 engines): not supported; "
                             "push full updates")
        strategy_cfg = resolve_strategy(strategy)
        if timeout_s is not None:
            strategy_cfg["timeout_s"] = float(timeout_s)
        given = extractor if callable(getattr(extractor, "extract_weights", None)) else None
        extractor_cfg = None if given is not None else resolve_extractor(extractor)
        rank = _default_rank() if rank is None else int(rank)
        sender = (rank == int(src_rank)) if is_sender is None else bool(is_sender)
        client = None
        if sender:
            from weightsync.clients import FanOutClient
            from weightsync.config import build_strategy

            targets = [engines] if isinstance(engines, str) or not isinstance(
                engines, (list, tuple)) else list(engines)
            limits = build_strategy(strategy_cfg).cfg  # the strategy's timeouts, defaults filled
            client = FanOutClient(
                targets, api_key=api_key, names=names, timeout_s=limits.timeout_s,
                timeout_s_per_gb=limits.timeout_s_per_gb, join_timeout_s=limits.join_timeout_s,
            )
        if given is not None:
            adopt_sender(given, sender, rank, int(src_rank))
        session = cls(client=client, strategy_cfg=strategy_cfg, extractor_cfg=extractor_cfg,
                      device=device, rank=rank, src_rank=int(src_rank), is_sender=sender,
                      extractor=given, delta=delta, fp8=fp8)
        # every_rank may apply (an IPC strategy on several ranks): the first push decides,
        # and then every rank builds its sender there, in lockstep
        undecided = (strategy_cfg.get("type") in EVERY_RANK_STRATEGIES and _world_size() > 1
                     and strategy_cfg.get("every_rank") is not False)
        if sender and not undecided and (
                device is not None or not strategy_needs_backend(strategy_cfg)):
            try:
                await session._ensure_sender(device)
            except BaseException:
                await session.close()
                raise
        return session

    # -- the one call ----------------------------------------------------------------------------
    async def push(
        self,
        model_or_state_dict: Any,
        *,
        version: int | None = None,
        training_mode: TrainingMode | str | None = None,
        head_name_patterns: Sequence[str] | None = None,
        dtype: Any = None,
        delta: bool | None = None,
    ) -> SyncStats | None:
        """One update of every engine (see the module docstring). ``dtype``: cast floating
        tensors to it before sending (e.g. the engine's served dtype). ``delta`` (default: the
        session's): send only what changed since the version the engines serve
        (``weightsync.delta``; ``stats.delta`` says how it went). Returns the stats on the
        sending rank, None on the others."""
        if self.closed:
            raise RuntimeError("this weight-sync session is closed; connect again")
        from weightsync.types import str_to_dtype

        trace.mark("push.begin", version=version)
        try:
            as_delta = self.delta if delta is None else bool(delta)
            mode = TrainingMode.parse(training_mode) if training_mode is not None else None
            heads = _head_patterns(mode, head_name_patterns)
            cast = str_to_dtype(dtype) if isinstance(dtype, str) else dtype
            if _is_tensor_mapping(model_or_state_dict):
                if not self.is_sender:
                    return None
                return await self._push_tensors(model_or_state_dict, version, mode, heads, cast,
                                                as_delta)
            return await self._push_model(model_or_state_dict, version, mode, heads, cast,
                                          as_delta)
        finally:
            trace.mark("push.end")
            trace.flush()

    async def _push_model(
        self, model: Any, version: int | None, mode: TrainingMode | None,
        heads: list[str] | None, dtype: Any, delta: bool, *, reuse: bool = True,
    ) -> SyncStats | None:
        from weightsync.extractors.auto import device_of
        from weightsync.pipeline import send_extracted

        t0 = time.perf_counter()
        laps: dict[str, float] = {}
        # an unchanged model's last chunks (views of its own tensors): nothing to extract, and
        # its kind (so its extractor) cannot have changed: wrapping it in place (FSDP2),
        # injecting an adapter or replacing a tensor changes what the extractor holds
        asked, held = self._held_extractor(model, mode, heads, dtype) if reuse else (None, None)
        # a plain update's held chunks are compared with the model while its engines' call is
        # on its way (``_send_held``); a delta's or an FP8 one's first, and any while the model
        # did not hold its update at the last look
        deferred = held is not None and not delta and self.fp8 is None and self._held_last
        if held is not None and not deferred:
            self._held_last = asked.check_held(model, dtype)
            if not self._held_last:
                held = None
        ext = asked if held is not None else self._extractor_for(model, mode, heads)
        if not self.is_sender and not self.every_rank and not self._on_every_rank(ext, model):
            return None  # nothing to gather: the sending rank pushes alone
        if self.every_rank and delta:
            raise ValueError("push: delta=True with every_rank IPC; push full updates (delta "
                             "sync from every training rank is not supported)")
        adapter = _adapter_of(ext, model, delta)
        if (reuse and held is None and ext is not asked
                and self.is_sender and not self.every_rank):  # (one asked above holds nothing)
            held = ext.held_update(model, dtype)
        # the same on every rank, and made on every rank (megatron's first one is an export;
        # a design-style extractor's dict is extracted here, once, and sent below)
        manifest = held[1] if held is not None else await update_manifest(ext, model, dtype)
        if adapter is None:
            try:
                _check_mode(manifest, mode, heads)  # every rank refuses alike, before any gather
            except BaseException:
                discard_prepared(ext)
                raise

        async def send(stream: Any) -> SyncStats:
            t1 = time.perf_counter()
            trace.mark("push.prepared")  # the laps of SyncStats.front_ms
            await self._ensure_sender(_device_name(device_of(model)))
            t2 = time.perf_counter()
            trace.mark("push.sender_ready")
            laps.update(prepare=(t1 - t0) * 1e3, sender=(t2 - t1) * 1e3)
            out = await self._send(stream(), manifest, version, mode, heads, delta,
                                   lora_adapter=adapter)
            laps["send"] = (time.perf_counter() - t2) * 1e3
            trace.mark("push.sent")
            return out

        if held is not None and deferred:
            try:
                stats = await _send_held(send, held[0], lambda: ext.check_held(model, dtype))
            except _ModelChanged:  # the model changed since its last push: extract it
                self._held_last = False
                return await self._push_model(model, version, mode, heads, dtype, delta,
                                              reuse=False)
        elif held is not None:
            stats = await send(lambda: held[0])
        else:
            stats = await send_extracted(ext, model, dtype, send)
        if stats is not None and laps:
            stats.front_ms = {**laps, "total": (time.perf_counter() - t0) * 1e3}
        return stats if self.is_sender else None  # every_rank: every rank sent, rank 0 reports

    def _decide_every_rank(self, lockstep: Callable[[], bool]) -> bool:
        """Whether every training rank sends its own copy (the IPC strategies' ``every_rank``
        mode; decided at the first push, then fixed for the session): as the strategy config
        says when it says; otherwise yes for an IPC strategy, a sharded model (an extractor
        that runs on every rank) and more than one rank, the interface design's layout for
        sharded trainers (each engine worker reads the copy on its own GPU)."""
        if self.every_rank is not None:
            return self.every_rank
        given = self.strategy_cfg.get("every_rank")
        if given is not None:
            decided = bool(given)
        else:
            decided = (self.strategy_cfg.get("type") in EVERY_RANK_STRATEGIES
                       and _world_size() > 1 and lockstep())
        if decided and self.src_rank != 0:
            raise ValueError(f"connect: every_rank IPC sends through training rank 0, but "
                             f"src_rank is {self.src_rank}; use src_rank=0 or every_rank: false")
        self.every_rank = decided
        if decided:
            self.strategy_cfg["every_rank"] = True
        return decided

    def _held_extractor(self, model: Any, mode: TrainingMode | None,
                        heads: list[str] | None, dtype: Any) -> tuple[Any, Any]:
        """``(the extractor kept for this model, mode and head patterns, the update it holds
        for it)``, the update not yet compared with the model now (the caller compares them,
        ``check_held``: one pass over the model's tables, instead of finding its kind again
        and then extracting); else ``(None, None)``. The sending rank only, without
        ``every_rank``."""
        kept = self._extractor if self.given_extractor is None else None
        if kept is None or not self.is_sender or self.every_rank:
            return None, None
        (model_id, _kind, kept_mode, kept_heads), ext, _model = kept
        if (model_id != id(model) or kept_mode != mode
                or kept_heads != (tuple(heads) if heads is not None else None)):
            return None, None
        return ext, ext.held_update(model, dtype, check=False)

    def _extractor_for(self, model: Any, mode: TrainingMode | None,
                       heads: list[str] | None) -> Any:
        """The extractor given to ``connect``, else one per model and training mode, kept
        across pushes: it remembers what it extracted (an unchanged model's chunks and manifest
        are not rebuilt every step)."""
        if self.given_extractor is not None:
            given = self.given_extractor
            if self._decide_every_rank(lambda: self._on_every_rank(given, model)):
                send_from_every_rank(self.given_extractor)
            return self.given_extractor
        from weightsync.config import build_extractor
        from weightsync.extractors.auto import extractor_config_for, model_kind
        from weightsync.registry import EXTRACTORS

        # the model's kind picks the extractor only when connect named none (finding it walks
        # every module: not paid on every push when the extractor is given)
        kind = model_kind(model) if self.extractor_cfg is None else None
        key = (id(model), kind, mode, tuple(heads) if heads is not None else None)
        if self._extractor is None or self._extractor[0] != key:
            if self.extractor_cfg is not None:
                cfg = {**self.extractor_cfg, "is_sender": self.is_sender}
                if getattr(EXTRACTORS.get(str(cfg.get("type", "hf"))), "lockstep", False):
                    cfg.setdefault("rank", self.rank)
                    cfg.setdefault("src_rank", self.src_rank)
            else:
                cfg = extractor_config_for(
                    model, bucket_size_mb=float(self.strategy_cfg.get("bucket_size_mb", DEFAULT_BUCKET_MB)),
                    rank=self.rank, src_rank=self.src_rank, is_sender=self.is_sender,
                    head_name_patterns=heads if mode is TrainingMode.HEAD_ONLY else None,
                )
            if kind is not None:  # known already: not walked again
                self._sharded = (model, kind in SHARDED_KINDS)
            cls = EXTRACTORS.get(str(cfg.get("type", "hf")))
            if self._decide_every_rank(lambda: self._on_every_rank(cls, model)):
                cfg["is_sender"] = True  # every rank keeps the gathered tensors and sends them
            self._extractor = (key, build_extractor(cfg), model)
        return self._extractor[1]

    def _on_every_rank(self, extractor: Any, model: Any) -> bool:
        """Whether every rank runs ``extractor`` on ``model`` (``extractor_ranks``); a
        model's kind is read once while the same model is pushed."""
        if getattr(extractor, "lockstep", False):
            return True
        seen = self._sharded
        if seen is None or seen[0] is not model:
            seen = self._sharded = (model, runs_on_every_rank(extractor, model))
        return seen[1]

    async def _push_tensors(
        self, tensors: Any, version: int | None, mode: TrainingMode | None,
        heads: list[str] | None, dtype: Any, delta: bool,
    ) -> SyncStats:
        from weightsync.extractors.auto import device_of
        from weightsync.naming import NamingError, engine_names
        from weightsync.pipeline import make_chunks

        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        if not items:
            raise ValueError("push: nothing to send (an empty mapping)")
        try:
            mapping = engine_names(n for n, _ in items)
        except NamingError as e:
            raise WeightMismatchError([str(e)], target="update") from None
        named = [(mapping[n], _cast(t.detach(), dtype)) for n, t in items if n in mapping]
        chunks = list(make_chunks(named, bucket_size_mb=float(
            self.strategy_cfg.get("bucket_size_mb", DEFAULT_BUCKET_MB))))
        manifest = [m for c in chunks for m in c.metas()]
        return await self._send_made(chunks, manifest, version, mode, heads,
                                     _device_name(device_of(named)), delta)

    async def push_chunks(
        self,
        chunks: Any,
        manifest: Sequence[TensorMeta],
        *,
        version: int | None = None,
        training_mode: TrainingMode | str | None = None,
        head_name_patterns: Sequence[str] | None = None,
        device: str | None = None,
        lora_adapter: Mapping[str, Any] | None = None,
    ) -> SyncStats:
        """One update of every engine from chunks the caller made: ``chunks`` an iterable or
        async iterable of ``WeightChunk`` under engine names, taken as the sender asks for
        them (a stream keeps only a few buckets alive); ``manifest`` every tensor it carries.
        The training mode is checked against the manifest here and by the engines, and a
        failure leaves the session as ``push`` does. ``device``: where the tensors live, for
        a strategy whose backend follows them (default: CPU). ``lora_adapter``
        (``LoRAAdapterSpec.to_dict()``): the chunks are a LoRA adapter's A/B under PEFT's
        names (``weightsync.lora_adapter``). The sending rank only; the reward client streams
        its updates this way, the ``remote`` loader relays them."""
        if self.closed:
            raise RuntimeError("this weight-sync session is closed; connect again")
        if not self.is_sender:
            raise RuntimeError(
                f"push_chunks: rank {self.rank} is not the sending rank ({self.src_rank}); only "
                f"the sending rank has chunks to send (use push for a sharded model)")
        mode = TrainingMode.parse(training_mode) if training_mode is not None else None
        heads = _head_patterns(mode, head_name_patterns)
        trace.mark("push.begin", version=version, chunks_given=True)
        try:
            return await self._send_made(chunks, list(manifest), version, mode, heads, device,
                                         self.delta, lora_adapter=lora_adapter)
        finally:
            trace.mark("push.end")
            trace.flush()

    async def _send_made(
        self, chunks: Any, manifest: list[TensorMeta], version: int | None,
        mode: TrainingMode | None, heads: list[str] | None, device: str | None, delta: bool,
        *, lora_adapter: Mapping[str, Any] | None = None,
    ) -> SyncStats:
        if lora_adapter is None:
            _check_mode(manifest, mode, heads)
        elif not manifest:
            raise WeightMismatchError(["nothing to send: the adapter update has no tensors"],
                                      target="update")
        await self._ensure_sender(device)
        return await self._send(chunks, manifest, version, mode, heads, delta,
                                lora_adapter=dict(lora_adapter) if lora_adapter else None)

    async def _send(
        self, chunks: Any, manifest: list[Any], version: int | None, mode: TrainingMode | None,
        heads: list[str] | None, delta: bool, *, lora_adapter: dict | None = None,
    ) -> SyncStats:
        """One update through the sender: plain, or through the delta tracker (which sends
        the delta, or a full update the engines keep as the base of later deltas).
        ``lora_adapter``: a LoRA adapter-only update (plain; the base weights and so the delta
        tracker's base do not change)."""
        if lora_adapter is not None:
            return await self._send_once(chunks, manifest, version, mode, heads, None,
                                         lora_adapter=lora_adapter)
        if self.fp8 is not None:
            if delta:
                raise ValueError("push: delta=True into FP8 engines (connect's quantize) is "
                                 "not supported; push full updates")
            chunks, manifest = self.fp8.quantize_chunks(chunks), self.fp8.manifest(manifest)
        if not delta:
            if self.tracker is not None:
                self.tracker.forget()
            return await self._send_once(chunks, manifest, version, mode, heads, None)
        if self.tracker is None:
            from weightsync.delta import DeltaTracker

            self.tracker = DeltaTracker(
                bucket_size_mb=float(self.strategy_cfg.get("bucket_size_mb", DEFAULT_BUCKET_MB)),
                checksum=bool(self.strategy_cfg.get("checksum", False)))

        async def send(wire: Any, metas: list[Any], delta: dict) -> SyncStats:
            return await self._send_once(wire, metas, version, mode, heads, delta)

        try:
            return await self.tracker.send(send, chunks, manifest)
        except BaseException:
            self.tracker.forget()
            raise

    async def _send_once(
        self, chunks: Any, manifest: list[Any], version: int | None, mode: TrainingMode | None,
        heads: list[str] | None, delta: dict | None, *, lora_adapter: dict | None = None,
    ) -> SyncStats:
        assert self.sender is not None and (self.client is not None or self.every_rank)
        extra = {"lora_adapter": lora_adapter} if lora_adapter is not None else {}
        try:
            stats = await self.sender.send_chunks(
                chunks, self.client, version=version, manifest=manifest, training_mode=mode,
                head_name_patterns=heads, delta=delta, **extra,
            )
        except BaseException as e:
            if isinstance(e, CommunicatorReplacedError) or not isinstance(e, _REFUSALS):
                await self._drop_sender()  # the group is gone or out of step: rebuild next time
            raise
        stats.engines = self.client.names if self.client is not None else []
        return stats

    # -- the sender ------------------------------------------------------------------------------
    async def _ensure_sender(self, device: str | None) -> None:
        """Build the sender (the sending rank; with every_rank every rank, in lockstep: rank 0
        with the engines' client, the others without)."""
        if self.sender is not None:
            return
        from weightsync.config import build_strategy

        assert self.client is not None or self.every_rank
        cfg = dict(self.strategy_cfg)
        if strategy_needs_backend(cfg):
            cfg["backend"] = broadcast_backend(device)
        strategy = build_strategy(cfg)
        info = await strategy.create_sync_info(strategy.cfg, self.client)
        self.sender = await strategy.create_sender(strategy.cfg, self.client, info)
        self.strategy = strategy

    async def _drop_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is None:
            return
        for step in (sender.close(), self.client.close_weight_transfer() if self.client else None):
            if step is not None:
                try:
                    await step
                except Exception:  # noqa: BLE001 - already failing; the first error is the news
                    pass

    # -- beyond push -----------------------------------------------------------------------------
    async def status(self) -> list[dict[str, Any]]:
        """Every engine's state, served version, last error and update in progress."""
        if self.client is None:
            return []
        return await self.client.status()

    async def close(self) -> None:
        """Tear down the receivers on every engine (best effort) and the sender, and release
        the connections. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        await self._drop_sender()
        if self.client is not None:
            await self.client.aclose()

    async def __aenter__(self) -> SyncSession:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        where = self.client.names if self.client is not None else "(not the sending rank)"
        return f"SyncSession({self.strategy_cfg.get('type')!r} -> {where})"


class BlockingSyncSession:
    """``SyncSession`` for synchronous code: every call runs on one private event-loop thread
    (so the sender's state stays on one loop). ``push`` / ``status`` / ``close`` block; use it
    as a context manager or call ``close``."""

    def __init__(self, engines: Any, strategy: Any = "broadcast", **kwargs: Any) -> None:
        from weightsync._runtime.threads import LoopThread

        self._loop = LoopThread("weightsync-connect")
        try:
            self.session: SyncSession = self._loop.run(_open(connect(engines, strategy, **kwargs)))
        except BaseException:
            self._loop.close()
            raise

    def push(self, model_or_state_dict: Any, **kwargs: Any) -> SyncStats | None:
        return self._loop.run(self.session.push(model_or_state_dict, **kwargs))

    def status(self) -> list[dict[str, Any]]:
        return self._loop.run(self.session.status())

    def close(self) -> None:
        if self._loop.started:
            try:
                self._loop.run(self.session.close())
            finally:
                self._loop.close()

    def __enter__(self) -> BlockingSyncSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _default_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_tensor_mapping(x: Any) -> bool:
    if isinstance(x, Mapping):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in x)
    return False


def _head_patterns(mode: TrainingMode | None, given: Sequence[str] | None) -> list[str] | None:
    if given is not None:
        return list(given)
    if mode is TrainingMode.HEAD_ONLY:
        from weightsync.naming import DEFAULT_HEAD_NAME_PATTERNS

        return list(DEFAULT_HEAD_NAME_PATTERNS)
    return None


class _ModelChanged(ValueError):
    """The held update's chunks are not the model's tensors any more (raised inside the
    stream, before its first chunk: the engines refuse the update, the group stays in step)."""


class _HeldStream:
    """A held update's chunks, handed out once ``verdict`` says the model still holds them
    (else ``_ModelChanged``). ``ready_made``: taking them touches no device, so a streamed
    sender may take the first one before its engines voted (``StreamFeed``'s ``early``)."""

    ready_made = True

    def __init__(self, chunks: list[Any], verdict: asyncio.Future) -> None:
        self.chunks, self.verdict = chunks, verdict

    async def __aiter__(self) -> AsyncIterator[Any]:
        if not await self.verdict:
            raise _ModelChanged("the model changed since its held update was made")
        for chunk in self.chunks:
            yield chunk


async def _send_held(send: Callable[[Callable[[], Any]], Awaitable[Any]], chunks: list[Any],
                     holds: Callable[[], bool]) -> Any:
    """Send a held update (views of the model's own tensors) and compare the model with it
    (``holds``) meanwhile: the send runs up to its first wait (its engines' call issued, the
    engines starting their update) before the model is looked at, and no chunk leaves before
    the answer (the stream's first step waits for it). -> the send's stats; ``_ModelChanged``
    when the model no longer holds the update (nothing was sent; the engines refused it)."""
    verdict: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(send(lambda: _HeldStream(chunks, verdict)))
    await asyncio.sleep(0)  # the send's first step: its engines' call leaves
    try:
        verdict.set_result(bool(holds()))
    except BaseException as e:  # noqa: BLE001 - the stream raises it, so the send fails with it
        verdict.set_exception(e)
    trace.mark("push.held.checked", held=verdict.exception() is None and verdict.result())
    try:
        return await task
    finally:
        if verdict.done() and not verdict.cancelled():
            verdict.exception()  # retrieved even when the stream never asked for it


def _adapter_of(ext: Any, model: Any, delta: bool) -> dict | None:
    """The ``lora_adapter`` of an update made by an adapter extractor (``lora_adapter``), else
    None; refused with ``delta`` (an adapter is sent whole: it is small)."""
    spec_of = getattr(ext, "adapter_spec", None)
    if spec_of is None:
        return None
    if delta:
        raise ValueError("push: delta=True with the lora_adapter extractor; an adapter update is "
                         "sent whole (it is small), push it with delta=False")
    return spec_of(model).to_dict()


def _check_mode(manifest: list[Any], mode: TrainingMode | None, heads: list[str] | None) -> None:
    """The update's names against its training mode, here, before anything moves (the engines
    check again)."""
    if not manifest:
        raise WeightMismatchError(["nothing to send: the update selects no tensors"],
                                  target="update")
    if mode is None:
        return
    from weightsync.validation import training_mode_offenders

    offenders = training_mode_offenders([m.name for m in manifest], mode, heads, whole_update=True)
    if offenders:
        raise WeightMismatchError(offenders, target=f"{mode.value} update")


def _cast(t: Any, dtype: Any) -> Any:
    if dtype is None or t.dtype == dtype or not t.is_floating_point():
        return t
    return t.to(dtype)


def _device_name(device: Any) -> str | None:
    return None if device is None else str(getattr(device, "type", device))


async def _open(connecting: Awaitable[SyncSession]) -> SyncSession:
    return await connecting
