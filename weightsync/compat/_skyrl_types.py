"""SkyRL's weight-sync data and abstract classes (skyrl-train 0.3.1's ``weight_sync.base``,
``transfer_strategy``, ``weight_extractor``, ``weight_loader``), with SkyRL's fields, lengths
checks and error texts; re-exported by ``weightsync.compat.skyrl``, where the strategies that
implement them on weightsync live. The requests made by that layer's senders carry
weightsync's own request as plain data (``transfer``); nothing here is pickled.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from weightsync.pipeline import batch_by_threshold

if TYPE_CHECKING:  # pragma: no cover
    import torch

# --------------------------------------------------------------------------------------------
# data: requests and chunks
# --------------------------------------------------------------------------------------------


@dataclass
class WeightUpdateRequest:
    """One request's metadata (SkyRL's base request): parallel ``names`` / ``dtypes``
    (strings) / ``shapes``.

    Raises:
        ValueError: the three lists differ in length.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes, shapes must have the same length. Got names={len(self.names)}, "
                f"dtypes={len(self.dtypes)}, shapes={len(self.shapes)}")

    def __len__(self) -> int:
        return len(self.names)


class LoraLoadRequest(WeightUpdateRequest):
    """Asks an engine to load a LoRA adapter from ``lora_path`` (no tensors travel)."""

    def __init__(self, lora_path: str) -> None:
        super().__init__(names=[], dtypes=[], shapes=[])
        self.lora_path = lora_path


@dataclass
class WeightChunk:
    """Parameters sent as one unit (SkyRL's chunk): parallel ``names``, ``dtypes`` (strings
    such as ``"torch.bfloat16"``), ``shapes`` and ``tensors``.

    Raises:
        ValueError: the four lists differ in length.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[torch.Tensor]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes) == len(self.tensors):
            raise ValueError(
                f"All lists must have the same length. Got names={len(self.names)}, "
                f"dtypes={len(self.dtypes)}, shapes={len(self.shapes)}, "
                f"tensors={len(self.tensors)}")

    def __len__(self) -> int:
        return len(self.names)

    @cached_property
    def total_numel(self) -> int:
        """Elements of all tensors."""
        return sum(t.numel() for t in self.tensors)

    @cached_property
    def total_size_bytes(self) -> int:
        """Bytes of all tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class BroadcastWeightUpdateRequest(WeightUpdateRequest):
    """A broadcast chunk's request; ``transfer`` is weightsync's request (plain data) that the
    engine's receiver follows (None in a request made by hand)."""

    transfer: dict | None = None


_IPC_REQUEST_END_MARKER = b"__END_OF_REQUEST__"


@dataclass
class CudaIpcWeightUpdateRequest(WeightUpdateRequest):
    """An IPC chunk's request: ``sizes`` (elements per tensor, in packing order),
    ``ipc_handles`` (here: ``"rank<i>"`` -> training rank i's buffer handles, plain data) and
    ``transfer`` (weightsync's request, which the engine's receiver follows)."""

    sizes: list[int]
    ipc_handles: dict[str, Any]
    transfer: dict | None = None

    def serialize(self) -> bytes:
        """The request as bytes (base64 of JSON, an end marker, zero-padded to 4 bytes).

        Returns:
            The bytes ``deserialize`` reads back.
        """
        data = base64.b64encode(json.dumps(dataclasses.asdict(self)).encode()) + \
            _IPC_REQUEST_END_MARKER
        return data + b"\x00" * (-len(data) % 4)

    @classmethod
    def deserialize(cls, data: bytes) -> CudaIpcWeightUpdateRequest:
        """Read ``serialize``'s bytes back (JSON: nothing in them is executed).

        Raises:
            ValueError: no end marker, or the bytes before it are not such a request.
        """
        end = data.find(_IPC_REQUEST_END_MARKER)
        if end == -1:
            raise ValueError("End marker not found in serialized data")
        try:
            return cls(**json.loads(base64.b64decode(data[:end], validate=True)))
        except Exception as e:
            raise ValueError("Failed to deserialize request") from e


# --------------------------------------------------------------------------------------------
# the abstract interface
# --------------------------------------------------------------------------------------------


class WeightExtractor(abc.ABC):
    """Training side: yields a model's weights as ``WeightChunk``s in the inference dtype."""

    @abc.abstractmethod
    def extract_weights(self, dtype: torch.dtype) -> Iterator[WeightChunk]: ...


class WeightLoader(abc.ABC):
    """Engine side: loads one request's weights into the engine."""

    @abc.abstractmethod
    async def load_weights(self, request: WeightUpdateRequest) -> Any: ...


