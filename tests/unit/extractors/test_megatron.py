"""``megatron`` extractor without Megatron: the bridge is a plain export function (a callable
``models -> (hf_name, tensor)`` pairs is one of the bridges the extractor takes), which lets these
tests count exports and hand out tensors of known storage. The real Megatron-Core model is in
``tests/integration/extractors/test_megatron_extractor.py``."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from weightsync import build_extractor
from weightsync.extractors.megatron import (
    MegatronExtractorConfig,
    MegatronWeightExtractor,
    export_function,
)

SHAPES = {"model.embed_tokens.weight": (64, 16), "model.layers.0.self_attn.q_proj.weight": (16, 16),
          "model.layers.0.self_attn.k_proj.weight": (8, 16), "model.layers.0.mlp.up_proj.weight":
          (32, 16), "model.norm.weight": (16,), "lm_head.weight": (64, 16)}


class Export:
    """A bridge's export: HF tensors in order; q/k are strided views of one fused tensor (as
    a bridge's QKV split); ``tied_twice`` repeats the embedding at the end (a pipeline's last
    stage copy)."""

    def __init__(self, tied_twice: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.tensors = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        self.tied_twice = tied_twice
        self.calls = 0

    def __call__(self, models):
        assert isinstance(models, list)
        self.calls += 1
        fused = torch.cat([self.tensors["model.layers.0.self_attn.q_proj.weight"].t(),
                           self.tensors["model.layers.0.self_attn.k_proj.weight"].t()], dim=1)
        for name, t in self.tensors.items():
            if name.endswith("q_proj.weight"):
                yield name, fused[:, :16].t()
            elif name.endswith("k_proj.weight"):
                yield name, fused[:, 16:].t()
            else:
                yield name, t.clone()
        if self.tied_twice:
            yield "model.embed_tokens.weight", self.tensors["model.embed_tokens.weight"].clone()


def _ext(export, **cfg) -> MegatronWeightExtractor:
    return MegatronWeightExtractor(MegatronExtractorConfig(is_sender=True, **cfg), bridge=export)


def _collect(ext, model=None, dtype=None):
    async def run():
        return [c async for c in ext.extract_weights(model or torch.nn.Linear(2, 2), dtype)]

    return asyncio.run(run())


def test_threshold_buckets_packed_views_equal_the_export() -> None:
    export = Export()
    ext = _ext(export, bucket_size_mb=3000 / (1 << 20))  # 3000 bytes
    chunks = _collect(ext)
    names = [n for c in chunks for n in c.names]
    assert names == list(SHAPES)  # export order, no module grouping
    sizes = [c.total_size_bytes for c in chunks]
    assert all(s <= 3000 or len(c) == 1 for s, c in zip(sizes, chunks, strict=True))
    assert len(chunks) >= 4
    for c in chunks:
        assert c.packed
        assert len({t.untyped_storage().data_ptr() for t in c.tensors}) == 1  # one buffer
        assert all(t.is_contiguous() for t in c.tensors)
        for n, t in zip(c.names, c.tensors, strict=True):
            assert torch.equal(t, export.tensors[n]), n


def test_pack_false_yields_the_bridge_tensors_and_groups_by_module_when_asked() -> None:
    ext = _ext(Export(), bucket_size_mb=1.0, pack=False, group_by_module=True)
    chunks = _collect(ext)
    assert not any(c.packed for c in chunks)
    q = dict(zip(chunks[0].names, chunks[0].tensors, strict=True))
    assert not q["model.layers.0.self_attn.q_proj.weight"].is_contiguous()  # as given


def test_cast_dedup_and_metadata_from_one_export() -> None:
    export = Export(tied_twice=True)
    ext = _ext(export)
    model = torch.nn.Linear(2, 2)
    metas = ext.metadata(model, "bfloat16")
    assert [m.name for m in metas] == list(SHAPES)  # the second embedding copy is dropped
    assert {m.dtype for m in metas} == {"bfloat16"}
    assert export.calls == 1
    assert [m.dtype for m in ext.metadata(model)] == ["float32"] * len(SHAPES)
    assert export.calls == 1  # same model: no second export
    chunks = _collect(ext, model, torch.bfloat16)
    assert export.calls == 2
    got = [(n, t.dtype, list(t.shape)) for c in chunks for n, t in zip(c.names, c.tensors,
                                                                        strict=True)]
    assert got == [(m.name, torch.bfloat16, m.shape) for m in metas]
    with torch.no_grad():
        model.weight.data = torch.zeros(3, 2)  # another shape: the model changed
    ext.metadata(model)
    assert export.calls == 3


def test_non_sender_runs_the_export_and_keeps_nothing() -> None:
    export = Export()
    ext = MegatronWeightExtractor(MegatronExtractorConfig(rank=1, src_rank=0), bridge=export)
    assert not ext.is_sender
    assert _collect(ext) == []
    assert export.calls == 1 and ext.memory.peak_bytes == 0


def test_consumer_stopping_early_still_runs_the_whole_export() -> None:
    pulled: list[str] = []
    export = Export()

    def counting(models):
        for name, t in export(models):
            pulled.append(name)
            yield name, t

    ext = _ext(counting, bucket_size_mb=1000 / (1 << 20))

    async def first_only():
        it = ext.extract_weights(torch.nn.Linear(2, 2))
        chunk = await anext(it)
        await it.aclose()
        return chunk

    assert asyncio.run(first_only()).names == ["model.embed_tokens.weight"]
    assert pulled == list(SHAPES)  # the rest was exported (the collectives ran) and dropped
    ext.drain(torch.nn.Linear(2, 2))
    assert pulled == list(SHAPES) * 2


def test_memory_bound_counts_live_packed_buffers() -> None:
    ext = _ext(Export(), bucket_size_mb=3000 / (1 << 20))
    held = _collect(ext)  # the consumer keeps every chunk: nothing frees a buffer
    total = sum(c.total_size_bytes for c in held)
    assert ext.memory.live_bytes == total
    del held
    assert ext.memory.live_bytes == 0


def test_bridges_are_recognised_by_their_export_method() -> None:
    calls = []

    class MegatronBridgeLike:
        def export_hf_weights(self, model, cpu=False, show_progress=True):
            calls.append(("export_hf_weights", cpu, show_progress))
            return iter([("a", torch.zeros(1))])

    class MBridgeLike:
        def export_weights(self, models):
            calls.append(("export_weights",))
            return iter([("b", torch.zeros(1))])

    assert list(export_function(MegatronBridgeLike())([1])) == [("a", torch.zeros(1))]
    assert list(export_function(MBridgeLike())([1])) == [("b", torch.zeros(1))]
    assert calls == [("export_hf_weights", False, False), ("export_weights",)]
    with pytest.raises(TypeError, match="export_hf_weights"):
        export_function(object())


def test_needs_a_bridge_or_a_path_and_names_both_packages(monkeypatch) -> None:
    with pytest.raises(ValueError, match="needs a bridge"):
        build_extractor({"type": "megatron"})
    with pytest.raises(ValueError, match="bridge_package"):
        build_extractor({"type": "megatron", "hf_model_path": "/x", "bridge_package": "nemo"})
    # neither package importable (a None entry in sys.modules makes the import fail)
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    monkeypatch.setitem(sys.modules, "mbridge", None)
    ext = build_extractor({"type": "megatron", "hf_model_path": "/x", "is_sender": True})
    assert ext.lockstep
    with pytest.raises(ImportError, match="Megatron-Bridge.*mbridge"):
        _collect(ext)
