"""weightsync: move freshly trained weights from RL trainers into running inference engines.

Public API. Importing this package imports neither torch nor any heavy backend (vllm, ray,
deepspeed, peft); those load where they are used.
"""

from weightsync.config import (
    ExtractorConfig,
    HeadExtractorConfig,
    LoaderConfig,
    StrategyConfig,
    WeightSyncConfig,
    build_extractor,
    build_loader,
    build_strategy,
    load_config,
)
from weightsync.connect import BlockingSyncSession, SyncSession, connect, connect_sync
from weightsync.engine import EndpointState, EndpointStatus, WeightUpdateEndpoint
from weightsync.errors import (
    ChecksumMismatchError,
    CommunicatorReplacedError,
    EngineDiedError,
    EngineUnreachableError,
    UpdateIncompleteError,
    UpdateRefusedError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncTimeout,
)
from weightsync.extractors.deepspeed import DeepSpeedWeightExtractor
from weightsync.extractors.fsdp import FSDPWeightExtractor
from weightsync.extractors.hf import HFHeadWeightExtractor, HFWeightExtractor
from weightsync.extractors.lora import LoraMergeWeightExtractor
from weightsync.extractors.lora_adapter import LoRAAdapterWeightExtractor
from weightsync.extractors.megatron import MegatronWeightExtractor
from weightsync.interfaces import (
    InferenceEngineClient,
    WeightExtractor,
    WeightLoader,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
)
from weightsync.loaders.remote import RemoteWeightLoader
from weightsync.loaders.sglang import SGLangWeightLoader
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.loaders.vllm import VLLMWeightLoader
from weightsync.lora_adapter import LoRAAdapterSpec, lora_request
from weightsync.registry import register_extractor, register_loader, register_strategy
from weightsync.strategies.broadcast import (
    BroadcastConfig,
    BroadcastTransferReceiver,
    BroadcastTransferSender,
    BroadcastTransferStrategy,
    BroadcastWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
)
from weightsync.strategies.cuda_ipc import (
    CudaIpcTransferReceiver,
    CudaIpcTransferSender,
    CudaIpcTransferStrategy,
    CudaIpcWeightUpdateRequest,
    IpcConfig,
)
from weightsync.strategies.packed_cuda_ipc import (
    PackedCudaIpcTransferReceiver,
    PackedCudaIpcTransferSender,
    PackedCudaIpcTransferStrategy,
    PackedCudaIpcWeightUpdateRequest,
    PackedIpcConfig,
)
from weightsync.types import (
    EmptyWeightSyncInfo,
    IpcBufferHandle,
    SyncStats,
    TensorMeta,
    TrainingMode,
    WeightChunk,
    WeightSyncInfo,
    WeightUpdateFinish,
    WeightUpdateRequest,
    WeightUpdateStart,
)

__version__ = "0.1.0"

__all__ = [
    "BlockingSyncSession", "BroadcastConfig", "BroadcastTransferReceiver",
    "BroadcastTransferSender", "BroadcastTransferStrategy", "BroadcastWeightUpdateRequest",
    "CudaIpcTransferReceiver", "CudaIpcTransferSender", "CudaIpcTransferStrategy",
    "DeepSpeedWeightExtractor", "FSDPWeightExtractor", "HFHeadWeightExtractor",
    "HFWeightExtractor", "LoRAAdapterSpec", "LoRAAdapterWeightExtractor",
    "LoraMergeWeightExtractor", "MegatronWeightExtractor",
    "PackedCudaIpcTransferReceiver",
    "PackedCudaIpcTransferSender", "PackedCudaIpcTransferStrategy", "RemoteWeightLoader",
    "SGLangWeightLoader", "TorchModuleWeightLoader", "VLLMWeightLoader",
    "ChecksumMismatchError", "CommunicatorReplacedError", "CudaIpcWeightUpdateRequest", "EmptyWeightSyncInfo",
    "EndpointState", "EndpointStatus", "EngineDiedError", "EngineUnreachableError",
    "ExtractorConfig", "HeadExtractorConfig",
    "InferenceEngineClient", "IpcBufferHandle", "IpcConfig", "LoaderConfig",
    "PackedCudaIpcWeightUpdateRequest", "PackedIpcConfig", "StrategyConfig", "SyncSession",
    "SyncStats", "TensorMeta", "TorchDistributedWeightSyncInfo", "TrainingMode",
    "UpdateIncompleteError", "UpdateRefusedError", "WeightChunk", "WeightExtractor",
    "WeightLoader", "WeightMismatchError", "WeightSyncConfig", "WeightSyncError", "WeightSyncInfo",
    "WeightSyncTimeout", "WeightTransferReceiver", "WeightTransferSender",
    "WeightTransferStrategy", "WeightUpdateEndpoint", "WeightUpdateFinish", "WeightUpdateRequest",
    "WeightUpdateStart", "build_extractor", "build_loader", "build_strategy", "connect",
    "connect_sync", "load_config", "lora_request", "register_extractor", "register_loader", "register_strategy",
]
