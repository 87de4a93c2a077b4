"""``RewardModelPublisher``: push a reward model's trained weights to a reward server, mode-aware.

Who calls: the training loop, on every training rank (build one publisher per rank with the same
arguments). ``publish(state_dict, version, *, training_mode=FULL)`` runs one update and blocks;
``publish_async`` is its coroutine twin. ``state_dict`` is a mapping (or ``(name, tensor)``
pairs), or the model itself (``torch.nn.Module``), which lets the publisher stream it:

1. **Select** what the mode says (engine names; ``weightsync.reward.selection``): HEAD_ONLY ->
   only head tensors (``head_name_patterns``, default ``score.``, ``classifier.``,
   ``lm_head.``, ``v_head.``; a state dict with more keeps the head and warns with what it
   dropped, as the reference publisher filters); LORA ->
   merged backbone + head (a PEFT model is merged on the way by the ``lora_merge`` extractor; a
   state dict must already be merged, ``merge_and_unload().state_dict()``: unmerged
   ``lora_A``/``lora_B`` are refused, never dropped); FULL -> every tensor. A model goes through
   an extractor chosen from what it is: FSDP2 (DTensor parameters) -> ``fsdp``, DeepSpeed
   ZeRO-3 -> ``deepspeed`` (both merge PEFT LoRA layers as they gather), anything else (HF,
   PEFT) -> ``lora_merge``. Names are normalised (PEFT / FSDP / DDP wrappers stripped) and
   sorted naturally, so the same tensors always travel in the same order.
2. **Check, before any byte moves** (metadata only: no gather, nothing changed), and raise
   ``WeightMismatchError`` listing every offender: HEAD_ONLY without a head, FULL or LORA
   without backbone weights, unmerged LoRA tensors, a mode that contradicts the model (LORA
   without adapters, FULL with active adapters), names (and shapes) the engine does not know
   (when ``engine_metadata`` is given; the server checks its own manifest again at start).
3. **Send** on the sending rank only, as the reward spec does it: announce the batch on the
   control plane (``extra={"training_mode": ...}``), broadcast each tensor from ``src_rank``
   through the tensor communicator, barrier, finalize (``weightsync.distributed``), chunk by
   chunk as they are extracted: the whole model is never collected in memory (at most a few
   buckets of ``bucket_size_mb`` are alive). The planes: a ``ControlPlane`` and a
   ``TensorCommunicator`` as given; for a ``VLLMRewardClient`` (``comm=None``) the vLLM
   adapters over it (its own strategy); for an ``InferenceEngineClient`` with ``comm`` (a
   ``WeightTransferStrategy`` config/instance or a wired ``WeightTransferSender``) the same
   adapters over that sender.

Ranks: ``src_rank`` sends; other ranks take part only in the extraction collectives of a
sharded model (and return None at once for an unsharded one). With ``rank0_only=True`` ranks
other than 0 return at once; a sharded model is then refused on every rank (rank 0 alone cannot
gather it). If the sending rank fails before or during extraction, it still runs its part of
the remaining gathers, so the other ranks never hang in a collective.

Sync and async: ``publish`` blocks (the design's flavour), ``publish_async`` is the coroutine;
``close`` is a coroutine, ``close_sync`` its blocking twin (the package's one rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from weightsync._runtime.threads import LoopThread
from weightsync.config import DEFAULT_BUCKET_MB
from weightsync.errors import WeightMismatchError
from weightsync.pipeline import send_extracted
from weightsync.reward.selection import (
    check_options,
    check_update,
    expected_metadata,
    select_params,
)
from weightsync.reward.types import DEFAULT_HEAD_NAME_PATTERNS, RewardModelTrainingMode
from weightsync.types import TensorMeta, dtype_to_str, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.interfaces import InferenceEngineClient, SyncStats, WeightExtractor

T = TypeVar("T")


class RewardModelPublisher:
    """See the module docstring.

    ``control`` / ``comm``: the reward spec's ``ControlPlane`` and ``TensorCommunicator``
    (e.g. ``VllmControlPlane(client)``, ``VllmTensorCommunicator(client)``); or a
    ``VLLMRewardClient`` and None (its vLLM adapters are built); or an
    ``InferenceEngineClient`` and a strategy (config mapping / YAML path / instance) or a
    ``WeightTransferSender`` already wired to the engines. ``src_rank``: the rank that sends
    (``comm.rank`` for the spec's planes). ``head_name_patterns``: the head (default
    ``DEFAULT_HEAD_PATTERNS``: the plan's ``score.``, ``classifier.``, ``lm_head.``, and TRL's
    ``v_head.``). ``engine_metadata``:
    what the engine accepts (``{name: TensorMeta}``, a list of ``TensorMeta``, or a checkpoint
    directory whose safetensors headers are read): unknown names / wrong shapes are refused
    locally. ``dtype``: cast floating tensors to this dtype (e.g. the served dtype).
    ``unmerged_lora``: ``"refuse"`` (ours) or ``"skip"`` (the reference's: unmerged LoRA
    tensors of a state dict dropped with a warning outside LORA; ``weightsync.reward.selection``).
    """

    DEFAULT_HEAD_PATTERNS = list(DEFAULT_HEAD_NAME_PATTERNS)

    def __init__(
        self,
        control: Any,
        comm: Any = None,
        src_rank: int = 0,
        head_name_patterns: Sequence[str] | None = None,
        *,
        rank: int | None = None,
        rank0_only: bool = False,
        engine_metadata: Any = None,
        dtype: Any = None,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        timeout_s: float = 600.0,
        unmerged_lora: str = "refuse",
    ) -> None:
        self.unmerged_lora, _ = check_options(unmerged_lora, "drop")
        self.control = control
        self.comm = comm
        self.src_rank = int(src_rank)
        self.head_name_patterns = list(head_name_patterns or self.DEFAULT_HEAD_PATTERNS)
        self._rank = rank
        self.rank0_only = rank0_only
        if rank0_only and self.src_rank != 0:
            raise ValueError(f"rank0_only=True needs src_rank=0, got src_rank={self.src_rank}")
        self.expected = expected_metadata(engine_metadata)
        self.dtype = str_to_dtype(dtype) if isinstance(dtype, str) else dtype
        self.bucket_size_mb = bucket_size_mb
        self.timeout_s = timeout_s
        self.last_extractor: WeightExtractor | None = None
        self._built: tuple[Any, Any] | None = None  # (control plane, tensor communicator)
        self._twin = LoopThread("weightsync-publisher")  # runs the blocking twins

    # -- ranks ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self._rank is not None:
            return int(self._rank)
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            return 0
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def is_sender(self) -> bool:
        return self.rank == self.src_rank

    # -- the one call ---------------------------------------------------------------------------
    def publish(
        self,
        state_dict: Any,
        version: int | None = None,
        *,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> SyncStats | None:
        """One update (see the module docstring); blocks until the server serves it. Returns
        the ``SyncStats`` on the sending rank, None elsewhere. Bad input raises
        ``WeightMismatchError`` and sends nothing."""
        mode = RewardModelTrainingMode.parse(training_mode)
        named = self._select(state_dict, mode)  # in the caller's thread: its errors, warnings
        return self._run(self._publish(state_dict, named, mode, version))

    async def publish_async(
        self,
        state_dict: Any,
        version: int | None = None,
        *,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> SyncStats | None:
        """Coroutine twin of ``publish``."""
        mode = RewardModelTrainingMode.parse(training_mode)
        return await self._publish(state_dict, self._select(state_dict, mode), mode, version)

    def _select(
        self, state_dict: Any, mode: RewardModelTrainingMode
    ) -> list[tuple[str, torch.Tensor]] | None:
        """The selected tensors of a state dict on the sending rank; None for a model (it is
        streamed) or on a rank that sends nothing."""
        if _is_module(state_dict) or not self.is_sender or (self.rank0_only and self.rank != 0):
            return None
        return select_params(state_dict, mode, self.head_name_patterns, dtype=self.dtype,
                             expected=self.expected, unmerged_lora=self.unmerged_lora)

    async def _publish(
        self, state_dict: Any, named: list[tuple[str, torch.Tensor]] | None,
        mode: RewardModelTrainingMode, version: int | None,
    ) -> SyncStats | None:
        if self.rank0_only and self.rank != 0 and not _sharding(state_dict):
            return None
        if _is_module(state_dict):
            return await self._publish_model(state_dict, mode, version)
        if named is None:  # not the sending rank
            return None
        metas = [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]

        def chunks() -> Any:
            from weightsync.pipeline import make_chunks

            return make_chunks(named, bucket_size_mb=self.bucket_size_mb)

        return await self._send(chunks, metas, mode, version)

    def metadata(
        self, state_dict: Any, training_mode: RewardModelTrainingMode | str
    ) -> list[TensorMeta]:
        """What ``publish`` would send (names, dtypes, shapes), after every check; sends nothing."""
        mode = RewardModelTrainingMode.parse(training_mode)
        if _is_module(state_dict):
            ext = self._extractor_for(state_dict, mode)
            metas = ext.metadata(state_dict, self.dtype)
            check_update(metas, mode, self.head_name_patterns, self.expected)
            return metas
        named = select_params(state_dict, mode, self.head_name_patterns, dtype=self.dtype,
                              expected=self.expected, unmerged_lora=self.unmerged_lora)
        return [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]

    # -- models ------------------------------------------------------------------------------
    async def _publish_model(
        self, model: Any, mode: RewardModelTrainingMode, version: int | None
    ) -> SyncStats | None:
        sharded = _sharding(model)
        if sharded and self.rank0_only:
            raise ValueError(
                f"rank0_only=True but the model is sharded ({sharded}): every rank must take "
                f"part in gathering it; create the publisher with rank0_only=False"
            )
        if not sharded and not self.is_sender:
            return None
        ext = self._extractor_for(model, mode)
        self.last_extractor = ext
        metas = ext.metadata(model, self.dtype)  # identical on every rank, no collective
        # every rank raises the same error, before any gather
        check_update(metas, mode, self.head_name_patterns, self.expected)
        async def send(stream: Any) -> SyncStats:
            return await self._send(stream, metas, mode, version)

        return await send_extracted(ext, model, self.dtype, send)

    def _extractor_for(self, model: Any, mode: RewardModelTrainingMode) -> WeightExtractor:
        from weightsync.config import build_extractor

        sharded = _sharding(model)
        heads = self.head_name_patterns if mode is RewardModelTrainingMode.HEAD_ONLY else None
        common: dict[str, Any] = {"bucket_size_mb": self.bucket_size_mb, "name_patterns": heads}
        has_lora = _has_active_lora(model)
        if mode is RewardModelTrainingMode.LORA and not has_lora:
            raise WeightMismatchError(
                ["model: no active LoRA adapter; a lora update sends merged adapters "
                 "(publish a PEFT model, or use training_mode='full' / 'head_only')"],
                target="lora update",
            )
        if mode is RewardModelTrainingMode.FULL and has_lora:
            raise WeightMismatchError(
                ["model: has active LoRA adapters; publish it with training_mode='lora' "
                 "(adapters merged) or merge them first"],
                target="full update",
            )
        if sharded:  # LoRA adapters of a sharded model are gathered and merged by it too
            return build_extractor({"type": sharded, "src_rank": self.src_rank,
                                    "rank": self.rank, **common, "max_live_chunks": 2})
        return build_extractor({"type": "lora_merge", **common})

    # -- transport ---------------------------------------------------------------------------
    async def _send(
        self, make_chunks: Any, metas: list[TensorMeta], mode: RewardModelTrainingMode,
        version: int | None,
    ) -> SyncStats:
        """The spec's sequence over the two planes (step 3 of the module docstring)."""
        from weightsync.distributed.publisher import publish_stream

        control, comm = self._planes()
        metadata = [{"name": m.name, "dtype": m.dtype, "shape": list(m.shape)} for m in metas]
        return await asyncio.wait_for(
            publish_stream(control, comm, self.src_rank, metadata, _aiter(make_chunks()),
                           version, extra={"training_mode": mode.value}),
            self.timeout_s,
        )

    def _planes(self) -> tuple[Any, Any]:
        """(control plane, tensor communicator) from what the publisher was given."""
        if self._built is not None:
            return self._built
        control, comm = self.control, self.comm
        if hasattr(control, "announce_update_batch") and hasattr(comm, "broadcast"):
            self._built = (control, comm)
            return self._built
        from weightsync.distributed.adapters import VllmControlPlane, VllmTensorCommunicator

        if comm is None and hasattr(control, "send_update") and hasattr(control, "sync_loop"):
            backing: Any = control  # a VLLMRewardClient (or VLLMChatClient)
        elif comm is not None:
            backing = _StrategyBacking(self._engine_client(), comm, self.bucket_size_mb,
                                       self.head_name_patterns, self._twin)
        else:
            raise TypeError(
                f"{type(control).__name__} is not a control plane: pass a ControlPlane and a "
                f"TensorCommunicator, a VLLMRewardClient, or an InferenceEngineClient with comm= "
                f"(a strategy or a sender)")
        self._built = (VllmControlPlane(backing, timeout_s=self.timeout_s),
                       VllmTensorCommunicator(backing))
        return self._built

    def _engine_client(self) -> InferenceEngineClient:
        from weightsync.interfaces import InferenceEngineClient

        if isinstance(self.control, InferenceEngineClient):
            return self.control
        url = getattr(self.control, "server_url", None)
        if url is None:
            raise TypeError(
                f"comm= given but {type(self.control).__name__} is neither an "
                f"InferenceEngineClient nor a client with a server_url")
        from weightsync.clients import FanOutClient

        return FanOutClient([url], api_key=getattr(self.control, "api_key", None),
                            timeout_s=self.timeout_s)

    async def close(self) -> None:
        """Tear down what the publisher built (a strategy sender and its control client)."""
        built, self._built = self._built, None
        backing = getattr(built[0], "client", None) if built else None
        if isinstance(backing, _StrategyBacking):
            await backing.close(owns_client=backing.client is not self.control)

    def close_sync(self) -> None:
        """Blocking twin of ``close``; also stops the private loop thread."""
        if self._twin.started:
            self._twin.run(self.close())
            self._twin.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._twin.run(coro)


