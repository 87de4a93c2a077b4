"""Pure helpers of the vLLM loader: checkpoint metadata from safetensors headers, vLLM's fused
layers, worker answers -> exceptions. Fast; no engine started."""

from __future__ import annotations

import pytest
import torch

from weightsync._runtime import vllm_compat as compat
from weightsync.errors import UpdateIncompleteError, WeightMismatchError, WeightSyncError
from weightsync.loaders.vllm_worker import raise_for_results

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_checkpoint_metadata_reads_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
              str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(1, dtype=torch.int64)}, str(tmp_path / "model-00002.safetensors"))
    meta = compat.checkpoint_metadata(str(tmp_path))
    assert meta == {"a.weight": ("float32", [2, 3]), "b": ("bfloat16", [4]), "c": ("int64", [1])}
    assert compat.checkpoint_metadata(str(tmp_path / "missing")) is None


def test_tiny_model_checkpoint_names(tmp_path):
    from weightsync.testing.tiny_models import build_tiny_reward_model

    meta = compat.checkpoint_metadata(build_tiny_reward_model(tmp_path / "m"))
    assert meta["score.weight"] == ("float32", [1, 64])
    assert meta["model.layers.0.self_attn.k_proj.weight"] == ("float32", [32, 64])  # 1 KV head


def test_fused_layers():
    key = compat.fused_layer_key
    assert key("model.layers.3.self_attn.k_proj.weight", PACKED) == "model.layers.3.self_attn.qkv_proj"
    assert key("model.layers.3.self_attn.q_proj.bias", PACKED) == "model.layers.3.self_attn.qkv_proj"
    assert key("model.layers.3.mlp.up_proj.weight", PACKED) == "model.layers.3.mlp.gate_up_proj"
    assert key("model.layers.3.mlp.down_proj.weight", PACKED) == "model.layers.3.mlp.down_proj"
    assert key("score.weight", PACKED) == "score"
    groups = compat.layer_groups(
        ["m.l.0.a.q_proj.weight", "m.l.0.a.k_proj.weight", "m.l.0.a.v_proj.weight", "m.norm.weight"],
        PACKED,
    )
    assert groups == {"m.l.0.a.qkv_proj": {"m.l.0.a.q_proj.weight", "m.l.0.a.k_proj.weight",
                                           "m.l.0.a.v_proj.weight"},
                      "m.norm": {"m.norm.weight"}}


def test_load_mode_validation():
    class W:
        device = torch.device("cpu")
        model_config = type("MC", (), {"quantization": None})()

    assert compat.resolve_load_mode(W(), "auto") == "reload"
    assert compat.resolve_load_mode(W(), "direct") == "direct"
    with pytest.raises(ValueError, match="load_mode"):
        compat.resolve_load_mode(W(), "fast")


def test_worker_answers_become_exceptions():
    ok = {"ok": True, "result": 3, "state": {}}
    assert raise_for_results([ok, ok]) == [3, 3]
    with pytest.raises(WeightMismatchError) as ei:
        raise_for_results([ok, {"ok": False, "error_type": "WeightMismatchError", "error": "x",
                                "offenders": ["a: shape [1] but target has [2]"]}])
    assert ei.value.offenders == ["a: shape [1] but target has [2]"]
    with pytest.raises(UpdateIncompleteError):
        raise_for_results([{"ok": False, "error_type": "UpdateIncompleteError", "error": "torn"}])
    with pytest.raises(WeightSyncError, match="RuntimeError: boom"):
        raise_for_results([{"ok": False, "error_type": "RuntimeError", "error": "boom"}])
    with pytest.raises(WeightSyncError, match="unexpected"):
        raise_for_results(["garbage"])
