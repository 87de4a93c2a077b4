"""``weightsync.fp8``: the sender-side FP8 quantisation a trainer uses for an engine that serves
an FP8 checkpoint. The block quantiser equals vLLM's own (``per_block_cast_to_fp8``, DeepGEMM's
reference) bit for bit; the layout is read from a checkpoint as vLLM reads it; the quantised
stream's chunks and manifest agree; bad input is refused naming the tensor or the field."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from weightsync.fp8 import (
    FP8_MAX,
    Fp8Layout,
    quantize_blockwise,
    quantize_per_tensor,
    resolve_layout,
)
from weightsync.types import TensorMeta, WeightChunk


def _vllm_block_reference():
    """vLLM's block quantiser without its ``torch.compile`` wrapper (same code, eager)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable",
                   getattr(per_block_cast_to_fp8, "__wrapped__", per_block_cast_to_fp8))


@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (128, 64)])
def test_block_quantisation_is_vllms_bit_for_bit(shape):
    ref = _vllm_block_reference()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    w[:10, :10] = 0.0  # an all-zero corner: the amax floor
    q, s = quantize_blockwise(w, (128, 128))
    rq, rs = ref(w, [128, 128])
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) == rs.shape
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs.float())


def test_dequantised_weights_are_close_and_per_tensor_scale_is_amax_over_448():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 256, generator=g) * 0.1
    q, s = quantize_blockwise(w, (128, 128))
    deq = (q.float().view(2, 128, 2, 128) * s.view(2, 1, 2, 1)).view(256, 256)
    assert (deq - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    q1, s1 = quantize_per_tensor(w)
    assert s1.shape == () and torch.isclose(s1, w.abs().max() / FP8_MAX)
    assert (q1.float() * s1 - w).abs().max() <= 0.07 * w.abs().max()
    assert q1.float().abs().max() <= FP8_MAX


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_bf16_or_fp16_weight_quantises_as_its_float32_copy_would(dtype):
    """The quantisers read the weight in its own dtype (no float32 copy of it): the bytes are
    those of quantising ``w.float()``, the convention every checkpoint follows."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(200, 300, generator=g) * 0.05).to(dtype)
    for quantize, args in ((quantize_blockwise, ((128, 128),)), (quantize_per_tensor, ())):
        q, s = quantize(w, *args)
        q32, s32 = quantize(w.float(), *args)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)


def _metas(block=True):
    metas = {
        "model.layers.0.self_attn.q_proj.weight": TensorMeta(
            "model.layers.0.self_attn.q_proj.weight", "float8_e4m3fn", [256, 200]),
        "model.layers.0.mlp.down_proj.weight": TensorMeta(
            "model.layers.0.mlp.down_proj.weight", "float8_e4m3fn", [128, 512]),
        "model.norm.weight": TensorMeta("model.norm.weight", "bfloat16", [128]),
        "lm_head.weight": TensorMeta("lm_head.weight", "bfloat16", [512, 128]),
    }
    if block:
        metas["model.layers.0.self_attn.q_proj.weight_scale_inv"] = TensorMeta(
            "model.layers.0.self_attn.q_proj.weight_scale_inv", "float32", [2, 2])
        metas["model.layers.0.mlp.down_proj.weight_scale_inv"] = TensorMeta(
            "model.layers.0.mlp.down_proj.weight_scale_inv", "float32", [1, 4])
    else:
        for n in ("model.layers.0.self_attn.q_proj.", "model.layers.0.mlp.down_proj."):
            metas[n + "weight_scale"] = TensorMeta(n + "weight_scale", "float32", [])
    return metas


def test_layout_from_metadata_and_a_checkpoint(tmp_path):
    from safetensors.torch import save_file

    layout = Fp8Layout.from_metadata(_metas(), [128, 128])
    assert layout.weights == {"model.layers.0.self_attn.q_proj.weight",
                              "model.layers.0.mlp.down_proj.weight"}
    assert layout.weight_block_size == (128, 128)
    per_tensor = Fp8Layout.from_metadata(_metas(block=False))
    assert per_tensor.weight_block_size is None and per_tensor.scale_shape == ()

    tensors = {n: torch.zeros(m.shape, dtype=getattr(torch, m.dtype))
               for n, m in _metas().items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    assert resolve_layout(str(tmp_path)) == layout
    assert resolve_layout(layout) is layout and resolve_layout(None) is None

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quant_method is 'awq', not fp8"):
        Fp8Layout.from_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Fp8Layout.from_checkpoint(tmp_path / "missing")
    with pytest.raises(TypeError, match="quantize"):
        resolve_layout(3)


def test_layout_refuses_scales_that_do_not_fit_and_nothing_fp8():
    metas = _metas()
    metas["model.layers.0.mlp.down_proj.weight_scale_inv"] = TensorMeta(
        "model.layers.0.mlp.down_proj.weight_scale_inv", "float32", [1, 3])
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv: shape \[1, 3\]"):
        Fp8Layout.from_metadata(metas, [128, 128])
    with pytest.raises(ValueError, match="q_proj.weight: FP8 without its weight_scale_inv"):
        Fp8Layout.from_metadata({k: v for k, v in _metas().items()
                                 if not k.endswith("q_proj.weight_scale_inv")}, [128, 128])
    with pytest.raises(ValueError, match="no float8_e4m3fn weight"):
        Fp8Layout.from_metadata({"a.weight": TensorMeta("a.weight", "bfloat16", [4, 4])})
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8Layout(frozenset({"a.weight"}), weight_block_size=(128,))
    with pytest.raises(ValueError, match=r"'\.\.\.weight'"):
        Fp8Layout(frozenset({"a.bias"}))


def test_quantised_chunks_and_manifest_agree_and_others_pass_through():
    layout = Fp8Layout.from_metadata(_metas(), [128, 128])
    g = torch.Generator().manual_seed(2)
    plain = {n: torch.randn(m.shape, generator=g).to(torch.bfloat16)
             for n, m in _metas().items() if not n.endswith("_scale_inv")}
    chunks = [WeightChunk(list(plain)[:2], list(plain.values())[:2], module_name="a"),
              WeightChunk(list(plain)[2:], list(plain.values())[2:])]
    metas = [m for c in chunks for m in c.metas()]

    async def run():
        return [c async for c in layout.quantize_chunks(chunks)]

    out = asyncio.run(run())
    assert [m.to_dict() for c in out for m in c.metas()] == \
        [m.to_dict() for m in layout.manifest(metas)]
    assert out[0].module_name == "a"
    assert out[1] is chunks[1]  # nothing FP8 in it: passed on as it is
    got = dict(zip(out[0].names, out[0].tensors, strict=True))
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert list(got["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == [2, 2]
    assert sum(c.total_size_bytes for c in out) < sum(c.total_size_bytes for c in chunks)
    with pytest.raises(ValueError, match="q_proj.weight: FP8 quantisation needs"):
        layout.quantize("model.layers.0.self_attn.q_proj.weight",
                        torch.zeros(256, 200, dtype=torch.int32))


def test_connect_refuses_delta_with_quantize_and_a_bad_layout_before_connecting(tmp_path):
    import weightsync as ws

    layout = Fp8Layout.from_metadata(_metas(), [128, 128])

    async def run(**kw):
        await ws.connect(["http://127.0.0.1:9"], "broadcast", **kw)

    with pytest.raises(ValueError, match="delta=True with quantize"):
        asyncio.run(run(quantize=layout, delta=True))
    with pytest.raises(FileNotFoundError, match="config.json"):
        asyncio.run(run(quantize=str(tmp_path)))
