"""The reward loop's YAML: verl's sections typed and checked, defaults filled in, other
sections of a verl config untouched."""

from __future__ import annotations

import textwrap

import pytest

from weightsync.reward_loop.config import RewardLoopConfig, reward_loop_config

VERL_YAML = textwrap.dedent("""
    data: {train_batch_size: 64, reward_fn_key: data_source}
    actor_rollout_ref:
      model: {path: /models/policy}
      rollout: {name: vllm, n: 4}
    reward_model:
      enable: true
      reward_manager: dapo
      num_workers: 2
      micro_batch_size_per_gpu: 8        # verl's FSDP reward worker: accepted, not used
      model: {path: /models/rm}
      server_urls: [http://127.0.0.1:8001, http://127.0.0.1:8002]
      reward_weights: {function: 1.0, model: 0.25}
      reward_kwargs:
        overlong_buffer_cfg: {enable: true, len: 128, penalty_factor: 1.0, log: false}
        max_resp_len: 1024
      router: {max_retries: 2}
    custom_reward_function: {path: null, name: compute_score}
""")


def test_a_verl_yaml_loads_with_defaults_filled_in(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(VERL_YAML)
    cfg = reward_loop_config(str(path))
    rm = cfg.reward_model
    assert rm.reward_manager == "dapo" and rm.num_workers == 2
    assert rm.reward_kwargs.overlong_buffer_cfg.len == 128
    assert rm.reward_weights == {"function": 1.0, "model": 0.25}
    assert rm.router.max_retries == 2 and rm.router.allow_mixed_versions is False  # default
    assert rm.rollout.name == "vllm" and rm.rollout.sleep_level == 1
    assert rm.get("max_concurrent") == 1  # verl-style access works
    assert "micro_batch_size_per_gpu" not in rm
    assert cfg.data.train_batch_size == 64  # other sections pass through
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.actor_rollout_ref.model.path == "/models/policy"
    typed = RewardLoopConfig.from_any(cfg)
    assert typed.policy_path == "/models/policy" and typed.reward_model.server_urls[1].endswith("8002")


@pytest.mark.parametrize(("section", "message"), [
    ({"reward_model": {"reward_manger": "naive"}},
     r"reward_model: unknown field\(s\) \['reward_manger'\]; valid fields: .*reward_manager"),
    ({"reward_model": {"router": {"max_retry": 1}}},
     r"reward_model.router: unknown field\(s\) \['max_retry'\]"),
    ({"reward_model": {"num_workers": "two"}}, r"field 'num_workers' must be int"),
    ({"reward_model": {"num_workers": 0}}, r"reward_model.num_workers: must be >= 1"),
    ({"reward_model": {"reward_weights": {"rule": 1.0}}},
     r"reward_model.reward_weights: keys \['rule'\] unknown; give weights for function and/or model"),
    ({"reward_model": {"reward_weights": {"model": 1.0}}},
     r"reward_model.reward_weights.model: needs reward_model.enable"),
    ({"reward_model": {"enable": True, "reward_weights": {"model": float("nan")}}},
     r"reward_model.reward_weights.model: a finite number"),
    ({"reward_model": {"rollout": {"sleep_level": 3}}}, r"sleep_level: 1 or 2, got 3"),
    ({"reward_model": {"rollout": {"tensor_model_parallel_size": 0}}},
     r"rollout.tensor_model_parallel_size: must be >= 1, got 0"),
    ({"reward_model": {"rollout": {"server": "sglang"}}},
     r"rollout.server: 'reward' \(serve-reward\) or 'policy'"),
    ({"reward_model": {"rollout": {"start_timeout_s": 0}}},
     r"rollout.start_timeout_s: must be > 0"),
    ({"reward_model": {"server_urls": ["127.0.0.1:8001"]}}, r"server_urls\[0\]: an http\(s\) URL"),
    ({"reward_model": {"router": {"max_retries": -1}}}, r"router.max_retries: must be >= 0"),
    ({"reward_model": {"reward_loop_source": "importlib"}},
     r"'importlib' needs reward_loop_module_path and reward_loop_class_name"),
    ({"custom_reward_function": {"file": "x.py"}},
     r"custom_reward_function: unknown field\(s\) \['file'\]"),
])
def test_bad_config_names_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        reward_loop_config(section)


def test_an_empty_config_is_verls_defaults():
    cfg = reward_loop_config({})
    assert cfg.reward_model.enable is False and cfg.reward_model.reward_manager == "naive"
    assert cfg.custom_reward_function.path is None
    assert cfg.custom_reward_function.name == "compute_score"


def test_verls_reward_rollout_section_loads():
    """verl's ``reward_model.rollout`` (dp_reward_loop.yaml): the keys that size a launched
    server are read, the ones that tune verl's own replicas accepted and not used."""
    typed = RewardLoopConfig.from_any({"reward_model": {"rollout": {
        "_target_": "verl.workers.config.RolloutConfig", "name": "vllm", "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5, "enforce_eager": True, "free_cache_engine": True,
        "data_parallel_size": 1, "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192,
        "max_model_len": None, "max_num_seqs": 1024, "engine_kwargs": {},
        "enable_prefix_caching": True, "skip_tokenizer_init": False, "prompt_length": 2048}}})
    r = typed.reward_model.rollout
    assert (r.tensor_model_parallel_size, r.dtype, r.gpu_memory_utilization) == (2, "bfloat16", 0.5)
    assert (r.max_num_seqs, r.enforce_eager, r.server, r.server_args) == (1024, True, "reward", [])
