"""LoRA adapter-only updates, the parts that need no engine: the wire spec, the extractor (a
real PEFT model), and an engine whose loader takes no adapters refusing one before anything
changes. The vLLM side is ``tests/integration/loaders/test_vllm_lora_adapter.py``."""

from __future__ import annotations

import asyncio

import pytest
import torch

import weightsync as ws
from weightsync.errors import UpdateRefusedError
from weightsync.lora_adapter import LoRAAdapterSpec, adapter_id, module_of

CFG = {"r": 4, "lora_alpha": 8, "target_modules": ["q"]}


def test_adapter_ids_are_stable_positive_and_differ_by_name():
    assert adapter_id("policy") == adapter_id("policy")
    assert adapter_id("policy") != adapter_id("policy2")
    assert all(1 <= adapter_id(n) < 2**31 for n in ("", "a", "policy", "x" * 300))
    assert ws.LoRAAdapterSpec("policy", CFG).adapter_id == adapter_id("policy")
    # version slots (serve-policy --adapter-slots): slot 0 is the name's own id
    assert adapter_id("policy", 0) == adapter_id("policy")
    assert len({adapter_id("policy", k) for k in range(4)}) == 4
    spec = LoRAAdapterSpec.from_dict({"name": "policy", "config": CFG, "slot": 1})
    assert spec.adapter_id == adapter_id("policy", 1) != adapter_id("policy")
    assert LoRAAdapterSpec.from_dict(spec.to_dict()) == spec
    assert "slot" not in LoRAAdapterSpec("policy", CFG).to_dict()  # the wire as before


def test_each_slot_is_its_own_adapter_to_vllm():
    """vLLM hashes and compares ``LoRARequest``s by name: two slots of one adapter under one
    name were one adapter in a batch's set of requests, and the other was never activated
    (the engine died: KeyError in vLLM's ``convert_mapping``)."""
    from weightsync.lora_adapter import lora_request

    slots = [lora_request("policy", k) for k in range(3)]
    assert len(set(slots)) == 3 and len({r.lora_int_id for r in slots}) == 3
    assert slots[0].lora_name == "policy"  # slot 0: the name itself, as without slots
    assert lora_request("policy", 2, listed=True).lora_name == "policy"


@pytest.mark.parametrize("bad, message", [
    ({"name": "", "config": CFG}, "lora_adapter.name must be a non-empty string"),
    ({"name": "p", "config": {**CFG, "r": 0}}, "lora_adapter.config.r must be an int > 0"),
    ({"name": "p", "config": {**CFG, "r": True}}, "lora_adapter.config.r must be an int > 0"),
    ({"name": "p", "config": {**CFG, "lora_alpha": "8"}}, "lora_alpha must be a number"),
    ({"name": "p", "config": {**CFG, "target_modules": []}}, "target_modules must name modules"),
    ({"name": "p", "config": CFG, "rank": 4}, r"unknown field\(s\) \['rank'\]"),
    ({"name": "p", "config": CFG, "slot": -1}, "lora_adapter.slot must be an int >= 0"),
    ("policy", "must be a mapping with name and config"),
])
def test_bad_specs_are_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        LoRAAdapterSpec.from_dict(bad)


def test_spec_round_trips_and_reads_rank_patterns():
    spec = LoRAAdapterSpec.from_dict({"name": "p", "config": {
        **CFG, "target_modules": ("q", "v"), "rank_pattern": {"v": 2}}})
    assert spec.config["target_modules"] == ["q", "v"]
    assert LoRAAdapterSpec.from_dict(spec.to_dict()) == spec
    assert (spec.rank_of("model.layers.0.q"), spec.rank_of("model.layers.0.v")) == (4, 2)


def test_module_of_parses_peft_names_only():
    assert module_of("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == (
        "model.layers.0.self_attn.q_proj", "A")
    assert module_of("base_model.model.x.lora_B.weight") == ("x", "B")
    assert module_of("model.layers.0.self_attn.q_proj.weight") is None
    assert module_of("base_model.model.x.lora_A.default.weight") is None


def test_start_refuses_a_lora_adapter_that_is_not_an_object():
    with pytest.raises(ValueError, match=r"lora_adapter must be an object \(\{name, config\}\)"):
        ws.WeightUpdateStart.from_dict({"update_id": "u", "lora_adapter": ["policy"]})


def _peft(**kw):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], lora_dropout=0.0, **kw))


