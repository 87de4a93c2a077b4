"""GSM8K's rule: the number after the last ``####`` (strict) or the last number (flexible)."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_gsm8k import TAIL_CHARS, final_number, gsm8k_score

# verl's strings: tests/interactions/test_gsm8k_interaction.py (ground truth "42" and the replies
# "#### 42", "42", "24", "### 4") and examples/data_preprocess/gsm8k.py (the answer after "####")
VERL_REPLIES = [("#### 42", 1.0), ("42", 0.0), ("24", 0.0), ("### 4", 0.0)]


@pytest.mark.parametrize(("reply", "want"), VERL_REPLIES)
def test_verl_examples(reply, want):
    assert gsm8k_score(reply, "42") == want


@pytest.mark.parametrize(("text", "truth", "method", "want"), [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "strict", 1.0),
    ("#### 1,200.", "1200", "strict", 1.0),  # comma and trailing period ignored
    ("#### $72.0", "72", "strict", 1.0),  # 72.0 is 72
    ("The answer is 72", "72", "strict", 0.0),  # strict needs ####
    ("The answer is 72", "72", "flexible", 1.0),
    ("first 5, then #### 6 and finally 7", "6", "strict", 1.0),  # the number after ####
    ("first 5, then #### 6 and finally 7", "7", "flexible", 1.0),  # the last number
    ("#### 71", "72", "strict", 0.0),
    ("#### -3", "-3", "strict", 1.0),
])
def test_final_number(text, truth, method, want):
    assert gsm8k_score(text, truth, method=method) == want


def test_ground_truth_may_be_a_full_solution_and_format_score_applies():
    solution = "Janet has 16 eggs, eats 3 and bakes with 4: 16 - 3 - 4 = 9.\n#### 9"
    assert gsm8k_score("... so #### 9", solution) == 1.0
    assert gsm8k_score("#### 8", "9", format_score=0.1) == 0.1  # found an answer, wrong
    assert gsm8k_score("no number here", "9", format_score=0.1) == 0.0  # no answer at all
    assert gsm8k_score("#### 9", "9", score=2.0) == 2.0
    assert final_number("no digits") is None
    with pytest.raises(ValueError, match="method"):
        final_number("#### 1", "greedy")


def test_only_the_end_of_a_long_response_is_read():
    assert gsm8k_score("#### 9" + "x" * TAIL_CHARS, "9") == 0.0
    assert gsm8k_score("x" * 5000 + "#### 9", "9") == 1.0
