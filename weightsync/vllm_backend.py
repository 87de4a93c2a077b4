"""weightsync as a backend of vLLM's own weight-transfer API: the trainer side.

Code written for vLLM's native API (``vllm.distributed.weight_transfer``, vLLM 0.32) keeps its
calls and gets weightsync's transports and checks by naming the backend:

    # the engine (offline, AsyncLLM or `vllm serve --weight-transfer-config ...`)
    llm = LLM(model=path, weight_transfer_config={"backend": "weightsync"})

    # the trainer, every rank
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from weightsync.vllm_backend import WeightSyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(strategy="broadcast", world_size=2, rank=rank),
        client=HTTPVLLMWeightSyncClient(url),  # or RayVLLMWeightSyncClient, LLMWeightSyncClient
        source=ModuleSource(model))
    engine.send_weights()                      # every step
    engine.shutdown()

The engine side is registered by weightsync's vLLM plugin in every vLLM process; this module
registers the trainer side when it is imported (both through
``weightsync._runtime.vllm_compat.register_transfer_backend``).

``WeightSyncTrainerInitInfo``: ``strategy`` (anything ``ws.connect`` takes: ``"broadcast"``,
``{"type": "broadcast", "backend": "gloo"}``, a preset, ...), ``world_size`` (vLLM's
convention: the trainer plus the engine's workers), ``delta`` (send only what changed,
``weightsync.delta``), ``dtype`` (cast before sending: the dtype the engine serves),
``timeout_s``, ``loader`` (``VLLMLoaderConfig`` fields for the workers), and vLLM's ``rank``.

``WeightSyncTrainerEngine.send_weights(version=None)`` pushes the source's tensors as one
update through a ``ws.connect_sync`` session over ``weightsync.clients.VLLMNativeChannel``:
the start (every worker validates the whole manifest before any byte moves), the chunks on the
strategy's data plane, the finish (the version published only if every chunk landed), then
vLLM's ``finish_weight_update(weight_version)`` and a prefix-cache reset. It returns the
``SyncStats`` on the sending rank (None elsewhere) and raises weightsync's typed errors.
Versions count from 1 per engine object; pass ``version=`` to continue a count (an engine
refuses a version that is not newer than the one it serves). Only rank 0 sends; the other ranks
iterate the source (its gathers) and return. Runs in the training process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from weightsync._runtime.vllm_compat import TRANSFER_BACKEND, register_transfer_backend


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """The trainer's init info for the ``weightsync`` backend (see the module docstring)."""

    backend: ClassVar[str] = TRANSFER_BACKEND

    strategy: Any = "broadcast"
    world_size: int = 2
    delta: bool = False
    dtype: str | None = None
    timeout_s: float | None = None
    loader: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"WeightSyncTrainerInitInfo: world_size counts the trainer and "
                             f"the engine's workers (>= 2), got {self.world_size!r}")


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """vLLM's ``TrainerWeightTransferEngine`` over a weightsync session (see the module
    docstring)."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True,
                 info: WeightSyncTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info or WeightSyncTrainerInitInfo(rank=0)
        self.session: Any = None
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: Any,
                     source: Any = None) -> WeightSyncTrainerEngine:
        if source is None:
            raise ValueError("the weightsync backend needs a WeightSource (e.g. "
                             "ModuleSource(model)) at trainer_init")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     info=init_info)
        if engine.is_sender:
            import weightsync as ws
            from weightsync.clients.vllm_native import VLLMNativeChannel

            channel = VLLMNativeChannel(client, world_size=init_info.world_size - 1,
                                        loader=init_info.loader)
            engine.session = ws.connect_sync([channel], init_info.strategy,
                                             delta=init_info.delta, timeout_s=init_info.timeout_s)
        return engine

    def send_weights(self, version: int | None = None) -> Any:
        """One update of the engine from the source (see the module docstring)."""
        if not self.is_sender:
            for _ in self.source:
                pass
            return None
        named = list(self.source)
        self.version = int(version) if version is not None else self.version + 1
        return self.session.push(named, version=self.version, dtype=self.info.dtype)

    def shutdown(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            session.close()


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process offline ``LLM`` (vLLM ships
    one for HTTP and one for Ray actors): each call is the ``LLM`` method of the same name."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


register_transfer_backend()
