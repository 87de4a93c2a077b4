"""Countdown's rule: an equation over the given numbers that reaches the target."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_countdown import countdown_score, evaluate, extract_equation

# verl's format: verl's countdown scorer (verl/utils/reward_score/countdown.py of verl's pull
# request #1405, "feat: add countdown reward score") reads the assistant's turn after "Assistant:" or
# "<|im_start|>assistant", the last line's <answer>, and a ground truth {"target", "numbers"}
TRUTH = {"target": 98, "numbers": [44, 19, 35]}
PROMPT = "User: Using the numbers [44, 19, 35], create an equation that equals 98.\n"


@pytest.mark.parametrize(("reply", "want"), [
    (PROMPT + "Assistant: Let me solve this step by step.\n<think> 44 + 19 = 63 </think>\n"
              "<answer> 44 + 19 + 35 </answer>", 1.0),
    ("<|im_start|>assistant\n<answer>(44 + 19) + 35</answer>", 1.0),
    ("Assistant: <answer>44 + 19 - 35</answer>", 0.1),  # the numbers, a wrong value
    ("Assistant: <answer>44 + 54</answer>", 0.1),  # other numbers
    ("Assistant: <answer>44 + 19 + 35 + 0</answer>", 0.1),  # a number too many
    ("Assistant: <answer>44 ** 19 + 35</answer>", 0.1),  # no powers
    ("Assistant: <answer>44 + 19 + 35</answer>\nthen more", 0.0),  # not on the last line
    ("<answer>44 + 19 + 35</answer>", 0.0),  # no assistant turn
])
def test_countdown_score(reply, want):
    assert countdown_score(reply, TRUTH) == want


def test_evaluation_runs_arithmetic_only():
    assert evaluate("(1 + 2) / 3 * -4") == -4.0
    assert evaluate("1 / 0") is None
    assert evaluate("__import__('os')") is None
    assert evaluate("2 ** 3") is None
    assert evaluate("(" * 50 + "1" + ")" * 50) == 1.0
    assert evaluate("(" * 500 + "1" + ")" * 500) is None  # beyond the parser's nesting limit
    assert extract_equation("Assistant: <answer>1</answer><answer>2</answer>") == "2"
    assert countdown_score("Assistant: <answer>10 / 4</answer>",
                           {"target": 2.5, "numbers": [4, 10]}) == 1.0
    with pytest.raises(ValueError, match="ground_truth"):
        countdown_score("Assistant: <answer>1</answer>", {"target": 1})
