"""The benchmark's on-device bit-exact check (``weightsync.bench.checksum``) and the expected
metadata of an engine without a checkpoint (``weightsync._runtime.vllm_compat.config_metadata``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from weightsync.bench.checksum import (  # noqa: E402
    expected_engine_tensors,
    fused_name,
    tensor_checksums,
    tp_slice,
)

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _sum(t):
    return tensor_checksums([("x", t)])["x"]


def test_checksum_sees_one_changed_element_swapped_rows_and_dtype_bits():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 33, generator=g).to(torch.bfloat16)
    base = _sum(t)
    assert _sum(t.clone()) == base  # deterministic, value based
    u = t.clone()
    u[17, 5] = u[17, 5] + 1
    assert _sum(u) != base
    assert _sum(t[[1, 0, *range(2, 64)]]) != base  # rows swapped
    z = torch.zeros(8)
    assert _sum(z) != _sum(-z)  # -0.0 differs from 0.0 in its bits
    assert _sum(torch.zeros(8)) != _sum(torch.zeros(9))  # length counts


def test_checksum_of_large_tensor_spans_blocks(monkeypatch):
    import weightsync.bench.checksum as cs

    monkeypatch.setattr(cs, "BLOCK", 1000)
    cs._weights_cache.clear()
    try:
        t = torch.arange(2500, dtype=torch.int32)
        base = _sum(t)
        u = t.clone()
        u[2400] += 1  # in the third block
        assert _sum(u) != base
        v = t.clone()
        v[:1000], v[1000:2000] = t[1000:2000].clone(), t[:1000].clone()  # blocks swapped
        assert _sum(v) != base
    finally:
        cs._weights_cache.clear()


def test_fused_names_follow_the_packed_mapping():
    assert fused_name("model.layers.3.self_attn.k_proj.bias", PACKED) == (
        "model.layers.3.self_attn.qkv_proj.bias", 1, 3)
    assert fused_name("model.layers.0.mlp.up_proj.weight", PACKED) == (
        "model.layers.0.mlp.gate_up_proj.weight", 1, 2)
    assert fused_name("model.norm.weight", PACKED) == ("model.norm.weight", 0, 1)


def test_expected_engine_tensors_fuse_and_shard():
    h, kv, inter = 8, 4, 12
    named = [
        ("model.layers.0.self_attn.q_proj.weight", torch.full((h, h), 1.0)),
        ("model.layers.0.self_attn.k_proj.weight", torch.full((kv, h), 2.0)),
        ("model.layers.0.self_attn.v_proj.weight", torch.full((kv, h), 3.0)),
        ("model.layers.0.self_attn.o_proj.weight",
         torch.arange(h * h, dtype=torch.float32).view(h, h)),
        ("model.layers.0.mlp.gate_proj.weight", torch.full((inter, h), 4.0)),
        ("model.layers.0.mlp.up_proj.weight", torch.full((inter, h), 5.0)),
        ("model.layers.0.input_layernorm.weight", torch.ones(h)),
    ]
    full = dict(expected_engine_tensors(named, PACKED))
    qkv = full["model.layers.0.self_attn.qkv_proj.weight"]
    assert list(qkv.shape) == [h + 2 * kv, h]
    assert qkv[:h].eq(1).all() and qkv[h:h + kv].eq(2).all() and qkv[h + kv:].eq(3).all()
    assert list(full["model.layers.0.mlp.gate_up_proj.weight"].shape) == [2 * inter, h]
    rank1 = dict(expected_engine_tensors(named, PACKED, tp_rank=1, tp_size=2))
    qkv1 = rank1["model.layers.0.self_attn.qkv_proj.weight"]
    assert list(qkv1.shape) == [h // 2 + kv, h]  # each member's second half, concatenated
    assert qkv1[: h // 2].eq(1).all() and qkv1[h // 2: h // 2 + kv // 2].eq(2).all()
    o1 = rank1["model.layers.0.self_attn.o_proj.weight"]  # row parallel: columns split
    assert torch.equal(o1, named[3][1][:, h // 2:])
    assert torch.equal(rank1["model.layers.0.input_layernorm.weight"], torch.ones(h))


def test_tp_slice_replicates_what_does_not_divide():
    t = torch.ones(3, 8)
    assert tp_slice("model.layers.0.self_attn.k_proj.weight", t, 1, 2) is t


def test_expected_engine_tensors_refuses_incomplete_fused_layer():
    with pytest.raises(ValueError, match="qkv_proj"):
        list(expected_engine_tensors(
            [("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2))], PACKED))


def test_config_metadata_lists_checkpoint_names_without_tied_head():
    transformers = pytest.importorskip("transformers")
    from weightsync._runtime.vllm_compat import config_metadata
    from weightsync.bench.shapes import shape_specs

    cfg = transformers.Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    meta = config_metadata(cfg)
    want = {n: list(s) for n, s in shape_specs("qwen2-0.5b")}
    assert {n: m[1] for n, m in meta.items()} == want  # same names and shapes, no lm_head
    cfg.architectures = ["NoSuchModelForCausalLM"]
    assert config_metadata(cfg) is None
