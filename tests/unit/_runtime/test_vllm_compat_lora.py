"""``vllm_compat.lora_layers_unwrapped``: in an engine started with ``enable_lora`` vLLM wraps
each LoRA-capable layer, so its weights are named ``...qkv_proj.base_layer.weight`` and vLLM
0.26's ``model.load_weights`` cannot find ``...qkv_proj.weight`` (seen on 2 x H200 with the
LoRA bench, 2026-11-26: the full push into a LoRA-enabled engine failed with "There is no module
or parameter named 'layers.0.self_attn.qkv_proj.weight'"). During a load the wrappers step
aside for the layers they wrap, and come back afterwards, also when the load fails.

The wrapper here is vLLM's own class (``MergedQKVParallelLinearWithLoRA``) created without its
``__init__`` (which needs a tensor-parallel group) around a plain linear layer."""

from __future__ import annotations

import pytest
import torch

from weightsync._runtime.vllm_compat import lora_layers_unwrapped


def _wrapped_model():
    from vllm.lora.layers import MergedQKVParallelLinearWithLoRA

    base = torch.nn.Linear(4, 6)
    wrapper = MergedQKVParallelLinearWithLoRA.__new__(MergedQKVParallelLinearWithLoRA)
    torch.nn.Module.__init__(wrapper)
    wrapper.base_layer = base
    attn = torch.nn.Module()
    attn.qkv_proj = wrapper
    model = torch.nn.Module()
    model.self_attn = attn
    return model, wrapper, base


def test_the_weights_go_by_their_checkpoint_names_during_a_load_and_the_wrapper_returns():
    model, wrapper, base = _wrapped_model()
    assert "self_attn.qkv_proj.base_layer.weight" in dict(model.named_parameters())
    with lora_layers_unwrapped(model) as n:
        assert n == 1
        params = dict(model.named_parameters())
        assert set(params) == {"self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"}
        params["self_attn.qkv_proj.weight"].data.fill_(3.0)  # what load_weights does
    assert model.self_attn.qkv_proj is wrapper
    assert torch.equal(wrapper.base_layer.weight, torch.full((6, 4), 3.0))  # the same tensor
    assert base.weight.data_ptr() == wrapper.base_layer.weight.data_ptr()


def test_the_wrappers_come_back_when_the_load_fails():
    model, wrapper, _ = _wrapped_model()
    with pytest.raises(KeyError), lora_layers_unwrapped(model):
        raise KeyError("a load that failed")
    assert model.self_attn.qkv_proj is wrapper


def test_a_model_without_lora_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with lora_layers_unwrapped(model) as n:
        assert n == 0
    assert isinstance(model[0], torch.nn.Linear)
