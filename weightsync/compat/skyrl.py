"""SkyRL's weight-sync API (skyrl-train 0.3.1, ``skyrl_train.weight_sync``) on weightsync.

A SkyRL trainer and its engines switch by changing one import: ``from skyrl_train.weight_sync
import ...`` becomes ``from weightsync.compat.skyrl import ...``, on both sides (the requests
carry weightsync's wire data, which only this layer's receivers read). The names, fields,
signatures and error texts are SkyRL's: ``get_transfer_strategy_cls(cfg)``, the strategies'
static ``create_init_info(cfg)`` / ``create_sender(init_info, client)`` /
``create_receiver(init_info)``, ``send_chunks(chunks)``, ``receive_weights(request)``,
``WeightChunk`` with string dtypes and ``total_numel``, ``yield_module_grouped_chunks``, and
``RemoteWeightLoader`` / ``get_default_config`` from elsewhere in skyrl-train. The bytes move
through weightsync's own strategies: ``broadcast`` (its private group, one vote and packed
broadcasts per chunk) and ``packed_cuda_ipc`` (one shared buffer per chunk: CUDA IPC on GPUs,
POSIX shared memory on CPUs; from every training rank when the trainer runs several).
skyrl-train need not be installed. weightsync's own interface (``weightsync.strategies``,
``weightsync.types``) stays the primary API; ``docs/reference_differences.md`` lists where this
layer differs from SkyRL's release.
"""

from __future__ import annotations

import dataclasses
import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.compat._skyrl_bridge import (
    LOOP,
    SkyRLEngines,
    WrappedSender,
    check_dtypes,
    receive_into_list,
    this_rank,
    world_size,
)
from weightsync.compat._skyrl_types import (
    _IPC_REQUEST_END_MARKER as _IPC_REQUEST_END_MARKER,  # SkyRL's tests read it here
)
from weightsync.compat._skyrl_types import (
    BroadcastWeightUpdateRequest,
    CudaIpcWeightUpdateRequest,
    LoraLoadRequest,
    WeightChunk,
    WeightExtractor,
    WeightLoader,
    WeightSyncInitInfo,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
    WeightUpdateRequest,
    get_default_config,
    yield_module_grouped_chunks,
)
from weightsync.config import skyrl_strategy, to_plain
from weightsync.types import EmptyWeightSyncInfo, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch


def __getattr__(name: str) -> Any:
    """``ray``, imported when first asked for: SkyRL's broadcast module exposes it and its
    tests patch ``ray._private.services.get_node_ip_address`` through it."""
    if name == "ray":
        import ray
        import ray._private.services  # noqa: F401 - the submodule create_init_info reads
        return ray
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# broadcast
# --------------------------------------------------------------------------------------------


@dataclass
class BroadcastInitInfo(WeightSyncInitInfo):
    """The broadcast group's rendezvous; engine workers join at ``rank_offset`` + their rank."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    model_dtype_str: str

    @staticmethod
    def strategy_type() -> type:
        return BroadcastTransferStrategy

    def for_engine(self, engine_index: int, tp_size: int, pp_size: int) -> BroadcastInitInfo:
        """The init info of engine ``engine_index``: its ranks follow the engines before it."""
        return dataclasses.replace(
            self, rank_offset=self.rank_offset + engine_index * tp_size * pp_size)

    def sync_info(self) -> Any:
        """weightsync's rendezvous for this group."""
        from weightsync.strategies.broadcast import TorchDistributedWeightSyncInfo

        return TorchDistributedWeightSyncInfo(
            master_addr=self.master_addr, master_port=int(self.master_port),
            world_size=int(self.world_size), group_name=self.group_name, backend=self.backend)

    def strategy(self) -> Any:
        """weightsync's broadcast strategy for this group: one request, one vote and packed
        broadcasts per chunk (SkyRL sends a request per chunk)."""
        from weightsync.strategies.broadcast import BroadcastConfig
        from weightsync.strategies.broadcast import BroadcastTransferStrategy as Ours

        return Ours(BroadcastConfig(backend=self.backend, group_name=self.group_name,
                                    stream=False))


class BroadcastWeightTransferSender(WrappedSender):
    """Training rank 0 broadcasts each chunk to the engines; other ranks only extract."""


