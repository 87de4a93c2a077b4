"""The interface design's config keys for ``fsdp`` and ``deepspeed`` (``_design_keys``): built
from a SkyRL-style trainer config as the design's example builds ``FSDPWeightExtractor(cfg)``,
the flags follow ``generator.weight_sync_backend``, ``trainer.placement.colocate_all`` and
``generator.weight_transfer_threshold_cuda_ipc_GB``, and the stream is cut as they say. One
process, an unsharded module (no DTensor: nothing to gather); the sharded run is
``tests/integration/extractors/test_fsdp_extractor_design.py``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

import weightsync as ws
from weightsync.extractors.deepspeed import DeepSpeedWeightExtractor
from weightsync.extractors.fsdp import FSDPExtractorConfig, FSDPWeightExtractor


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)  # 16,640 bytes with its bias
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 8)  # 2,080 bytes


def skyrl(backend: str, colocate: bool, threshold_gb: float | None = None, **top):
    generator = {"weight_sync_backend": backend}
    if threshold_gb is not None:
        generator["weight_transfer_threshold_cuda_ipc_GB"] = threshold_gb
    return OmegaConf.create({"generator": generator, "data": {"train": "x.parquet"},
                             "trainer": {"placement": {"colocate_all": colocate}}, **top})


def cut(ext) -> list[list[str]]:
    async def go():
        return [c.names async for c in ext.extract_weights(Net(), torch.float32)]

    return asyncio.run(go())


@pytest.mark.parametrize("cls", [FSDPWeightExtractor, DeepSpeedWeightExtractor])
def test_the_designs_keys_set_the_flags_as_its_example(cls):
    names = [n for n, _ in Net().named_parameters()]
    # gloo, or nccl not colocated: neither flag; every tensor is a chunk
    for cfg in (skyrl("gloo", True, 0.5), skyrl("nccl", False, 0.5)):
        ext = cls(cfg)
        assert (bool(ext._group_by_module), bool(ext._batch_by_threshold)) == (False, False)
        assert cut(ext) == [[n] for n in names]
    # nccl and colocated: whole modules; no threshold key: one module per chunk
    ext = cls(skyrl("nccl", True))
    assert (bool(ext._group_by_module), bool(ext._batch_by_threshold)) == (True, False)
    assert cut(ext) == [["a.weight", "a.bias"], ["b.weight", "b.bias"], ["c.weight", "c.bias"]]
    # ... and the threshold (21,475 bytes here): modules batched up to it
    ext = cls(skyrl("nccl", True, 0.00002))
    assert (bool(ext._group_by_module), bool(ext._batch_by_threshold)) == (True, True)
    assert ext.threshold_bytes() == int(0.00002 * 1024 * (1 << 20))
    assert cut(ext) == [["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight", "c.bias"]]
    assert ext.design_flags is not None and isinstance(ext.cfg, cls.config_cls)


def test_the_extractors_own_fields_are_read_beside_the_trainer_sections():
    ext = FSDPWeightExtractor(skyrl("nccl", True, 0.5, bucket_size_mb=0.02, max_live_chunks=3,
                                    name_patterns=["a.", "b.", "c."]))
    assert ext.cfg.bucket_size_mb == 0.02 and ext.cfg.max_live_chunks == 3  # given wins
    assert ext.cfg.name_patterns == ["a.", "b.", "c."]
    # the trainer's other entries are not read: a missing value or an unset variable is fine
    FSDPWeightExtractor(skyrl("nccl", True, model={"path": "${oc.env:WS_NO_SUCH_VARIABLE}"},
                              data={"val": "???"}))
    assert cut(ext) == [["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight", "c.bias"]]


def test_without_the_designs_keys_nothing_changes():
    for ext in (FSDPWeightExtractor(), FSDPWeightExtractor(FSDPExtractorConfig()),
                FSDPWeightExtractor({"type": "fsdp", "bucket_size_mb": 0.02}),
                ws.build_extractor({"type": "fsdp", "bucket_size_mb": 0.02})):
        assert ext.design_flags is None
        assert (bool(ext._group_by_module), bool(ext._batch_by_threshold)) == (True, True)
    assert cut(ws.build_extractor({"type": "fsdp", "bucket_size_mb": 0.02})) == [
        ["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight", "c.bias"]]
    ext = ws.build_extractor({"type": "fsdp", "group_by_module": False, "bucket_size_mb": 0.02})
    assert cut(ext) == [["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight", "c.bias"]]
    assert not ext._group_by_module  # per tensor, then batched: the same cut for this model


def test_a_bad_backend_or_field_is_named():
    with pytest.raises(ValueError, match="generator.weight_sync_backend must be 'nccl' or "
                                         "'gloo', got 'mpi'"):
        FSDPWeightExtractor(skyrl("mpi", True))
    with pytest.raises(ValueError, match=r"extractor 'deepspeed': unknown field\(s\) \['pigeon'\]"):
        DeepSpeedWeightExtractor({"pigeon": 1})
