"""Geometry3K's rule: 0.9 * the boxed answer's accuracy + 0.1 * the think-then-box format."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_geo3k import format_reward, geo3k_score

# verl's format: examples/data_preprocess/geo3k.py asks for the reasoning "within <think> </think>
# tags" and "The final answer MUST BE put in \boxed{}", the pattern of
# verl/utils/reward_score/geo3k.py's format_reward


@pytest.mark.parametrize(("response", "truth", "want"), [
    ("<think>The angles sum to 180.</think> The answer is \\boxed{30}.", "30", 1.0),
    ("The answer is \\boxed{30}.", "30", 0.9),  # right, without the format
    ("<think>guess</think> \\boxed{31}", "30", 0.1),  # the format alone
    ("31", "30", 0.0),
    ("<think>x</think> \\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),  # graded by value
    ("<think>x</think> \\boxed{\\frac{6}{2}}", "3", 0.1),  # strict: an integer as written
])
def test_geo3k_score(response, truth, want):
    assert geo3k_score(response, truth) == pytest.approx(want)


def test_format_and_options():
    assert format_reward("<think>\nmulti\nline</think>\n\\boxed{1}\n") == 1.0
    assert format_reward("\\boxed{1} <think>late</think>") == 0.0
    assert geo3k_score("30", "30", use_boxed=False) == pytest.approx(0.9)
    assert geo3k_score("<think>x</think>\\boxed{30}", "30", format_score=0.5) == 1.0
    assert geo3k_score("<think>x</think>\\boxed{29}", "30", format_score=0.5) == 0.5