class BroadcastWeightTransferReceiver(WeightTransferReceiver):
    """An engine worker's end of the broadcast group."""

    def __init__(self, model_dtype: torch.dtype, ours: Any) -> None:
        self._model_dtype = model_dtype
        self._ours = ours

    def receive_weights(
        self, request: BroadcastWeightUpdateRequest
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive one request's tensors (every worker of every engine calls it).

        Args:
            request: what the sender's ``update_named_weights`` carried.

        Returns:
            ``(name, tensor)`` pairs, valid until the next request.

        Raises:
            ValueError: a dtype other than the model's, or a request not made by this layer.
        """
        def check() -> None:
            check_dtypes(request.dtypes, self._model_dtype,
                         "dtype mismatch: request {dtype}, model {model}")

        yield from receive_into_list(self._ours, request.transfer, type(request).__name__, check)

    def teardown(self) -> None:
        """Leave the group."""
        self._ours.close()


class BroadcastTransferStrategy(WeightTransferStrategy):
    """Weights broadcast over a private torch.distributed group (gloo or NCCL)."""

    @staticmethod
    def create_init_info(cfg: Any) -> BroadcastInitInfo:
        """The group's rendezvous from a SkyRL config.

        Args:
            cfg: a SkyRL config (``DictConfig``) or ``get_default_config()``'s.

        Returns:
            ``BroadcastInitInfo``: this node's address, a free port, one rank per engine
            worker plus the sender.

        Raises:
            ValueError: ``generator.model_dtype`` is no dtype, or the backend is neither
                ``nccl`` nor ``gloo``.
        """
        g = _checked_generator(cfg, "broadcast")
        workers = (g.num_inference_engines * g.inference_engine_tensor_parallel_size
                   * g.inference_engine_pipeline_parallel_size
                   * g.inference_engine_data_parallel_size)
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return BroadcastInitInfo(
            master_addr=_node_address(), master_port=port, rank_offset=1,
            world_size=workers + 1, group_name="skyrl", backend=g.weight_sync_backend,
            model_dtype_str=g.model_dtype,
            override_existing_receiver=g.override_existing_update_group == "enable")

    @staticmethod
    def create_sender(init_info: BroadcastInitInfo,
                      inference_client: Any) -> BroadcastWeightTransferSender:
        """The sender of a training rank; on rank 0 it joins the group, which blocks until the
        engines join: run it beside ``init_weight_update_communicator``, as SkyRL's trainer
        does.

        Args:
            init_info: ``create_init_info``'s.
            inference_client: SkyRL's engine client (its ``update_named_weights`` is called
                with each chunk's request).

        Returns:
            A ``BroadcastWeightTransferSender``.
        """
        ours = None
        if this_rank() == 0:
            strategy = init_info.strategy()
            ours = LOOP.run(strategy.create_sender(None, SkyRLEngines(inference_client, dict),
                                                   init_info.sync_info()))

        def wrap(req: dict) -> BroadcastWeightUpdateRequest:
            n = len(req["names"])
            return BroadcastWeightUpdateRequest(
                names=list(req["names"]), dtypes=[init_info.model_dtype_str] * n,
                shapes=[list(s) for s in req["shapes"]], transfer=req)

        return BroadcastWeightTransferSender(ours, inference_client, init_info.model_dtype_str,
                                             wrap)

    @staticmethod
    def create_receiver(init_info: BroadcastInitInfo) -> BroadcastWeightTransferReceiver:
        """An engine worker joins the group at ``rank_offset`` + its rank in the engine.

        Args:
            init_info: the engine's (``init_info.for_engine(...)``).

        Returns:
            A ``BroadcastWeightTransferReceiver``.
        """
        strategy = init_info.strategy()
        ours = LOOP.run(strategy.create_receiver(None, init_info.sync_info(),
                                                 this_rank() + init_info.rank_offset))
        return BroadcastWeightTransferReceiver(str_to_dtype(init_info.model_dtype_str), ours)


def _node_address() -> str:
    """This node's address as SkyRL's trainer finds it (through Ray), else weightsync's."""
    import sys

    try:
        ray = sys.modules[__name__].ray
    except ImportError:
        from weightsync._runtime.process_group import default_master_addr

        return default_master_addr()
    return ray._private.services.get_node_ip_address()


# --------------------------------------------------------------------------------------------
# CUDA IPC (shared memory on CPUs)
# --------------------------------------------------------------------------------------------


@dataclass
class CudaIpcInitInfo(WeightSyncInitInfo):
    """Only the model's dtype: the handles travel with each request."""

    model_dtype_str: str

    @staticmethod
    def strategy_type() -> type:
        return CudaIpcTransferStrategy

    def strategy(self, every_rank: bool) -> Any:
        """weightsync's ``packed_cuda_ipc`` (one shared buffer per chunk), from every training
        rank when ``every_rank``."""
        from weightsync.strategies.packed_cuda_ipc import PackedCudaIpcTransferStrategy as Ours
        from weightsync.strategies.packed_cuda_ipc import PackedIpcConfig

        return Ours(PackedIpcConfig(every_rank=every_rank))


class CudaIpcWeightTransferSender(WrappedSender):
    """Every training rank shares its copy of each chunk; rank 0 sends the request."""


class CudaIpcWeightTransferReceiver(WeightTransferReceiver):
    """Opens the shared buffers on an engine worker (its own training rank's copy)."""

    def __init__(self, model_dtype: torch.dtype, ours: Any) -> None:
        self._model_dtype = model_dtype
        self._ours = ours

    def receive_weights(
        self, request: CudaIpcWeightUpdateRequest
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Views of one request's tensors in the sender's shared buffer.

        Args:
            request: what the sender's ``update_named_weights`` carried.

        Returns:
            ``(name, tensor)`` pairs, valid until the next request.

        Raises:
            ValueError: mixed dtypes, a dtype other than the model's, sizes missing, or a
                request not made by this layer.
        """
        def check() -> None:
            if len(set(request.dtypes)) > 1:
                raise ValueError(
                    "packed weight update should have all tensors with the same dtype")
            check_dtypes(request.dtypes[:1], self._model_dtype,
                         "mismatch dtype: src {dtype}, dst {model}")
            if len(request.sizes) != len(request):
                raise ValueError("sizes must be provided for packed weight update")

        yield from receive_into_list(self._ours, request.transfer, type(request).__name__, check)

    def teardown(self) -> None:
        """Unmap the shared buffers."""
        self._ours.close()


class CudaIpcTransferStrategy(WeightTransferStrategy):
    """Weights shared through CUDA IPC (shared memory for CPU tensors) with colocated engines."""

    @staticmethod
    def create_init_info(cfg: Any) -> CudaIpcInitInfo:
        """The model's dtype and whether to replace an engine's receiver, from a SkyRL config.

        Args:
            cfg: a SkyRL config (``generator.model_dtype``,
                ``generator.override_existing_update_group``).

        Returns:
            ``CudaIpcInitInfo``.

        Raises:
            ValueError: ``generator.model_dtype`` is no dtype.
        """
        g = _checked_generator(cfg, "cuda_ipc")
        return CudaIpcInitInfo(
            model_dtype_str=g.model_dtype,
            override_existing_receiver=g.override_existing_update_group == "enable")

    @staticmethod
    def create_sender(init_info: CudaIpcInitInfo,
                      inference_client: Any) -> CudaIpcWeightTransferSender:
        """The sender of a training rank; with several ranks every one calls it and they share
        their copies of each chunk in lockstep.

        Args:
            init_info: ``create_init_info``'s.
            inference_client: SkyRL's engine client (used on rank 0).

        Returns:
            A ``CudaIpcWeightTransferSender``.
        """
        every_rank = world_size() > 1
        client = inference_client if this_rank() == 0 else None
        ours = LOOP.run(init_info.strategy(every_rank).create_sender(
            None, None if client is None else SkyRLEngines(client, dict),
            EmptyWeightSyncInfo()))

        def wrap(req: dict) -> CudaIpcWeightUpdateRequest:
            n = len(req["names"])
            copies = [req["buffers"], *req.get("replicas", [])]
            return CudaIpcWeightUpdateRequest(
                names=list(req["names"]), dtypes=[init_info.model_dtype_str] * n,
                shapes=[list(s) for s in req["shapes"]],
                sizes=[math.prod(s) for s in req["shapes"]],
                ipc_handles={f"rank{i}": hs for i, hs in enumerate(copies)}, transfer=req)

        return CudaIpcWeightTransferSender(ours, client, init_info.model_dtype_str, wrap)

    @staticmethod
    def create_receiver(init_info: CudaIpcInitInfo) -> CudaIpcWeightTransferReceiver:
        """An engine worker's receiver; it reads the copy of the training rank beside it.

        Args:
            init_info: ``create_init_info``'s.

        Returns:
            A ``CudaIpcWeightTransferReceiver``.
        """
        ours = LOOP.run(init_info.strategy(False).create_receiver(
            None, EmptyWeightSyncInfo(), this_rank() + 1))
        return CudaIpcWeightTransferReceiver(str_to_dtype(init_info.model_dtype_str), ours)


def _checked_generator(cfg: Any, strategy: str) -> Any:
    """``cfg.generator`` once the fields this strategy reads hold usable values."""
    g = cfg.generator
    try:
        str_to_dtype(g.model_dtype)
    except ValueError as e:
        raise ValueError(f"generator.model_dtype: {e}") from None
    if strategy == "broadcast" and g.weight_sync_backend not in ("nccl", "gloo"):
        raise ValueError(f"generator.weight_sync_backend must be 'nccl' or 'gloo', got "
                         f"{g.weight_sync_backend!r}")
    return g


# --------------------------------------------------------------------------------------------
# choosing a strategy; remote engines
# --------------------------------------------------------------------------------------------


def get_transfer_strategy_cls(cfg: Any) -> type[WeightTransferStrategy]:
    """The strategy a SkyRL config asks for: CUDA IPC for an ``nccl`` backend with everything
    colocated (``trainer.placement.colocate_all``), else broadcast.

    Args:
        cfg: a SkyRL config (``DictConfig``) or ``get_default_config()``'s.

    Returns:
        ``CudaIpcTransferStrategy`` or ``BroadcastTransferStrategy``.

    Raises:
        ValueError: ``generator.weight_sync_backend`` is neither ``nccl`` nor ``gloo``.
    """
    if skyrl_strategy(to_plain(cfg))["type"] == "cuda_ipc":
        return CudaIpcTransferStrategy
    return BroadcastTransferStrategy


class RemoteWeightLoader(WeightLoader):
    """Drives a remote engine's weight updates over HTTP (skyrl-train's loader for engines it
    did not start): SkyRL's vLLM server routes (``engine_backend="vllm"``, the init info and
    the request posted whole) or SGLang's native ones (``"sglang"``). Broadcast only.

    Args:
        url: the server's base URL.
        engine_backend: ``"vllm"`` or ``"sglang"``.
    """

    def __init__(self, url: str, engine_backend: str) -> None:
        self._url = url
        self._engine_backend = engine_backend

    async def _post(self, route: str, payload: Any = None) -> Any:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.post(
                f"{self._url}{route}", json=payload) as response:
            return await response.json()

    async def init_communicator(self, init_info: WeightSyncInitInfo) -> Any:
        """Have the server join the broadcast group.

        Returns:
            The server's JSON answer.

        Raises:
            ValueError: ``init_info`` is not a broadcast's, or the backend is unknown.
        """
        if init_info.strategy_type() is not BroadcastTransferStrategy:
            raise ValueError(f"Remote inference engines only support BroadcastTransferStrategy, "
                             f"got: {init_info.strategy_type().__name__}")
        if self._engine_backend == "sglang":
            assert isinstance(init_info, BroadcastInitInfo)
            return await self._post("/init_weights_update_group", {
                "master_address": init_info.master_addr, "master_port": init_info.master_port,
                "rank_offset": init_info.rank_offset, "world_size": init_info.world_size,
                "group_name": init_info.group_name, "backend": init_info.backend})
        if self._engine_backend == "vllm":
            return await self._post("/init_weight_update_communicator",
                                    dataclasses.asdict(init_info))
        raise ValueError(f"Invalid engine backend: {self._engine_backend}")

    async def load_weights(self, request: WeightUpdateRequest) -> Any:
        """Post one request (SGLang: its first tensor, the only one SGLang's route takes).

        Returns:
            The server's JSON answer.

        Raises:
            ValueError: the backend is unknown.
        """
        if self._engine_backend == "sglang":
            return await self._post("/update_weights_from_distributed", {
                "name": request.names[0], "dtype": request.dtypes[0],
                "shape": request.shapes[0]})
        if self._engine_backend == "vllm":
            return await self._post("/update_weights", dataclasses.asdict(request))
        raise ValueError(f"Invalid engine backend: {self._engine_backend}")

    async def destroy_group(self) -> Any:
        """Have the server leave the group.

        Returns:
            The server's JSON answer.
        """
        return await self._post("/destroy_weights_update_group")


__all__ = [
    "WeightChunk", "WeightExtractor", "WeightLoader", "WeightUpdateRequest", "LoraLoadRequest",
    "BroadcastWeightUpdateRequest", "CudaIpcWeightUpdateRequest", "WeightTransferStrategy",
    "WeightTransferSender", "WeightTransferReceiver", "WeightSyncInitInfo", "BroadcastInitInfo",
    "CudaIpcInitInfo", "BroadcastTransferStrategy", "BroadcastWeightTransferSender",
    "BroadcastWeightTransferReceiver", "CudaIpcTransferStrategy", "CudaIpcWeightTransferSender",
    "CudaIpcWeightTransferReceiver", "get_transfer_strategy_cls", "yield_module_grouped_chunks",
    "RemoteWeightLoader", "get_default_config",
]
