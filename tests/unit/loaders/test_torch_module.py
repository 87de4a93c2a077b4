"""TorchModuleWeightLoader: in-place copies, validation from the state dict, tied weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync import WeightMismatchError, build_loader
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.types import TensorMeta


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def test_loads_in_place_keeping_storage():
    m = Tied()
    loader = TorchModuleWeightLoader(module=m)
    ptr = m.norm.weight.data_ptr()
    new_w = torch.randn(4)
    asyncio.run(loader.load_weights({"norm.weight": new_w, "steps": torch.tensor([3, 4])}))
    assert torch.equal(m.norm.weight, new_w) and m.norm.weight.data_ptr() == ptr
    assert m.steps.tolist() == [3, 4]
    assert not m.norm.weight.requires_grad or m.norm.weight.grad is None


def test_tied_weights_are_aliases_either_name_updates_both():
    m = Tied()
    loader = TorchModuleWeightLoader(module=m)
    assert loader.aliases == [["embed.weight", "head.weight"]]
    assert "head.weight" in loader.expected_metadata()
    w = torch.randn(10, 4)
    asyncio.run(loader.load_weights({"head.weight": w}))
    assert torch.equal(m.embed.weight, w) and torch.equal(m.head.weight, w)


def test_validation_lists_every_offender_and_loads_nothing():
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    loader = TorchModuleWeightLoader(module=m)
    bad = {
        "norm.weight": torch.zeros(4),  # fine
        "norm.bias": torch.zeros(5),  # shape
        "embed.weight": torch.zeros(10, 4, dtype=torch.float16),  # dtype
        "embd.weight": torch.zeros(10, 4),  # unknown, close to a real name
    }
    with pytest.raises(WeightMismatchError) as ei:
        asyncio.run(loader.load_weights(bad))
    text = "\n".join(ei.value.offenders)
    assert len(ei.value.offenders) == 3
    assert "norm.bias: shape [5] but target has [4]" in text
    assert "embed.weight: dtype float16 but target has float32" in text
    assert "embd.weight: not a parameter" in text and "did you mean 'embed.weight'" in text
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing changed, not even norm.weight


def test_metadata_validation_and_lenient_dtype():
    m = Tied()
    loader = TorchModuleWeightLoader(module=m, strict_dtype=False)
    loader.validate([TensorMeta("norm.weight", "bfloat16", [4])])  # cast on copy allowed
    asyncio.run(loader.load_weights({"norm.weight": torch.ones(4, dtype=torch.bfloat16)}))
    assert m.norm.weight.dtype == torch.float32 and m.norm.weight.sum() == 4
    with pytest.raises(WeightMismatchError):
        loader.validate([TensorMeta("norm.weight", "bfloat16", [5])])


def test_built_from_registry_and_rejects_non_modules():
    loader = build_loader({"type": "torch_module"}, module=Tied())
    assert isinstance(loader, TorchModuleWeightLoader)
    with pytest.raises(TypeError, match="nn.Module"):
        TorchModuleWeightLoader(module={"not": "a module"})
