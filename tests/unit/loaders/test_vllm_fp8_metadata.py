"""What the vLLM loader expects of an FP8 checkpoint's tensors: its FP8 weights and their scales
keep the checkpoint's dtypes (float8_e4m3fn, float32), every other float takes the served dtype
(``VLLMWeightLoader._build_expected``)."""

from __future__ import annotations

from weightsync.loaders.vllm import fp8_checkpoint_tensors


def test_fp8_weights_and_their_scales_keep_their_dtypes():
    ckpt = {
        "model.layers.0.self_attn.q_proj.weight": ("float8_e4m3fn", [256, 256]),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": ("float32", [2, 2]),
        "model.layers.0.mlp.down_proj.weight": ("float8_e4m3fn", [256, 512]),
        "model.layers.0.mlp.down_proj.weight_scale": ("float32", []),
        "model.layers.0.mlp.down_proj.input_scale": ("float32", []),
        "model.layers.0.mlp.up_proj.weight": ("bfloat16", [512, 256]),
        "model.layers.0.mlp.up_proj.weight_scale": ("float32", []),  # not an FP8 weight's
        "model.norm.weight": ("bfloat16", [256]),
    }
    assert fp8_checkpoint_tensors(ckpt) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale",
        "model.layers.0.mlp.down_proj.input_scale",
    }
    assert fp8_checkpoint_tensors({"a.weight": ("bfloat16", [2, 2])}) == set()
