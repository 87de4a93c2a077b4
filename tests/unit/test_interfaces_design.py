"""The extractor base class as the interface design writes it (``weightsync.interfaces``): a
subclass with an ``async _extract_raw_weights`` returning a dict, the ``_group_by_module`` /
``_batch_by_threshold`` flags set from a SkyRL-style config in ``__init__`` (default False, as
the design says; the built-in extractors set theirs), the helpers of the same names, one
extraction per update (the manifest read from the dict the chunks are cut from), and the
design's low-level flow (``create_sync_info`` -> ``create_sender`` -> ``send_chunks``) into an
engine in this process over a real gloo group."""

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


class Bare(ws.WeightExtractor):
    """Only the design's one method, and a count of its calls."""

    calls = 0

    async def _extract_raw_weights(self, model, generator_dtype):
        type(self).calls += 1
        return {n: p.detach() for n, p in model.state_dict().items()}


def test_the_flags_default_to_the_designs_false_and_the_built_ins_set_theirs():
    bare = Bare({})
    assert not bare._group_by_module and not bare._batch_by_threshold
    assert not bare._should_group_by_module() and not bare._should_batch_by_threshold()
    model = Net()
    assert [c.names for c in _chunks(bare, model)] == [[n] for n in model.state_dict()]
    from weightsync.extractors.fsdp import FSDPWeightExtractor
    from weightsync.extractors.hf import HFHeadWeightExtractor, HFWeightExtractor
    from weightsync.extractors.lora import LoraMergeWeightExtractor
    from weightsync.extractors.lora_adapter import LoRAAdapterWeightExtractor
    from weightsync.extractors.megatron import MegatronWeightExtractor

    for ext in (HFWeightExtractor(), HFHeadWeightExtractor(), LoraMergeWeightExtractor(),
                LoRAAdapterWeightExtractor(), FSDPWeightExtractor(),
                ws.build_extractor({"type": "deepspeed"})):
        assert (bool(ext._group_by_module), bool(ext._batch_by_threshold)) == (True, True), ext
    megatron = MegatronWeightExtractor(bridge=lambda models: iter(()))
    assert (bool(megatron._group_by_module), bool(megatron._batch_by_threshold)) == (False, True)
    hf = HFWeightExtractor(ws.ExtractorConfig(group_by_module=False))
    assert (bool(hf._group_by_module), bool(hf._batch_by_threshold)) == (False, True)
    # the hf extractor's stream is cut as before: whole modules, batched to the bucket size
    cut = _chunks(HFWeightExtractor(ws.ExtractorConfig(bucket_size_mb=0.02)), model)
    assert [c.names for c in cut] == [["a.weight", "a.bias"],
                                      ["b.weight", "b.bias", "c.weight", "c.bias"]]


def test_an_async_dict_is_extracted_once_for_its_manifest_and_its_chunks():
    model, ext = Net(), Bare({})
    Bare.calls = 0
    with pytest.raises(TypeError, match=r"await extractor.prepare_update\(model, dtype\)"):
        ext.metadata(model)
    assert Bare.calls == 0  # its coroutine was closed unrun: nothing was extracted

    async def go():
        manifest = await ext.prepare_update(model, torch.bfloat16)
        assert ext.metadata(model, torch.bfloat16) == manifest  # the kept dict's
        chunks = [c async for c in ext.extract_weights(model, torch.bfloat16)]
        return manifest, chunks

    Bare.calls = 0
    manifest, chunks = asyncio.run(go())
    assert Bare.calls == 1  # the manifest and the chunks came from one extraction
    assert [(m.name, m.dtype, m.shape) for m in manifest] == [
        (n, "bfloat16", list(t.shape)) for n, t in model.state_dict().items()]
    assert [m for c in chunks for m in c.metas()] == manifest
    assert ext._prepared is None  # taken by the update: nothing is kept after it
    asyncio.run(go())
    assert Bare.calls == 2  # the next update extracts anew


def test_a_sync_dict_is_kept_by_metadata_for_the_next_extraction():
    class SyncDict(ws.WeightExtractor):
        calls = 0

        def _extract_raw_weights(self, model, generator_dtype):
            SyncDict.calls += 1
            return {n: p.detach() for n, p in model.state_dict().items()}

    model, ext = Net(), SyncDict({})
    manifest = ext.metadata(model)
    chunks = _chunks(ext, model)  # float32: the dtype metadata was asked for (None) differs
    assert SyncDict.calls == 2 and [m.name for m in manifest] == [c.names[0] for c in chunks]
    manifest = ext.metadata(model, torch.float32)
    chunks = _chunks(ext, model)
    assert SyncDict.calls == 3 and [m for c in chunks for m in c.metas()] == manifest
    ext.metadata(model, torch.float32)
    ext.discard_prepared()  # an update that will not be sent keeps nothing
    assert ext._prepared is None


def test_send_chunks_announces_a_dicts_manifest_so_a_bad_tensor_moves_nothing():
    """The design's flow passes only the stream; its manifest (from the dict) goes in the start,
    so the engine refuses the whole update before any chunk lands. Per chunk, the first tensors
    would have been loaded before the bad one was refused."""
    trainer = Net(1)

    class Engine(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            net = Net(0)
            self.a, self.b = net.a, net.b
            self.c = torch.nn.Linear(64, 9)  # one row more than the trainer's

    engine = Engine()
    before = engine.a.weight.detach().clone()
    endpoint = ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=engine), name="engine0")
    Bare.calls = 0

    async def go(stream: bool):
        from weightsync.clients import FanOutClient

        client = FanOutClient([endpoint])
        strategy = ws.BroadcastTransferStrategy(ws.BroadcastConfig(backend="gloo",
                                                                   stream=stream))
        sender = await strategy.create_sender(
            strategy.cfg, client, await strategy.create_sync_info(strategy.cfg, client))
        try:
            with pytest.raises(ws.WeightMismatchError, match="c.weight"):
                await sender.send_chunks(Bare({}).extract_weights(trainer, torch.float32),
                                         client)
        finally:
            await sender.close()
            await client.close_weight_transfer()

    for stream in (True, False):
        asyncio.run(go(stream))
        assert torch.equal(engine.a.weight, before)  # nothing moved
    assert Bare.calls == 2  # one extraction per update


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
