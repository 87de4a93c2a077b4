"""The rollout types the trainer consumes: ``SAWItem`` / ``SAWBatch`` / ``BatchSource`` and how
``RolloutEngine`` turns a sampled step into a training sample (``saw_item``)."""

from __future__ import annotations

import pytest

from weightsync.reward.rollout import BatchSource, Rollout, SAWBatch, SAWItem, Step
from weightsync.reward.rollout_engine import RolloutBatchSource, RolloutRequest, saw_item


def test_saw_item_fields_and_checks():
    item = SAWItem([1, 2, 3, 4], [1, 1, 1, 1], [0, 0, 1, 1], 0.5, [-0.1, -0.2], {"k": 1})
    assert (item.weight, item.num_action_tokens, item.meta) == (0.5, 2, {"k": 1})
    assert SAWItem([1], [1], [1], 1.0).actor_logps is None
    with pytest.raises(ValueError, match="one entry per token"):
        SAWItem([1, 2], [1], [0, 1], 1.0)
    with pytest.raises(ValueError, match="1 actor_logps for 2 action tokens"):
        SAWItem([1, 2, 3], [1, 1, 1], [0, 1, 1], 1.0, [-0.5])
    assert len(SAWBatch([item])) == 1 and SAWBatch().meta == {}


def test_saw_item_of_a_sampled_step():
    step = Step(0, "Q", "A!", info={"prompt_token_ids": [5, 6], "completion_token_ids": [7, 8, 9],
                                    "completion_logprobs": [-1.0, -2.0, -3.0]})
    r = Rollout("r", [step], {"policy_version": 4})
    item = saw_item(r, step, 1.5)
    assert item.input_ids == [5, 6, 7, 8, 9] and item.action_mask == [0, 0, 1, 1, 1]
    assert item.attention_mask == [1] * 5 and item.actor_logps == [-1.0, -2.0, -3.0]
    assert item.meta == {"rollout_id": "r", "step_index": 0, "policy_version": 4}
    with pytest.raises(ValueError, match="no token ids"):
        saw_item(r, Step(1, "Q", "A"), 0.0)


def test_requests_and_batch_source_are_checked():
    with pytest.raises(ValueError, match="num_episodes"):
        RolloutRequest(prompt="p", num_episodes=0)
    with pytest.raises(ValueError, match="prompt"):
        RolloutRequest(prompt="")
    src = RolloutBatchSource.__new__(RolloutBatchSource)
    assert isinstance(src, BatchSource)  # next_batch(): the trainer's one call
