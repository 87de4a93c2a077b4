"""``RewardBatch``: verl's ``DataProto`` shape built from texts, indexed, sliced, chunked."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.data import RewardBatch, response_part


@pytest.fixture(scope="module")
def tokenizer():
    from weightsync.testing.tiny_models import build_tokenizer

    return build_tokenizer()


def test_from_texts_builds_verls_tensors(tokenizer):
    prompts = ["What is 2 + 3?", [{"role": "user", "content": "Name a colour."}]]
    responses = ["#### 5", "blue"]
    b = RewardBatch.from_texts(tokenizer, prompts, responses, data_sources="openai/gsm8k",
                               ground_truths=["5", "blue"], extra_infos=[{"i": 0}, {"i": 1}])
    assert len(b) == 2
    n, r = b.batch["responses"].shape
    p = b.batch["prompts"].shape[1]
    assert b.batch["attention_mask"].shape == (2, p + r)
    for i, text in enumerate(responses):
        ids, length = response_part(b[i])
        assert length == len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # prompts are left-padded: the last prompt token sits right before the response
    assert int(b.batch["attention_mask"][0, p - 1]) == 1
    item = b[1]
    assert item.non_tensor_batch["raw_prompt"] == prompts[1]
    assert b[0].non_tensor_batch["raw_prompt"] == [{"role": "user", "content": prompts[0]}]
    assert item.non_tensor_batch["reward_model"]["ground_truth"] == "blue"
    assert item.non_tensor_batch["extra_info"] == {"i": 1}
    assert item.non_tensor_batch["data_source"] == "openai/gsm8k"


def test_slicing_and_chunking_keep_samples_whole(tokenizer):
    b = RewardBatch.from_texts(tokenizer, [f"q{i}" for i in range(5)], [f"a{i}" for i in range(5)],
                               data_sources=[f"s{i}" for i in range(5)])
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    assert [p[j].non_tensor_batch["data_source"] for p in parts for j in range(len(p))] == \
        [f"s{i}" for i in range(5)]
    assert len(b[1:2]) == 1 and b[1:2][0].non_tensor_batch["data_source"] == "s1"
    assert [len(p) for p in b.chunk(7)] == [1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(IndexError):
        b[5]


def test_fields_of_different_lengths_are_refused(tokenizer):
    import torch

    with pytest.raises(ValueError, match="one entry per sample"):
        RewardBatch({"responses": torch.zeros(2, 3)}, {"data_source": ["a"]})
    with pytest.raises(ValueError, match="responses: 1 for 2 prompts"):
        RewardBatch.from_texts(tokenizer, ["a", "b"], ["x"], data_sources="s")
