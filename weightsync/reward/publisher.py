"""``RewardModelPublisher``: push a reward model's trained weights to a reward server, mode-aware.

Who calls: the training loop, on every training rank (build one publisher per rank with the same
arguments). ``publish(model_or_params, training_mode=..., version=...)`` runs one update:

1. **Select** what the mode says (engine names; ``weightsync.naming``): HEAD_ONLY -> only head
   tensors (``head_name_patterns``, default ``score.``, ``classifier.``, ``v_head.``); LORA ->
   merged backbone + head of a PEFT model (``lora_merge`` extractor: no ``lora_A``/``lora_B``
   ever leaves); FULL -> every tensor. A model goes through an extractor chosen from what it
   is: FSDP2 (DTensor parameters) -> ``fsdp``, DeepSpeed ZeRO-3 -> ``deepspeed`` (both merge
   PEFT LoRA layers as they gather), anything else (HF, PEFT) -> ``lora_merge`` (plain weights
   for a model without adapters). Explicit
   ``params`` (a mapping or ``(name, tensor)`` pairs) are normalised and sorted (natural order:
   ``layers.2`` before ``layers.10``), so the same tensors always travel in the same order.
2. **Check, before any byte moves** (from metadata only: no gather, nothing changed), and raise
   ``WeightMismatchError`` listing every offender: HEAD_ONLY given backbone weights, FULL or
   LORA without backbone weights, unmerged LoRA tensors, a mode that contradicts the model (LORA
   without adapters, FULL with active adapters), names (and shapes) the engine does not know
   (when ``engine_metadata`` is given; the server checks its own manifest again at start).
3. **Send** on the sending rank only: with ``comm=None`` through the control client's own
   ``sync_weights`` (its configured strategy); with ``comm`` (a ``WeightTransferStrategy``
   config/instance or a wired ``WeightTransferSender``) the chunks stream from the extractor
   straight into ``send_chunks`` (bounded memory). The training mode travels with the update
   (the start's ``training_mode`` and the server's ``training_mode`` field).

Ranks: ``src_rank`` sends; other ranks take part only in the extraction collectives of a
sharded model (and return None at once for an unsharded one). With ``rank0_only=True`` ranks
other than 0 return at once; a sharded model is then refused on every rank (rank 0 alone cannot
gather it). If the sending rank fails before or during extraction, it still runs its part of
the remaining gathers, so the other ranks never hang in a collective.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from weightsync._runtime.threads import LoopThread
from weightsync.errors import WeightMismatchError
from weightsync.naming import NamingError, engine_names, is_lora_param
from weightsync.reward.types import (
    DEFAULT_HEAD_NAME_PATTERNS,
    RewardModelTrainingMode,
    non_head_params,
    training_mode_offenders,
)
from weightsync.types import TensorMeta, dtype_to_str, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.interfaces import InferenceEngineClient, SyncStats, WeightExtractor

T = TypeVar("T")


class RewardModelPublisher:
    """See the module docstring.

    ``control``: the control-plane client: anything with ``sync_weights(params, *, version,
    training_mode, timeout_s)`` (``VLLMRewardClient``), or an ``InferenceEngineClient`` (then
    ``comm`` is required). ``comm``: None, a strategy (config mapping / YAML path / instance),
    or a ``WeightTransferSender`` already wired to the engines. ``engine_metadata``: what the
    engine accepts (``{name: TensorMeta}``, a list of ``TensorMeta``, or a checkpoint directory
    whose safetensors headers are read): unknown names / wrong shapes are refused locally.
    ``dtype``: cast floating tensors to this dtype (e.g. the served dtype) before sending.
    """

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
        bucket_size_mb: float = 1024,
        timeout_s: float = 600.0,
    ) -> None:
        self.control = control
        self.comm = comm
        self.src_rank = int(src_rank)
        self.head_name_patterns = list(head_name_patterns or DEFAULT_HEAD_NAME_PATTERNS)
        self._rank = rank
        self.rank0_only = rank0_only
        if rank0_only and self.src_rank != 0:
            raise ValueError(f"rank0_only=True needs src_rank=0, got src_rank={self.src_rank}")
        self.expected = _expected_metadata(engine_metadata)
        self.dtype = str_to_dtype(dtype) if isinstance(dtype, str) else dtype
        self.bucket_size_mb = bucket_size_mb
        self.timeout_s = timeout_s
        self.last_extractor: WeightExtractor | None = None
        self._sender: Any = None
        self._engine_client: Any = None
        self._twin = LoopThread("weightsync-publisher")  # runs the *_sync methods

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
    async def publish(
        self,
        model_or_params: Any,
        *,
        training_mode: RewardModelTrainingMode | str,
        version: int | None = None,
    ) -> SyncStats | None:
        """One update (see the module docstring). Returns the ``SyncStats`` on the sending
        rank, None elsewhere. Raises ``WeightMismatchError`` (nothing sent) for bad input."""
        mode = RewardModelTrainingMode.parse(training_mode)
        if self.rank0_only and self.rank != 0 and not _sharding(model_or_params):
            return None
        if _is_module(model_or_params):
            return await self._publish_model(model_or_params, mode, version)
        if not self.is_sender:
            return None
        named = self._prepare_params(model_or_params, mode)
        return await self._send_params(named, mode, version)

    def publish_sync(self, model_or_params: Any, **kwargs: Any) -> SyncStats | None:
        """Blocking form of ``publish`` (one private event loop, reused across calls)."""
        return self._run(self.publish(model_or_params, **kwargs))

    def metadata(self, model_or_params: Any, training_mode: RewardModelTrainingMode | str
                 ) -> list[TensorMeta]:
        """What ``publish`` would send (names, dtypes, shapes), after every check; sends nothing."""
        mode = RewardModelTrainingMode.parse(training_mode)
        if _is_module(model_or_params):
            ext = self._extractor_for(model_or_params, mode)
            metas = ext.metadata(model_or_params, self.dtype)
            self._check(metas, mode)
            return metas
        named = self._prepare_params(model_or_params, mode)
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
        self._check(metas, mode)  # every rank raises the same error, before any gather
        if not ext.is_sender:
            async for _ in ext.extract_weights(model, self.dtype):
                raise AssertionError("a non-sending rank got a chunk")  # pragma: no cover
            return None
        started = getattr(ext, "runs_started", None)
        try:
            if self.comm is None:
                named = [(n, t) async for c in ext.extract_weights(model, self.dtype)
                         for n, t in zip(c.names, c.tensors, strict=True)]
                return await self._control_sync(named, mode, version)
            return await self._stream(ext.extract_weights(model, self.dtype), metas, mode, version)
        except BaseException:
            if sharded and started is not None and ext.runs_started == started:
                ext.drain(model, self.dtype)  # never started: run this rank's gathers anyway
            raise

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
            # comm=None collects every chunk for sync_weights: no back-pressure to wait on
            return build_extractor({"type": sharded, "src_rank": self.src_rank,
                                    "rank": self.rank, **common,
                                    "max_live_chunks": 2 if self.comm is not None else 0})
        return build_extractor({"type": "lora_merge", **common})

    # -- explicit params -----------------------------------------------------------------------
    def _prepare_params(
        self, params: Any, mode: RewardModelTrainingMode
    ) -> list[tuple[str, torch.Tensor]]:
        items = _named_items(params)
        lora = [n for n, _ in items if is_lora_param(n)]
        if lora:
            raise WeightMismatchError(
                [f"{n}: an unmerged LoRA tensor; publish the PEFT model with training_mode="
                 f"'lora' (adapters merged), or merge them before" for n in lora],
                target=f"{mode.value} update",
            )
        try:
            mapping = engine_names(n for n, _ in items)
        except NamingError as e:
            raise WeightMismatchError([str(e)], target=f"{mode.value} update") from None
        named = [(mapping[n], t) for n, t in items if n in mapping]
        named.sort(key=lambda item: _natural_key(item[0]))
        if self.dtype is not None:
            named = [(n, t.to(self.dtype) if t.is_floating_point() else t) for n, t in named]
        metas = [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]
        self._check(metas, mode)
        return named

    async def _send_params(
        self, named: list[tuple[str, torch.Tensor]], mode: RewardModelTrainingMode,
        version: int | None,
    ) -> SyncStats:
        if self.comm is None:
            return await self._control_sync(named, mode, version)
        from weightsync.pipeline import make_chunks

        chunks = list(make_chunks(named, bucket_size_mb=self.bucket_size_mb))
        metas = [m for c in chunks for m in c.metas()]
        return await self._stream(chunks, metas, mode, version)

    # -- checks ------------------------------------------------------------------------------
    def _check(self, metas: list[TensorMeta], mode: RewardModelTrainingMode) -> None:
        names = [m.name for m in metas]
        if not names:
            what = "head " if mode is RewardModelTrainingMode.HEAD_ONLY else ""
            raise WeightMismatchError(
                [f"nothing to send: no {what}tensors selected (head patterns "
                 f"{self.head_name_patterns})"], target=f"{mode.value} update",
            )
        offenders = training_mode_offenders(names, mode, self.head_name_patterns,
                                            whole_update=True)
        if mode is RewardModelTrainingMode.LORA and not non_head_params(
            names, self.head_name_patterns
        ):
            offenders.append(
                f"update carries only head parameters {sorted(names)[:5]}; a lora update "
                f"sends the merged backbone too (use head_only when only the head is trained)"
            )
        if self.expected is not None:
            from weightsync.validation import find_mismatches

            offenders += find_mismatches(metas, self.expected, check_dtype=False)
        if offenders:
            raise WeightMismatchError(offenders, target=f"{mode.value} update")

    # -- transport ---------------------------------------------------------------------------
    async def _control_sync(
        self, named: list[tuple[str, torch.Tensor]], mode: RewardModelTrainingMode,
        version: int | None,
    ) -> SyncStats:
        sync = getattr(self.control, "sync_weights", None)
        if sync is None:
            raise TypeError(
                f"{type(self.control).__name__} has no sync_weights(); pass comm= (a strategy "
                f"or sender) to publish through an InferenceEngineClient"
            )
        return await sync(named, version=version, training_mode=mode, timeout_s=self.timeout_s)

    async def _stream(
        self, chunks: Any, metas: list[TensorMeta], mode: RewardModelTrainingMode,
        version: int | None,
    ) -> SyncStats:
        client = self._client()
        if hasattr(client, "training_mode"):
            client.training_mode = mode  # the HTTP control plane carries it on every call
        sender = await self._ensure_sender(client)
        heads = self.head_name_patterns if mode is RewardModelTrainingMode.HEAD_ONLY else None
        return await asyncio.wait_for(
            sender.send_chunks(chunks, client, version=version, manifest=metas,
                               training_mode=mode, head_name_patterns=heads),
            self.timeout_s,
        )

    def _client(self) -> InferenceEngineClient:
        from weightsync.interfaces import InferenceEngineClient

        if isinstance(self.control, InferenceEngineClient):
            return self.control
        if self._engine_client is None:
            base_url = getattr(self.control, "base_url", None)
            if base_url is None:
                raise TypeError(
                    f"comm= given but {type(self.control).__name__} is neither an "
                    f"InferenceEngineClient nor a reward client with a base_url"
                )
            from weightsync.reward.http_engine_client import HttpEngineClient

            self._engine_client = HttpEngineClient(
                base_url, api_key=getattr(self.control, "api_key", None),
                timeout_s=self.timeout_s,
            )
        return self._engine_client

    async def _ensure_sender(self, client: InferenceEngineClient) -> Any:
        from weightsync.interfaces import WeightTransferSender, WeightTransferStrategy

        if isinstance(self.comm, WeightTransferSender):
            return self.comm
        if self._sender is None:
            strategy = self.comm
            if not isinstance(strategy, WeightTransferStrategy):
                from weightsync.config import build_strategy

                strategy = build_strategy(strategy)
            info = await strategy.create_sync_info(strategy.cfg, client)
            self._sender = await strategy.create_sender(strategy.cfg, client, info)
        return self._sender

    async def close(self) -> None:
        """Tear down what the publisher built (its sender and HTTP control client)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            client = self._client()
            try:
                await client.close_weight_transfer()
            except Exception:  # noqa: BLE001 - the engine may be gone already
                pass
            await sender.close()
        if self._engine_client is not None:
            await self._engine_client.aclose()
            self._engine_client = None

    def close_sync(self) -> None:
        """Blocking ``close`` for ``publish_sync`` users; also stops the private loop thread."""
        if not self._twin.started:
            return
        self._run(self.close())
        self._twin.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._twin.run(coro)


