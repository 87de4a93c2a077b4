"""Reward models on vLLM: rollout types, scoring, credit assignment and presets, the server,
the client and the publisher.

Importing this package is light (no vLLM, no httpx): the types are plain data and the client /
server are imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.reward.rollout import (
    BatchSource,
    CreditAssigner,
    Rollout,
    RolloutStepKey,
    SAWBatch,
    SAWItem,
    Step,
)
from weightsync.reward.types import (
    DEFAULT_HEAD_NAME_PATTERNS,
    PoolingType,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    is_head_param,
    non_head_params,
    training_mode_offenders,
)

_LAZY = {
    "RewardModelClient": "weightsync.reward.client",
    "VLLMRewardClient": "weightsync.reward.client",
    "TokenizerMismatchError": "weightsync.reward.client",
    "RewardScoringClient": "weightsync.reward.scorer",
    "VersionDriftWarning": "weightsync.reward.staleness",
    "TrainingModeWarning": "weightsync.reward.selection",
    "select_params": "weightsync.reward.selection",
    "RewardServerConfig": "weightsync.servers.reward",
    "RewardWeightSyncExtension": "weightsync.loaders.vllm_worker",
    "RewardModelPublisher": "weightsync.reward.publisher",
    "create_reward_publisher": "weightsync.reward.publisher",
    "RewardModelScorer": "weightsync.reward.scorer",
    "ScoringError": "weightsync.reward.scorer",
    "rollout_text": "weightsync.reward.scorer",
    "AGGREGATIONS": "weightsync.reward.aggregate",
    "RewardModelCreditAssigner": "weightsync.reward.credit",
    "make_rm_grpo_assigner": "weightsync.reward.credit",
    "make_rm_scalerl_assigner": "weightsync.reward.credit",
    "EpisodicReturn": "weightsync.reward.advantages",
    "PerStepReward": "weightsync.reward.advantages",
    "GRPOAssigner": "weightsync.reward.advantages",
    "ScaleRLAssigner": "weightsync.reward.advantages",
    "PolicyLoss": "weightsync.reward.losses",
    "RLAlgorithm": "weightsync.reward.presets",
    "ScorerSettings": "weightsync.reward.presets",
    "make_reward_rl": "weightsync.reward.presets",
    "make_grpo_with_rm": "weightsync.reward.presets",
    "make_scalerl_with_rm": "weightsync.reward.presets",
    "RolloutEngine": "weightsync.reward.rollout_engine",
    "RolloutRequest": "weightsync.reward.rollout_engine",
    "RolloutBatchSource": "weightsync.reward.rollout_engine",
    "step_text": "weightsync.reward.scorer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.reward' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AGGREGATIONS", "DEFAULT_HEAD_NAME_PATTERNS", "BatchSource", "CreditAssigner",
    "EpisodicReturn", "RolloutBatchSource", "RolloutEngine", "RolloutRequest", "SAWBatch",
    "SAWItem", "step_text",
    "GRPOAssigner", "PerStepReward", "PolicyLoss", "PoolingType",
    "RLAlgorithm", "RewardModelClient", "RewardScoringClient", "VersionDriftWarning", "RewardModelCreditAssigner", "RewardModelPublisher",
    "RewardModelScorer", "RewardModelTrainingMode", "RewardServerConfig",
    "RewardWeightSyncExtension", "Rollout",
    "RolloutStepKey", "ScaleRLAssigner", "ScorerSettings", "ScoringError", "ScoringRequest",
    "ScoringResponse", "ScoringResult", "Step", "TokenizerMismatchError", "TrainingModeWarning",
    "VLLMRewardClient", "create_reward_publisher", "is_head_param",
    "make_grpo_with_rm", "make_reward_rl", "make_rm_grpo_assigner", "make_rm_scalerl_assigner",
    "make_scalerl_with_rm", "non_head_params", "rollout_text", "select_params",
    "training_mode_offenders",
]
