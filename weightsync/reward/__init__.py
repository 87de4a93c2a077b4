"""Reward models on vLLM: types, the server, the client (DESIGN.md section 6).

Importing this package is light (no vLLM, no httpx): the types are plain data and the client /
server are imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.reward.types import (
    DEFAULT_HEAD_NAME_PATTERNS,
    PoolingType,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    is_head_param,
    non_head_params,
    training_mode_offenders,
)

_LAZY = {
    "RewardModelClient": "weightsync.reward.client",
    "VLLMRewardClient": "weightsync.reward.client",
    "HttpEngineClient": "weightsync.reward.http_engine_client",
    "RewardServerConfig": "weightsync.reward.server",
    "RewardModelPublisher": "weightsync.reward.publisher",
    "create_reward_publisher": "weightsync.reward.publisher",
    "RewardModelScorer": "weightsync.reward.scorer",
    "RewardModelCreditAssigner": "weightsync.reward.credit",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.reward' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_HEAD_NAME_PATTERNS", "HttpEngineClient", "PoolingType", "RewardModelClient",
    "RewardModelCreditAssigner", "RewardModelPublisher", "RewardModelScorer",
    "RewardModelTrainingMode", "RewardServerConfig", "ScoringRequest", "ScoringResponse",
    "VLLMRewardClient", "create_reward_publisher", "is_head_param", "non_head_params",
    "training_mode_offenders",
]