def test_extractor_sends_only_the_adapter_under_peft_names_and_its_config():
    model = _peft()
    ext = ws.build_extractor({"type": "lora_adapter", "adapter_name": "mine"})
    metas = ext.metadata(model)
    assert {m.name for m in metas} == {
        f"base_model.model.model.layers.{i}.{mod}.lora_{ab}.weight"
        for i in range(2) for mod in ("self_attn.q_proj", "mlp.down_proj") for ab in "AB"}
    shapes = {m.name: m.shape for m in metas}
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == [4, 32]
    assert shapes["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] == [32, 4]
    spec = ext.adapter_spec(model)
    assert (spec.name, spec.config["r"], spec.config["lora_alpha"]) == ("mine", 4, 8)
    assert sorted(spec.config["target_modules"]) == ["down_proj", "q_proj"]

    async def chunks():
        return [c async for c in ext.extract_weights(model)]

    made = asyncio.run(chunks())
    got = {n: t for c in made for n, t in zip(c.names, c.tensors, strict=True)}
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    sent = got["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert sent.data_ptr() == layer.lora_B["default"].weight.data_ptr()  # the model's, no copy
    assert all(c.borrowed for c in made)



def test_extractor_holds_its_update_while_the_model_holds_the_same_adapter_tensors():
    """After the first extraction the manifest and chunks are given out again while only the
    values change (an optimizer step); a replaced weight or a swapped A / B module is seen and
    the update made anew."""
    model = _peft()
    ext = ws.build_extractor({"type": "lora_adapter"})

    async def chunks():
        return [c async for c in ext.extract_weights(model)]

    assert ext.held_update(model) is None  # nothing extracted yet
    ext.metadata(model)
    first = asyncio.run(chunks())
    held = ext.held_update(model)
    assert held is not None and held[0] == first
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():  # what an optimizer step does: values only
        layer.lora_B["default"].weight.add_(1.0)
    assert ext.check_held(model)
    chunks_now, metas = ext.held_update(model)
    got = {n: t for c in chunks_now for n, t in zip(c.names, c.tensors, strict=True)}
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(got[name], layer.lora_B["default"].weight)  # today's values
    assert ext.held_update(model, torch.bfloat16) is None  # another dtype: made anew

    layer.lora_B["default"].weight = torch.nn.Parameter(torch.ones(32, 4))  # replaced
    assert not ext.check_held(model) and ext.held_update(model) is None
    again = asyncio.run(chunks())
    got = {n: t for c in again for n, t in zip(c.names, c.tensors, strict=True)}
    assert got[name].data_ptr() == layer.lora_B["default"].weight.data_ptr()

    ext.metadata(model)
    assert ext.check_held(model)
    layer.lora_A["default"] = torch.nn.Linear(32, 4, bias=False)  # a module swapped
    assert not ext.check_held(model)
    got = {n: t for c in asyncio.run(chunks()) for n, t in zip(c.names, c.tensors, strict=True)}
    assert got[name.replace("lora_B", "lora_A")].data_ptr() == (
        layer.lora_A["default"].weight.data_ptr())  # the new module's weight is sent


def test_extractor_refuses_dora_and_models_without_the_adapter():
    with pytest.raises(ValueError, match="uses DoRA, which vLLM does not serve"):
        ws.build_extractor({"type": "lora_adapter"}).metadata(_peft(use_dora=True))
    with pytest.raises(ValueError, match="no PEFT adapter 'other'"):
        ws.build_extractor({"type": "lora_adapter", "peft_adapter": "other"}).metadata(_peft())


def test_an_engine_without_adapters_refuses_an_adapter_update_and_changes_nothing():
    module = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    ep = ws.WeightUpdateEndpoint(ws.TorchModuleWeightLoader(module=module), name="eng")
    start = ws.WeightUpdateStart(update_id="u", version=1, lora_adapter={"name": "p",
                                                                         "config": CFG})
    with pytest.raises(UpdateRefusedError, match="takes no LoRA adapter updates"):
        asyncio.run(ep.start_weight_update(start.to_dict()))
    bad = ws.WeightUpdateStart(update_id="v", lora_adapter={"name": "p", "config": {"r": 1}})
    with pytest.raises(UpdateRefusedError, match="lora_adapter.config.lora_alpha"):
        asyncio.run(ep.start_weight_update(bad.to_dict()))
    assert (ep.version, ep.state) == (0, "idle")
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
