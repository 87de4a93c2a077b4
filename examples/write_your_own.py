"""Write your own extractor, loader and strategy, register them, and sync with them.

The three recipes of docs/architecture.md ("Write your own"), runnable as they stand:

* an extractor in the interface design's style: ``async _extract_raw_weights(model, dtype)``
  returning ``{name: tensor}`` (here from a checkpoint of numpy arrays), with the design's
  ``_group_by_module`` / ``_batch_by_threshold`` flags, and nothing else (the manifest is read
  from the dict it returns);
* a loader: ``load_weights(named_tensors)`` into the engine's own storage (here a dict of numpy
  arrays), with ``expected_metadata()`` so bad names and shapes are refused before any byte moves;
* a strategy: one file holding its config, request type, sender, receiver and the strategy
  factory (here for an engine in the same process: the sender hands tensors over through a
  mailbox, the receiver takes them out), registered by name.

    python examples/write_your_own.py
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

import weightsync as ws
from weightsync.clients import FanOutClient
from weightsync.config import StrategyConfig
from weightsync.types import EmptyWeightSyncInfo, TensorMeta


# -- an extractor ------------------------------------------------------------------------------
@ws.register_extractor("numpy_checkpoint")
class NumpyCheckpointExtractor(ws.WeightExtractor):
    """A "model" that is a dict of numpy arrays (a checkpoint from another framework)."""

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self._group_by_module = True  # keep a layer's weight and bias in one chunk
        self._batch_by_threshold = True  # and fill chunks up to the bucket size

    async def _extract_raw_weights(self, model: dict, generator_dtype: Any) -> dict:
        return {name: torch.from_numpy(array).to(generator_dtype or torch.float32)
                for name, array in model.items()}


# -- a loader ----------------------------------------------------------------------------------
@ws.register_loader("numpy_store")
class NumpyStoreLoader(ws.WeightLoader):
    """An engine that keeps its weights as numpy arrays."""

    def __init__(self, cfg: Any = None, *, store: dict[str, np.ndarray]) -> None:
        self.store = store

    def expected_metadata(self) -> dict[str, TensorMeta]:
        return {n: TensorMeta(n, "float32", list(a.shape)) for n, a in self.store.items()}

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        for name, t in named_tensors.items():  # copy: the tensors may be transfer buffers
            self.store[name][...] = t.detach().cpu().numpy()


# -- a strategy --------------------------------------------------------------------------------
_MAILBOX: dict[int, list[torch.Tensor]] = {}  # for engines in this process
_TICKETS = itertools.count()


@dataclass(kw_only=True)
class InProcessConfig(StrategyConfig):
    type: str = "in_process"


@dataclass(kw_only=True)
class InProcessWeightUpdateRequest(ws.WeightUpdateRequest):
    TYPE: ClassVar[str] = "in_process"
    ticket: int = 0  # where the chunk's tensors wait in the mailbox


class InProcessTransferSender(ws.WeightTransferSender):
    def __init__(self, cfg: InProcessConfig) -> None:
        self.cfg = cfg

    def create_request(self, chunk: ws.WeightChunk) -> InProcessWeightUpdateRequest:
        ticket = next(_TICKETS)
        _MAILBOX[ticket] = list(chunk.tensors)
        return InProcessWeightUpdateRequest(names=list(chunk.names), dtypes=chunk.dtype_names,
                                            shapes=chunk.shape_lists, ticket=ticket)

    async def _transfer(self, chunk: ws.WeightChunk, request: Any, inference_client: Any) -> None:
        await inference_client.update_named_weights(request.to_dict())

    def _release(self, request: Any) -> None:
        _MAILBOX.pop(request.ticket, None)


class InProcessTransferReceiver(ws.WeightTransferReceiver):
    request_cls = InProcessWeightUpdateRequest

    async def _receive_and_load(self, request: Any, loader: ws.WeightLoader) -> None:
        tensors = _MAILBOX[request.ticket]
        await loader.load_weights(dict(zip(request.names, tensors, strict=True)))


@ws.register_strategy("in_process")
class InProcessTransferStrategy(ws.WeightTransferStrategy):
    config_cls = InProcessConfig

    @classmethod
    def get_request_type(cls) -> type:
        return InProcessWeightUpdateRequest

    async def create_sync_info(self, cfg: Any, inference_client: Any) -> EmptyWeightSyncInfo:
        return EmptyWeightSyncInfo()

    async def create_sender(self, cfg: Any, inference_client: Any, sync_info: Any) -> Any:
        await inference_client.init_weight_transfer(self.config_dict(), sync_info.to_dict())
        return InProcessTransferSender(self.own_config(cfg))

    async def create_receiver(self, cfg: Any, sync_info: Any, rank_offset: int) -> Any:
        return InProcessTransferReceiver()


# -- all three together ------------------------------------------------------------------------
async def main() -> None:
    rng = np.random.default_rng(0)
    trainer = {"layer0.weight": rng.standard_normal((8, 4), dtype=np.float32),
               "layer0.bias": rng.standard_normal(8, dtype=np.float32),
               "head.weight": rng.standard_normal((2, 8), dtype=np.float32)}
    engine = {n: np.zeros_like(a) for n, a in trainer.items()}
    loader = ws.build_loader({"type": "numpy_store"}, store=engine)
    client = FanOutClient([ws.WeightUpdateEndpoint(loader, name="numpy engine")])
    strategy = ws.build_strategy({"type": "in_process", "bucket_size_mb": 0.0001})
    extractor = ws.build_extractor({"type": "numpy_checkpoint", "bucket_size_mb": 0.0001})
    sync_info = await strategy.create_sync_info(strategy.cfg, client)
    sender = await strategy.create_sender(strategy.cfg, client, sync_info)
    for step in (1, 2):
        for a in trainer.values():
            a += 1.0  # a training step
        # the manifest (checked by the engine before any byte moves) is read from the dict
        # the extraction returned; the chunks are cut from that same dict
        stats = await sender.send_chunks(extractor.extract_weights(trainer), client,
                                         version=step)
        same = all(np.array_equal(engine[n], a) for n, a in trainer.items())
        print(f"step {step}: {stats.num_chunks} chunks, version {stats.versions[0]}, "
              f"weights equal: {same}")
    await sender.close()


if __name__ == "__main__":
    asyncio.run(main())