@dataclass
class WeightSyncInitInfo(abc.ABC):
    """What a strategy's sender and receivers are built from (``create_init_info``)."""

    override_existing_receiver: bool

    @staticmethod
    @abc.abstractmethod
    def strategy_type() -> type:
        """The strategy class this init info belongs to."""

    def for_engine(self, engine_index: int, tp_size: int, pp_size: int) -> WeightSyncInitInfo:
        """This init info for engine ``engine_index`` (unchanged unless a strategy needs it)."""
        return self


class WeightTransferSender(abc.ABC):
    """Sends chunks to the engines; every training rank calls ``send_chunks``."""

    @abc.abstractmethod
    async def send_chunks(self, chunks: Iterable[WeightChunk]) -> None: ...

    @abc.abstractmethod
    def teardown(self) -> None: ...


class WeightTransferReceiver(abc.ABC):
    """Receives one request's tensors in an engine worker."""

    @abc.abstractmethod
    def receive_weights(self, request: WeightUpdateRequest) -> Iterator[tuple[str, Any]]: ...

    @abc.abstractmethod
    def teardown(self) -> None: ...


class WeightTransferStrategy(abc.ABC):
    """A stateless factory: ``create_init_info(cfg)`` once, ``create_sender`` on every training
    rank, ``create_receiver`` on every engine worker (with ``init_info.for_engine(...)``)."""

    @staticmethod
    @abc.abstractmethod
    def create_init_info(cfg: Any) -> WeightSyncInitInfo: ...

    @staticmethod
    @abc.abstractmethod
    def create_sender(init_info: Any, inference_client: Any) -> WeightTransferSender: ...

    @staticmethod
    @abc.abstractmethod
    def create_receiver(init_info: Any) -> WeightTransferReceiver: ...


# --------------------------------------------------------------------------------------------
# cutting chunks; the config fields weight sync reads
# --------------------------------------------------------------------------------------------


def yield_module_grouped_chunks(
    params: dict[str, Any],
    dtype: torch.dtype,
    gather_tensor_fn: Callable[[Any], torch.Tensor],
    get_shape_fn: Callable[[str, Any, torch.Tensor], list[int]],
    batch_size_threshold_gb: float = 0.0,
) -> Iterator[WeightChunk]:
    """Chunks of whole modules (a name less its last two parts: ``a.b.q_proj.weight`` ->
    ``a.b``), several modules per chunk up to ``batch_size_threshold_gb`` (0: one each; a
    module larger than that is a chunk of its own). A module is gathered when its chunk is
    asked for.

    Args:
        params: name -> parameter (sharded or not).
        dtype: the inference dtype every tensor is cast to.
        gather_tensor_fn: parameter -> full tensor (a collective for sharded parameters).
        get_shape_fn: ``(name, param, tensor)`` -> the shape the engine gets.
        batch_size_threshold_gb: the batching threshold in GiB.

    Returns:
        An iterator of ``WeightChunk``s.
    """
    modules: dict[str, list[str]] = {}
    for name in params:
        modules.setdefault(".".join(name.split(".")[:-2]), []).append(name)
    shapes: dict[str, list[int]] = {}

    def gathered() -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
        for module, names in modules.items():
            items = []
            for name in names:
                t = gather_tensor_fn(params[name]).to(dtype).detach().contiguous()
                shapes[name] = get_shape_fn(name, params[name], t)
                items.append((name, t))
            yield module, items

    for chunk in batch_by_threshold(gathered(), int(batch_size_threshold_gb * (1 << 30))):
        yield WeightChunk(names=list(chunk.names), dtypes=[str(dtype)] * len(chunk),
                          shapes=[shapes.pop(n) for n in chunk.names],
                          tensors=list(chunk.tensors))


@dataclass
class GeneratorConfig:
    """``generator``: the weight-sync fields of skyrl-train's default config, its defaults."""

    model_dtype: str = "bfloat16"
    num_inference_engines: int = 1
    weight_sync_backend: str = "nccl"
    weight_transfer_threshold_cuda_ipc_GB: float = 1.0
    inference_engine_tensor_parallel_size: int = 4
    inference_engine_pipeline_parallel_size: int = 1
    inference_engine_data_parallel_size: int = 1
    override_existing_update_group: str = "auto"


@dataclass
class PlacementConfig:
    """``trainer.placement``: whether training and inference share the GPUs."""

    colocate_all: bool = True


@dataclass
class TrainerConfig:
    """``trainer``: only its placement matters to weight sync."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)


@dataclass
class SkyRLWeightSyncConfig:
    """The part of a SkyRL config that weight sync reads (``cfg.generator``,
    ``cfg.trainer.placement``); a full SkyRL ``DictConfig`` works in its place."""

    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def get_default_config() -> SkyRLWeightSyncConfig:
    """skyrl-train's default config, the fields weight sync reads (its ``get_default_config``
    composes the whole Hydra config; these are the same values).

    Returns:
        A fresh ``SkyRLWeightSyncConfig``; change its fields as SkyRL's config's.
    """
    return SkyRLWeightSyncConfig()
