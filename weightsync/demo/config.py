"""Typed config of ``weightsync demo``: the ``demo`` preset (``weightsync/configs/demo.yaml``,
shipped in the package) + command-line overrides.

The dataclass defaults are the same as the preset's values (a test checks it). Unknown keys in
the YAML are an error that names them and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.config import make_config, read_preset, to_plain

DEFAULT_PRESET = "demo"  # the shipped preset read when no --config is given

# --strategy NAME -> strategy config; any other name is taken as {"type": NAME}
STRATEGY_PRESETS: dict[str, dict[str, Any]] = {
    "broadcast": {"type": "broadcast", "backend": "gloo"},
    "broadcast_gloo": {"type": "broadcast", "backend": "gloo"},
    "broadcast_nccl": {"type": "broadcast", "backend": "nccl"},
    "cuda_ipc": {"type": "cuda_ipc"},
    "packed_cuda_ipc": {"type": "packed_cuda_ipc"},
}

#: ``rlhf``: the RLHF loop (``weightsync.demo.rlhf``); ``head_only`` / ``full``: one train ->
#: sync -> score cycle of the reward model alone (``weightsync.demo.run``).
DEMO_MODES = ("rlhf", "head_only", "full")
TRAIN_MODES = ("head_only", "full")  # what the reward-model cycle trains


@dataclass(kw_only=True, slots=True)
class ModelSection:
    family: str = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    seed: int = 0


@dataclass(kw_only=True, slots=True)
class DataSection:
    num_train: int = 256
    num_eval: int = 64
    seed: int = 0


@dataclass(kw_only=True, slots=True)
class TrainSection:
    steps: int = 300
    lr: float = 1e-2
    batch_size: int = 64
    full_steps: int = 20
    full_lr: float = 1e-3
    full_batch_size: int = 16
    threads: int = 1
    device: str = "cpu"


@dataclass(kw_only=True, slots=True)
class ServerSection:
    host: str = "127.0.0.1"
    startup_timeout_s: float = 300.0
    max_model_len: int = 256
    extra_args: list[str] = field(default_factory=list)
    policy_extra_args: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class CheckSection:
    max_abs_err: float = 1e-4
    min_accuracy_gain: float = 0.0
    min_reward_rise: float = 0.5
    max_logprob_gap: float = 1e-3
    # the same two with the servers on a GPU: vLLM's float32 attention there runs in Triton,
    # whose dot products round their float32 inputs to TF32 (a 10-bit mantissa); weights that
    # are not the pushed ones miss by whole units
    gpu_max_abs_err: float = 2e-2
    gpu_max_logprob_gap: float = 3e-2

    def tolerances(self, servers_device: str) -> tuple[float, float]:
        """``(max_abs_err, max_logprob_gap)`` for servers on ``servers_device``."""
        if servers_device == "cuda":
            return self.gpu_max_abs_err, self.gpu_max_logprob_gap
        return self.max_abs_err, self.max_logprob_gap


@dataclass(kw_only=True, slots=True)
class PolicySection:
    """The tiny causal LM the RLHF loop trains (``build_tiny_causal_lm``)."""

    family: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    tie_word_embeddings: bool = False
    seed: int = 0


@dataclass(kw_only=True, slots=True)
class RLHFSection:
    """The RLHF loop: the toy task (``weightsync.demo.task``), the reward model's training
    on judge-labelled pairs, and the policy-gradient steps."""

    steps: int = 10
    prompts_per_step: int = 4
    group_size: int = 8
    completion_tokens: int = 16
    temperature: float = 1.0
    lr: float = 2e-2
    epochs: int = 4
    letter: str = "e"
    rm_train_pairs: int = 512
    rm_eval_pairs: int = 128
    rm_steps: int = 150
    rm_lr: float = 3e-3
    rm_batch_size: int = 32
    seed: int = 0


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    mode: str = "rlhf"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    server: ServerSection = field(default_factory=ServerSection)
    strategy: dict[str, Any] = field(
        default_factory=lambda: dict(STRATEGY_PRESETS["broadcast"])
    )
    check: CheckSection = field(default_factory=CheckSection)
    policy: PolicySection = field(default_factory=PolicySection)
    rlhf: RLHFSection = field(default_factory=RLHFSection)

    def validate(self) -> None:
        if self.mode not in DEMO_MODES:
            raise ValueError(f"mode must be one of {DEMO_MODES}, got {self.mode!r}")
        for name, family in (("model", self.model.family), ("policy", self.policy.family)):
            if family not in ("qwen2", "llama"):
                raise ValueError(f"{name}.family must be qwen2 or llama, got {family!r}")
        r = self.rlhf
        for name in ("steps", "prompts_per_step", "completion_tokens", "epochs",
                     "rm_train_pairs", "rm_eval_pairs", "rm_steps", "rm_batch_size"):
            if getattr(r, name) < 1:
                raise ValueError(f"rlhf.{name} must be >= 1, got {getattr(r, name)}")
        if r.group_size < 2:
            raise ValueError(f"rlhf.group_size must be >= 2 (GRPO compares completions of one "
                             f"prompt), got {r.group_size}")
        from weightsync.demo.task import PROMPTS

        if r.prompts_per_step > len(PROMPTS):
            raise ValueError(f"rlhf.prompts_per_step must be <= {len(PROMPTS)} (the task's "
                             f"prompts; each is one GRPO group), got {r.prompts_per_step}")
        if len(r.letter) != 1:
            raise ValueError(f"rlhf.letter must be one character, got {r.letter!r}")
        for name in ("num_train", "num_eval"):
            if getattr(self.data, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self.data, name)}")
        if "type" not in self.strategy:
            raise ValueError(f"strategy needs a 'type' field, got {self.strategy!r}")
        if self.train.device not in ("cpu", "cuda"):
            raise ValueError(f"train.device must be cpu or cuda, got {self.train.device!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {
    "model": ModelSection, "data": DataSection, "train": TrainSection,
    "server": ServerSection, "check": CheckSection, "policy": PolicySection,
    "rlhf": RLHFSection,
}
_SCALARS = ("mode", "strategy")


def demo_config_from_mapping(data: Mapping[str, Any]) -> DemoConfig:
    """Build a ``DemoConfig``; unknown sections or fields raise naming them."""
    unknown = sorted(set(data) - set(_SECTIONS) - set(_SCALARS))
    if unknown:
        raise ValueError(
            f"demo config: unknown section(s) {unknown}; valid: "
            f"{', '.join(sorted([*_SECTIONS, *_SCALARS]))}"
        )
    kwargs: dict[str, Any] = {}
    if data.get("mode") is not None:
        kwargs["mode"] = str(data["mode"])
    for name, cls in _SECTIONS.items():
        if data.get(name) is not None:
            kwargs[name] = make_config(cls, dict(data[name]), what=f"demo config [{name}]")
    if data.get("strategy") is not None:
        kwargs["strategy"] = dict(data["strategy"])
    cfg = DemoConfig(**kwargs)
    cfg.validate()
    return cfg


def load_demo_config(path: str | None = None) -> DemoConfig:
    """Read ``path`` (default: the shipped ``demo`` preset)."""
    if path is None:
        return demo_config_from_mapping(read_preset(DEFAULT_PRESET))
    if not os.path.exists(path):
        raise FileNotFoundError(f"demo config {path!r} does not exist")
    return demo_config_from_mapping(to_plain(path))


def strategy_from_name(name: str) -> dict[str, Any]:
    """``--strategy`` value -> strategy config: a preset name, a YAML path, or a registered type."""
    if name in STRATEGY_PRESETS:
        return dict(STRATEGY_PRESETS[name])
    if name.endswith((".yaml", ".yml")) or os.path.exists(name):
        data = to_plain(name)
        return dict(data["strategy"]) if "strategy" in data and "type" not in data else data
    from weightsync.registry import STRATEGIES

    if name not in STRATEGIES:
        raise ValueError(
            f"--strategy {name!r}: not a preset ({', '.join(STRATEGY_PRESETS)}), a YAML file, "
            f"nor a registered strategy ({', '.join(STRATEGIES.names())})"
        )
    return {"type": name}
