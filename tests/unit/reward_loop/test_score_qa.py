"""Search-R1's rule: exact match of the last ``<answer>`` against the targets."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_qa import (
    extract_answer,
    normalize_answer,
    qa_em_score,
    subem_score,
)

# verl's strings: examples/data_preprocess/preprocess_search_r1_dataset.py's instruction
# ("provide the answer inside <answer> and </answer> ... For example, <answer> Beijing
# </answer>") and verl/utils/reward_score/search_r1_like_qa_em.py's ground_truth["target"]
VERL_REPLY = "<think>The capital of China.</think> <answer> Beijing </answer>"


@pytest.mark.parametrize(("reply", "truth", "want"), [
    (VERL_REPLY, {"target": ["Beijing"]}, 1.0),
    (VERL_REPLY, {"target": ["Shanghai", "beijing"]}, 1.0),  # any target
    (VERL_REPLY, {"target": "Beijing"}, 1.0),  # one target as a string
    ("<answer>The Beijing!</answer>", {"target": ["beijing"]}, 1.0),  # article, case, punct.
    ("<answer>Shanghai</answer>", {"target": ["Beijing"]}, 0.0),
    ("Beijing", {"target": ["Beijing"]}, 0.0),  # no answer tags
    ("<answer>x</answer> then <answer>Beijing</answer>", {"target": ["Beijing"]}, 1.0),  # last
    ("<answer>Beijing</answer>" * 11, {"target": ["Beijing"]}, 0.25),  # tag spraying
])
def test_qa_em_score(reply, truth, want):
    assert qa_em_score(reply, truth) == want


def test_format_score_subem_and_bad_ground_truth():
    assert qa_em_score("<answer>Shanghai</answer>", {"target": ["Beijing"]},
                       format_score=0.2) == 0.2
    assert subem_score("<answer>it is Beijing, China</answer>", {"target": ["Beijing"]}) == 1.0
    assert qa_em_score("<answer>it is Beijing, China</answer>", {"target": ["Beijing"]}) == 0.0
    assert normalize_answer("  The  Eiffel-Tower. ") == "eiffeltower"
    assert extract_answer("<answer>\n a \n</answer>") == "a"
    with pytest.raises(ValueError, match="target"):
        qa_em_score(VERL_REPLY, {"answers": ["Beijing"]})
