"""The reward loop's configuration: verl's YAML sections, typed and checked.

verl configures the reward loop with two sections of its trainer config, and so do we:

.. code:: yaml

    actor_rollout_ref:
      model: {path: /models/policy}          # the policy's tokenizer decodes responses
    reward_model:
      enable: true                           # a reward model behind the router
      reward_manager: naive                  # a name in the manager registry
      num_workers: 2                         # RewardLoopWorker actors
      model: {path: /models/rm}              # its tokenizer renders the chat it scores
      server_urls: [http://10.0.0.5:8001]    # ours: the reward servers the router spreads over
      reward_weights: {function: 1.0, model: 0.5}   # ours: combine rule and model scores
    custom_reward_function: {path: null, name: compute_score}

``reward_loop_config(src)`` takes a YAML path, a mapping, an OmegaConf node or a
``RewardLoopConfig`` and returns an OmegaConf ``DictConfig`` with every default filled in, the
object reward managers receive (``config.reward_model.get("reward_kwargs", {})`` works as in
verl). ``reward_model`` and ``custom_reward_function`` are checked against the dataclasses
below: an unknown key is an error that lists the valid ones (verl keys that configure its own
FSDP reward worker are accepted and ignored: ``VERL_IGNORED_KEYS``); every other section of a
verl config passes through untouched. ``RewardLoopConfig.from_any(src)`` gives the typed view.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.reward_loop.router import RouterConfig

#: the weights ``reward_weights`` may give: the reward function's score, the reward model's
WEIGHT_KEYS = ("function", "model")

#: keys of verl's ``reward_model`` section that set up its FSDP/Megatron reward worker, which
#: the reward loop replaces: accepted (a verl YAML loads unchanged) and not used
VERL_IGNORED_KEYS = (
    "strategy", "micro_batch_size", "micro_batch_size_per_gpu", "max_length",
    "use_dynamic_bsz", "forward_max_token_len_per_gpu", "ulysses_sequence_parallel_size",
    "launch_reward_fn_async", "sandbox_fusion", "enable_resource_pool", "n_gpus_per_node",
    "nnodes", "use_reward_loop", "profiler", "use_fused_kernels",
)
#: keys of verl's ``reward_model.rollout`` that tune its own vLLM replicas: accepted, not used
VERL_IGNORED_ROLLOUT_KEYS = (
    "_target_", "cudagraph_capture_sizes", "data_parallel_size", "expert_parallel_size",
    "max_num_batched_tokens", "load_format", "engine_kwargs", "limit_images",
    "enable_chunked_prefill", "enable_prefix_caching", "disable_log_stats", "prompt_length",
    "response_length",
)


@dataclass(kw_only=True)
class RewardModelPathConfig:
    """``reward_model.model``: ``path`` (its tokenizer renders the chat a discriminative model
    scores), ``served_model_name`` (ours: the ``model`` field sent to ``/classify``; default
    ``path``, which is what a reward server started with ``--model PATH`` answers to)."""

    path: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    external_lib: str | None = None
    input_tokenizer: str | None = None


@dataclass(kw_only=True)
class RewardRolloutConfig:
    """``reward_model.rollout``: ``name`` (the engine behind the servers; ``vllm``),
    ``free_cache_engine`` (colocate mode: the servers sleep after start-up and between
    batches, woken to score), ``sleep_level`` (ours: vLLM's sleep level, 1 keeps the weights
    in host memory, 2 discards them), ``skip_tokenizer_init`` (must stay false).

    For servers launched on a resource pool (``RewardModelManager(config, resource_pool)``):
    verl's ``tensor_model_parallel_size`` (bundles per server), ``dtype``,
    ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``, ``enforce_eager`` (None:
    the server's default), and ours: ``server`` (``reward``: ``weightsync serve-reward``;
    ``policy``: ``weightsync serve-policy``, a generative judge), ``server_args`` (more
    command-line arguments), ``start_timeout_s`` (per server)."""

    name: str = "vllm"
    free_cache_engine: bool = False
    sleep_level: int = 1
    skip_tokenizer_init: bool = False
    tensor_model_parallel_size: int = 1
    dtype: str | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    server: str = "reward"
    server_args: list = field(default_factory=list)
    start_timeout_s: float = 600.0


@dataclass(kw_only=True)
class RewardModelSection:
    """verl's ``reward_model`` section (the names and defaults of verl's reward loop), plus
    ``server_urls``, ``reward_weights`` and ``router`` (ours)."""

    enable: bool = False
    reward_manager: str = "naive"
    reward_loop_source: str = "register"  # or "importlib" (module path + class name)
    reward_loop_module_path: str | None = None
    reward_loop_class_name: str | None = None
    num_workers: int = 1
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    rollout: RewardRolloutConfig = field(default_factory=RewardRolloutConfig)
    reward_kwargs: dict = field(default_factory=dict)
    reward_weights: dict | None = None
    server_urls: list = field(default_factory=list)
    router: RouterConfig = field(default_factory=RouterConfig)
    # RateLimitRewardManager
    max_concurrent: int = 1
    max_rpm: int | None = None
    max_tpm: int | None = None
    estimated_tokens_per_request: int = 2000
    timeout: float = 300.0


@dataclass(kw_only=True)
class CustomRewardFunctionConfig:
    """verl's ``custom_reward_function``: a Python file, the function's name in it, and
    keyword arguments bound to every call."""

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class RewardLoopConfig:
    """The typed view: the two sections, and the policy tokenizer's path
    (``actor_rollout_ref.model.path``)."""

    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=CustomRewardFunctionConfig)
    policy_path: str | None = None

    @classmethod
    def from_any(cls, src: Any) -> RewardLoopConfig:
        if isinstance(src, RewardLoopConfig):
            return src
        data = _plain(src)
        if not isinstance(data, Mapping):
            raise ValueError(f"reward loop config must be a mapping, got {type(data).__name__}")
        rm = dict(data.get("reward_model") or {})
        for key in VERL_IGNORED_KEYS:
            rm.pop(key, None)
        if isinstance(rm.get("rollout"), Mapping):
            rm["rollout"] = {k: v for k, v in rm["rollout"].items()
                             if k not in VERL_IGNORED_ROLLOUT_KEYS}
        cfg = cls(
            reward_model=_section(RewardModelSection, rm, "reward_model"),
            custom_reward_function=_section(CustomRewardFunctionConfig,
                                            dict(data.get("custom_reward_function") or {}),
                                            "custom_reward_function"),
            policy_path=((data.get("actor_rollout_ref") or {}).get("model") or {}).get("path"),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        """Cross-field rules; each error names the key."""
        rm = self.reward_model
        if rm.num_workers < 1:
            raise ValueError(f"reward_model.num_workers: must be >= 1, got {rm.num_workers}")
        if rm.reward_loop_source not in ("register", "importlib"):
            raise ValueError(f"reward_model.reward_loop_source: 'register' or 'importlib', got "
                             f"{rm.reward_loop_source!r}")
        if rm.reward_loop_source == "importlib" and not (
                rm.reward_loop_module_path and rm.reward_loop_class_name):
            raise ValueError("reward_model.reward_loop_source 'importlib' needs "
                             "reward_loop_module_path and reward_loop_class_name")
        if rm.rollout.sleep_level not in (1, 2):
            raise ValueError(f"reward_model.rollout.sleep_level: 1 or 2, got "
                             f"{rm.rollout.sleep_level}")
        if rm.rollout.tensor_model_parallel_size < 1:
            raise ValueError(f"reward_model.rollout.tensor_model_parallel_size: must be >= 1, "
                             f"got {rm.rollout.tensor_model_parallel_size}")
        if rm.rollout.server not in ("reward", "policy"):
            raise ValueError(f"reward_model.rollout.server: 'reward' (serve-reward) or 'policy' "
                             f"(serve-policy, a judge), got {rm.rollout.server!r}")
        if not rm.rollout.start_timeout_s > 0:
            raise ValueError(f"reward_model.rollout.start_timeout_s: must be > 0, got "
                             f"{rm.rollout.start_timeout_s}")
        if rm.rollout.skip_tokenizer_init:
            raise ValueError("reward_model.rollout.skip_tokenizer_init: must be false (the "
                             "reward model's tokenizer renders what it scores)")
        if rm.reward_weights is not None:
            weights = dict(rm.reward_weights)
            unknown = sorted(set(weights) - set(WEIGHT_KEYS))
            if unknown or not weights:
                raise ValueError(f"reward_model.reward_weights: keys {unknown or '(none)'} "
                                 f"unknown; give weights for {' and/or '.join(WEIGHT_KEYS)}")
            for key, w in weights.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                    raise ValueError(f"reward_model.reward_weights.{key}: a finite number, "
                                     f"got {w!r}")
            if "model" in weights and not rm.enable:
                raise ValueError("reward_model.reward_weights.model: needs reward_model.enable "
                                 "(a reward model to score with)")
        for i, url in enumerate(rm.server_urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"reward_model.server_urls[{i}]: an http(s) URL, got {url!r}")
        self.reward_model.router.check()

    def to_dict(self) -> dict[str, Any]:
        out = {"reward_model": dataclasses.asdict(self.reward_model),
               "custom_reward_function": dataclasses.asdict(self.custom_reward_function)}
        if self.policy_path is not None:
            out["actor_rollout_ref"] = {"model": {"path": self.policy_path}}
        return out


def reward_loop_config(src: Any) -> Any:
    """-> an OmegaConf ``DictConfig``: ``src`` with both sections checked and their defaults
    filled in (the other sections of a verl config unchanged)."""
    from omegaconf import OmegaConf

    typed = RewardLoopConfig.from_any(src)
    data = typed.to_dict() if isinstance(src, RewardLoopConfig) else dict(_plain(src))
    data.update({k: v for k, v in typed.to_dict().items() if k != "actor_rollout_ref"})
    return OmegaConf.create(data)


def _plain(src: Any) -> Any:
    from weightsync.config import to_plain

    return to_plain(src)


def _section(cls: type, data: dict[str, Any], where: str) -> Any:
    """``cls`` from ``data``, nested dataclass fields built the same way; unknown keys and
    wrong types raise naming ``where.key``."""
    import typing

    from weightsync.config import make_config

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if dataclasses.is_dataclass(hint) and f.name in data:
            value = data[f.name]
            if value is None:
                data.pop(f.name)
                continue
            if not isinstance(value, Mapping):
                raise ValueError(f"{where}.{f.name}: must be a mapping, got {value!r}")
            data[f.name] = _section(hint, dict(value), f"{where}.{f.name}")
    return make_config(cls, data, what=where)
