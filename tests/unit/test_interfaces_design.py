"""The extractor base class as the interface design writes it (``weightsync.interfaces``): a
subclass with an ``async _extract_raw_weights`` returning a dict, the ``_group_by_module`` /
``_batch_by_threshold`` flags set from a SkyRL-style config in ``__init__``, the helpers of the
same names, and the design's low-level flow (``create_sync_info`` -> ``create_sender`` ->
``send_chunks``) into an engine in this process over a real gloo group."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

import weightsync as ws
from weightsync.loaders.torch_module import TorchModuleWeightLoader


class DesignExtractor(ws.WeightExtractor):
    """Written from the interface design alone (its FSDP example, unsharded)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self._group_by_module = (cfg.generator.weight_sync_backend == "nccl"
                                 and cfg.trainer.placement.colocate_all)
        self._batch_by_threshold = (cfg.generator.weight_sync_backend == "nccl"
                                    and cfg.trainer.placement.colocate_all
                                    and hasattr(cfg.generator,
                                                "weight_transfer_threshold_cuda_ipc_GB"))

    async def _extract_raw_weights(self, model, generator_dtype):
        return {n: p.detach().to(generator_dtype) for n, p in model.state_dict().items()}


def _cfg(backend: str, colocate: bool, threshold_gb: float | None = None):
    generator = {"weight_sync_backend": backend}
    if threshold_gb is not None:
        generator["weight_transfer_threshold_cuda_ipc_GB"] = threshold_gb
    return OmegaConf.create({"generator": generator,
                             "trainer": {"placement": {"colocate_all": colocate}}})


class Net(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(64, 64)  # 16 KiB weight
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 8)


def _chunks(ext, model):
    async def go():
        return [c async for c in ext.extract_weights(model, torch.float32)]

    return asyncio.run(go())


def test_flags_and_helpers_share_their_names_as_the_design_writes_them():
    ext = DesignExtractor(_cfg("nccl", True, threshold_gb=0.00005))
    assert ext._group_by_module and ext._batch_by_threshold  # the flags
    assert ext._should_group_by_module() and ext._should_batch_by_threshold()
    params = dict(Net().state_dict())
    assert ext._group_by_module(params) == {  # the helper of the same name
        "a": ["a.weight", "a.bias"], "b": ["b.weight", "b.bias"], "c": ["c.weight", "c.bias"]}
    singles = [ws.WeightChunk([n], [t]) for n, t in params.items()]
    batches = list(ext._batch_by_threshold(iter(singles), 0.00003))  # 32,212 bytes
    assert [[c.names[0] for c in b] for b in batches] == [  # 16,640 | 16,640 + 2,080 bytes
        ["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight", "c.bias"]]
    off = DesignExtractor(_cfg("gloo", True))
    assert not off._group_by_module and not off._batch_by_threshold
    assert off._group_by_module(params)["c"] == ["c.weight", "c.bias"]  # still the helper


def test_the_flags_decide_how_the_stream_is_cut():
    model = Net()
    # both off: one chunk per tensor
    assert [c.names for c in _chunks(DesignExtractor(_cfg("gloo", True)), model)] == [
        [n] for n in model.state_dict()]
    # grouped and batched at 21,474 bytes: whole modules (16,640 + 16,640 + 2,080 bytes)
    cut = _chunks(DesignExtractor(_cfg("nccl", True, threshold_gb=0.00002)), model)
    assert [c.names for c in cut] == [["a.weight", "a.bias"],
                                      ["b.weight", "b.bias", "c.weight", "c.bias"]]
    assert all(isinstance(d, torch.dtype) for c in cut for d in c.dtypes)


def test_metadata_of_an_async_extractor_says_to_override_it():
    with pytest.raises(TypeError, match="override metadata"):
        DesignExtractor(_cfg("gloo", True)).metadata(Net())


def test_the_designs_flow_syncs_an_engine_with_a_design_style_extractor():
    trainer, engine = Net(1), Net(0)
    endpoint = ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=engine), name="engine0")
    cfg = _cfg("nccl", True, threshold_gb=0.00005)

    async def go():
        from weightsync.clients import FanOutClient

        client = FanOutClient([endpoint])
        strategy = ws.BroadcastTransferStrategy(ws.BroadcastConfig(backend="gloo"))
        sync_info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, sync_info)
        try:
            extractor = DesignExtractor(cfg)
            await sender.send_chunks(extractor.extract_weights(trainer, torch.float32), client)
        finally:
            await sender.close()
            await client.close_weight_transfer()

    asyncio.run(go())
    assert all(torch.equal(a, b) for a, b in zip(trainer.state_dict().values(),
                                                 engine.state_dict().values(), strict=True))
    assert endpoint.version == 1