class _StrategyBacking:
    """What the vLLM adapters drive when the publisher was given an engine client and a
    strategy (or a wired sender): ``send_update`` runs one update with that sender, on the
    publisher's loop."""

    def __init__(self, client: InferenceEngineClient, comm: Any, bucket_size_mb: float,
                 head_name_patterns: list[str], sync_loop: LoopThread) -> None:
        self.client = client
        self.comm = comm
        self.head_name_patterns = head_name_patterns
        self.sync_loop = sync_loop
        self.strategy_cfg = {"bucket_size_mb": bucket_size_mb}
        self._sender: Any = None

    async def send_update(self, make_chunks: Any, manifest: list[TensorMeta],
                          mode: RewardModelTrainingMode | None, version: int | None,
                          timeout_s: float, *, first_tensor: Any = None) -> SyncStats:
        sender = await self._ensure_sender()
        heads = self.head_name_patterns if mode is RewardModelTrainingMode.HEAD_ONLY else None
        return await asyncio.wait_for(
            sender.send_chunks(make_chunks(), self.client, version=version, manifest=manifest,
                               training_mode=mode, head_name_patterns=heads),
            timeout_s,
        )

    async def _ensure_sender(self) -> Any:
        from weightsync.interfaces import WeightTransferSender, WeightTransferStrategy

        if isinstance(self.comm, WeightTransferSender):
            return self.comm
        if self._sender is None:
            strategy = self.comm
            if not isinstance(strategy, WeightTransferStrategy):
                from weightsync.config import build_strategy

                strategy = build_strategy(strategy)
            info = await strategy.create_sync_info(strategy.cfg, self.client)
            self._sender = await strategy.create_sender(strategy.cfg, self.client, info)
        return self._sender

    async def close(self, *, owns_client: bool) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            try:
                await self.client.close_weight_transfer()
            except Exception:  # noqa: BLE001 - the engine may be gone already
                pass
            await sender.close()
        if owns_client:
            await self.client.aclose()


