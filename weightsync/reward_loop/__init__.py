"""verl's reward loop on weightsync: reward managers and their registry, rule-based and custom
reward functions, discriminative and generative reward models behind a router, and the Ray
workers and manager that score batches (``docs/reward_loop.md``).

Importing this package is light (no torch, Ray, vLLM or httpx): names resolve on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RewardBatch": "weightsync.reward_loop.data",
    "RewardItem": "weightsync.reward_loop.data",
    "RewardLoopConfig": "weightsync.reward_loop.config",
    "reward_loop_config": "weightsync.reward_loop.config",
    "RewardManagerBase": "weightsync.reward_loop.base",
    "register": "weightsync.reward_loop.base",
    "get_reward_manager_cls": "weightsync.reward_loop.base",
    "NaiveRewardManager": "weightsync.reward_loop.managers",
    "DAPORewardManager": "weightsync.reward_loop.managers",
    "RateLimitRewardManager": "weightsync.reward_loop.managers",
    "RateLimitedRewardManager": "weightsync.reward_loop.managers",
    "AsyncTokenBucket": "weightsync.reward_loop.managers",
    "default_compute_score": "weightsync.reward_loop.rules",
    "register_rule": "weightsync.reward_loop.rules",
    "find_rule": "weightsync.reward_loop.rules",
    "RuleUnavailableError": "weightsync.reward_loop.rules",
    "UnknownDataSourceError": "weightsync.reward_loop.rules",
    "get_custom_reward_fn": "weightsync.reward_loop.functions",
    "RewardFunctionError": "weightsync.reward_loop.functions",
    "chat_complete": "weightsync.reward_loop.client",
    "classify": "weightsync.reward_loop.client",
    "parse_verdict": "weightsync.reward_loop.client",
    "RouterRequestError": "weightsync.reward_loop.client",
    "RewardRouter": "weightsync.reward_loop.router",
    "RouterConfig": "weightsync.reward_loop.router",
    "RewardModelManager": "weightsync.reward_loop.model_manager",
    "RewardLoopWorker": "weightsync.reward_loop.worker",
    "RewardLoopError": "weightsync.reward_loop.worker",
    "RewardLoopManager": "weightsync.reward_loop.manager",
    "VersionMixError": "weightsync.reward_loop.manager",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.reward_loop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(_LAZY)


__all__ = [
    "AsyncTokenBucket", "DAPORewardManager", "NaiveRewardManager", "RateLimitRewardManager",
    "RateLimitedRewardManager", "RewardBatch", "RewardFunctionError", "RewardItem",
    "RewardLoopConfig", "RewardLoopError", "RewardLoopManager", "RewardLoopWorker",
    "RewardManagerBase", "RewardModelManager", "RewardRouter", "RouterConfig",
    "RouterRequestError", "RuleUnavailableError", "UnknownDataSourceError", "VersionMixError",
    "chat_complete", "classify", "default_compute_score", "find_rule", "get_custom_reward_fn",
    "get_reward_manager_cls", "parse_verdict", "register", "register_rule", "reward_loop_config",
]
