"""``RewardModelPublisher``'s choices that restore the reward spec's behaviour, checked on what it
would send (``metadata``: selection and checks only, no transport)."""

from __future__ import annotations

import pytest

from weightsync.errors import WeightMismatchError
from weightsync.reward.publisher import RewardModelPublisher
from weightsync.reward.selection import TrainingModeWarning

torch = pytest.importorskip("torch")

SD = {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4),
      "score.weight": torch.ones(1, 4),
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(4, 2)}


def test_unmerged_lora_refused_by_default_skipped_with_a_warning_on_request():
    with pytest.raises(WeightMismatchError, match="lora_B.default.weight: an unmerged LoRA"):
        RewardModelPublisher(None, rank=0).metadata(SD, "full")
    pub = RewardModelPublisher(None, rank=0, unmerged_lora="skip")
    with pytest.warns(TrainingModeWarning, match=r"skipped 1 unmerged LoRA tensor"):
        metas = pub.metadata(SD, "full")
    assert [m.name for m in metas] == ["model.embed_tokens.weight", "model.norm.weight",
                                       "score.weight"]
    with pytest.raises(ValueError, match="unmerged_lora must be one of"):
        RewardModelPublisher(None, unmerged_lora="warn")