def create_reward_publisher(
    client: Any,
    head_name_patterns: Sequence[str] | None = None,
    rank0_only: bool = False,
    **kwargs: Any,
) -> RewardModelPublisher:
    """A publisher over ``client`` (e.g. ``VLLMRewardClient``) using the client's configured
    strategy (``comm=None``), sending from rank 0. ``rank0_only=True``: other ranks do nothing
    at all (unsharded models); otherwise they join the gathers of a sharded model. ``kwargs``
    go to ``RewardModelPublisher`` (``engine_metadata``, ``dtype``, ``comm``...)."""
    patterns = head_name_patterns
    if patterns is None:
        patterns = getattr(client, "head_name_patterns", None)
    return RewardModelPublisher(client, kwargs.pop("comm", None), 0, patterns,
                                rank0_only=rank0_only, **kwargs)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


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


def _named_items(params: Any) -> list[tuple[str, Any]]:
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"params: item {i} is not a (name, tensor) pair")
        if not hasattr(item[1], "dtype") or not hasattr(item[1], "shape"):
            raise TypeError(f"params: {item[0]!r} is a {type(item[1]).__name__}, not a tensor")
        out.append((item[0], item[1].detach()))
    if not out:
        raise ValueError("params: nothing to publish (no tensors given)")
    return out


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _expected_metadata(spec: Any) -> dict[str, TensorMeta] | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        from weightsync._runtime.vllm_compat import checkpoint_metadata

        found = checkpoint_metadata(spec)
        if found is None:
            raise FileNotFoundError(f"engine_metadata: no *.safetensors in {spec!r}")
        return {n: TensorMeta(n, d, s) for n, (d, s) in found.items()}
    if isinstance(spec, Mapping):
        return {str(k): v if isinstance(v, TensorMeta) else TensorMeta.from_dict(
            {"name": k, **v}) for k, v in spec.items()}
    if isinstance(spec, Iterable):
        metas = [m if isinstance(m, TensorMeta) else TensorMeta.from_dict(m) for m in spec]
        return {m.name: m for m in metas}
    raise TypeError(f"engine_metadata: expected a mapping, TensorMetas or a checkpoint directory, "
                    f"got {type(spec).__name__}")