def create_reward_publisher(
    client: Any,
    head_name_patterns: Sequence[str] | None = None,
    rank0_only: bool = False,
    **kwargs: Any,
) -> Any:
    """The reward spec's factory: a ``RewardModelPublisher`` over ``VllmControlPlane(client)``
    and ``VllmTensorCommunicator(client)`` (the client's own strategy), sending from
    ``comm.rank``. ``rank0_only=True`` wraps it in ``Rank0OnlyPublisher``: ranks other than 0
    return at once and never build it (unsharded models; a sharded one is refused on rank 0,
    which cannot gather it alone); otherwise every rank builds one and the others join the
    gathers of a sharded model. ``kwargs`` go to ``RewardModelPublisher`` (``engine_metadata``,
    ``dtype``, ``rank``, ``bucket_size_mb``, ``timeout_s``, ``unmerged_lora``)."""
    patterns = head_name_patterns
    if patterns is None:
        patterns = getattr(client, "head_name_patterns", None)

    def _make() -> RewardModelPublisher:
        from weightsync.distributed.adapters import VllmControlPlane, VllmTensorCommunicator

        control = VllmControlPlane(client, timeout_s=kwargs.get("timeout_s", 600.0))
        comm = VllmTensorCommunicator(client)
        return RewardModelPublisher(control, comm, src_rank=comm.rank,
                                    head_name_patterns=patterns, rank0_only=rank0_only,
                                    **kwargs)

    if rank0_only:
        from weightsync.distributed.publisher import Rank0OnlyPublisher

        return Rank0OnlyPublisher(_make, rank=kwargs.get("rank"))
    if client is None:  # a rank that only joins the gathers of a sharded model
        return RewardModelPublisher(None, None, 0, patterns, **kwargs)
    return _make()


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


async def _aiter(chunks: Any) -> Any:
    """An iterable or async iterable of chunks as an async iterator."""
    if hasattr(chunks, "__aiter__"):
        async for c in chunks:
            yield c
    else:
        for c in chunks:
            yield c


def _is_module(x: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, torch.nn.Module)


def _sharding(model: Any) -> str | None:
    """``"fsdp"`` for DTensor parameters, ``"deepspeed"`` for ZeRO-3 ones, else None."""
    if not _is_module(model):
        return None
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "fsdp"
        if hasattr(p, "ds_id"):
            return "deepspeed"
    return None


def _has_active_lora(model: Any) -> bool:
    from weightsync.extractors.lora_layers import has_active_lora

    return has_active_lora(model)
