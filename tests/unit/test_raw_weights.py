"""One extraction per update (``weightsync.raw_weights``): every form ``_extract_raw_weights``
may take is called once, a dict's pairs give the manifest and are let go as they are taken,
and a return value that is not name -> tensor is a clear error naming the extractor."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

import weightsync as ws
from weightsync.raw_weights import ExtractedStream, RawExtraction, extract_raw


def _forms():
    tensors = {"a.weight": torch.ones(2, 3), "a.step": torch.tensor(3)}

    class Dict(ws.WeightExtractor):
        def _extract_raw_weights(self, model, generator_dtype):
            return dict(tensors)

    class AsyncDict(ws.WeightExtractor):
        async def _extract_raw_weights(self, model, generator_dtype):
            return dict(tensors)

    class AsyncGen(ws.WeightExtractor):
        async def _extract_raw_weights(self, model, generator_dtype):
            for pair in tensors.items():
                yield pair

    class Gen(ws.WeightExtractor):
        def _extract_raw_weights(self, model, generator_dtype):
            yield from tensors.items()

    return Dict, AsyncDict, AsyncGen, Gen


@pytest.mark.parametrize("cls", _forms(), ids=lambda c: c.__name__)
def test_every_form_is_called_once_and_a_whole_one_gives_its_manifest(cls):
    ext = cls({})
    got = asyncio.run(extract_raw(ext, None, "bfloat16"))
    if cls.__name__ == "Gen":  # streamed: walked as the chunks are made, never held whole
        assert got.manifest is None and got.pairs is None
    else:  # the float tensor cast in the manifest, the integer one as it is
        assert [(m.name, m.dtype, m.shape) for m in got.manifest] == [
            ("a.weight", "bfloat16", [2, 3]), ("a.step", "int64", [])]
    assert [n for n, _ in got.take()] == ["a.weight", "a.step"]

    async def stream():
        s = ext.extract_weights(None, torch.bfloat16)
        assert isinstance(s, ExtractedStream)
        manifest = await s.manifest()
        return manifest, [c async for c in s]

    manifest, chunks = asyncio.run(stream())
    assert chunks[0].dtypes == [torch.bfloat16] and chunks[1].dtypes == [torch.int64]
    assert (manifest is None) == (cls.__name__ == "Gen")


def test_pairs_are_let_go_as_they_are_taken():
    t = torch.ones(4)
    ref = weakref.ref(t)
    raw = RawExtraction(None, None, {"x": t})
    del t
    taken = raw.take()
    assert raw.pairs is None  # given out once
    name, tensor = next(taken)
    assert name == "x" and ref() is tensor
    del tensor
    gc.collect()
    assert ref() is None  # the extraction holds it no longer


@pytest.mark.parametrize("bad,match", [
    (3, "returned int: expected a dict of name -> tensor"),
    ({"a": [1.0]}, "expected name -> tensor, got str -> list"),
    ([torch.ones(1)], "expected \\(name, tensor\\) pairs, got Tensor"),
])
def test_a_bad_return_value_names_the_extractor(bad, match):
    class Broken(ws.WeightExtractor):
        async def _extract_raw_weights(self, model, generator_dtype):
            return bad

    with pytest.raises(TypeError, match=f"Broken._extract_raw_weights.*{match}"):
        asyncio.run(Broken({}).prepare_update(None))
