"""Reward-server configuration: YAML presets, flag precedence, device defaults for vLLM."""

from __future__ import annotations

import pytest

from weightsync.config import preset_path
from weightsync.servers.reward import RewardServerConfig, engine_args, parse_args


def test_presets_load_and_flags_win(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_API_KEY", raising=False)
    cfg = parse_args(["--config", preset_path("reward_server"), "--model", "m",
                      "--port", "9001"])
    assert cfg.port == 9001 and cfg.model == "m" and cfg.device == "cpu"
    assert cfg.host == "127.0.0.1"  # loopback unless --host says otherwise
    assert cfg.kv_cache_memory_bytes == 256 << 20 and cfg.api_key is None
    gpu = parse_args(["--config", preset_path("reward_server_gpu"), "--model", "m"])
    assert gpu.device == "cuda" and gpu.gpu_memory_utilization is None and gpu.enforce_eager is False
    assert gpu.host == parse_args(["--model", "m"]).host == "127.0.0.1"


def test_warmup_is_on_unless_turned_off_and_help_says_its_cost(capsys):
    assert parse_args(["--model", "m"]).warmup is True
    assert parse_args(["--model", "m", "--no-warmup"]).warmup is False
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--warmup, --no-warmup" in text and "costs at start: 0.02 s on 2 CPU cores" in text


def test_api_key_from_env_and_required_model(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_API_KEY", "k")
    assert parse_args(["--model", "m"]).api_key == "k"
    assert parse_args(["--model", "m", "--api-key", "x"]).api_key == "x"
    with pytest.raises(SystemExit):
        parse_args([])


def test_unknown_yaml_field_is_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: m\nport: 1\ngpu_util: 0.5\n")
    with pytest.raises(ValueError, match="gpu_util"):
        parse_args(["--config", str(p)])


@pytest.mark.slow  # imports vllm (~5 s)
def test_engine_args_cpu_defaults(tiny_reward_model_dir):
    d = tiny_reward_model_dir
    args = engine_args(RewardServerConfig(model=d, device="cpu", pooling_type="mean"))
    assert args.runner == "pooling" and args.dtype == "float32" and args.enforce_eager is True
    assert args.kv_cache_memory_bytes == 256 << 20
    assert args.worker_extension_cls == "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"
    pooler = args.pooler_config
    assert "MEAN" in (getattr(pooler, "seq_pooling_type", None), getattr(pooler, "pooling_type", None))
    gpu = engine_args(RewardServerConfig(model=d, device="cuda", gpu_memory_utilization=0.25))
    assert gpu.dtype == "auto" and gpu.gpu_memory_utilization == 0.25 and gpu.enforce_eager is False
    with pytest.raises(ValueError, match="model"):
        engine_args(RewardServerConfig())


@pytest.mark.slow  # imports vllm (~5 s)
def test_token_pooling_fields_reach_vllms_pooler_config(tiny_reward_model_dir):
    d = tiny_reward_model_dir
    args = engine_args(RewardServerConfig(model=d, device="cpu", tok_pooling_type="step",
                                          step_tag_id=3, returned_token_ids=[0]))
    pooler = args.pooler_config
    assert (pooler.tok_pooling_type, pooler.step_tag_id, pooler.returned_token_ids) == (
        "STEP", 3, [0])
    assert engine_args(RewardServerConfig(model=d, device="cpu")).pooler_config is None
    both = engine_args(RewardServerConfig(model=d, device="cpu", pooling_type="LAST",
                                          tok_pooling_type="ALL")).pooler_config
    assert (both.seq_pooling_type, both.tok_pooling_type) == ("LAST", "ALL")
    with pytest.raises(ValueError, match="returned_token_ids: only with tok_pooling_type STEP"):
        engine_args(RewardServerConfig(model=d, device="cpu", returned_token_ids=[0]))
    with pytest.raises(ValueError, match="tok_pooling_type: must be ALL or STEP"):
        engine_args(RewardServerConfig(model=d, device="cpu", tok_pooling_type="last"))
    cfg = parse_args(["--model", "m", "--tok-pooling-type", "STEP", "--step-tag-id", "3",
                      "--returned-token-ids", "0,2"])
    assert (cfg.tok_pooling_type, cfg.step_tag_id, cfg.returned_token_ids) == ("STEP", 3, [0, 2])
