"""MATH's rule: the last ``\\boxed{}`` against the ground truth, both normalised."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_math import last_boxed, math_score, normalize_math

# verl's strings: the comments of verl/utils/reward_score/math_reward.py's strip_string, which
# name what the normalisation makes equal (\frac12, \frac1b, \frac1{72}, 0.5, a/b, sqrt3, "k = ",
# " .5", a unit after "\text{ ")
VERL_NORMALISED = [
    ("\\frac12", "\\frac{1}{2}"),
    ("\\frac1b", "\\frac{1}{b}"),
    ("\\frac1{72}", "\\frac{1}{72}"),
    ("0.5", "\\frac{1}{2}"),
    ("3/4", "\\frac{3}{4}"),
    ("\\sqrt3", "\\sqrt{3}"),
    ("k = 5", "5"),
    (".5", "\\frac{1}{2}"),
    ("10 \\text{ inches}", "10"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\tfrac{2}{3}", "\\frac{2}{3}"),
    ("30^\\circ", "30"),
]


@pytest.mark.parametrize(("answer", "want"), VERL_NORMALISED)
def test_verl_normalisation_examples(answer, want):
    assert normalize_math(answer) == want
    assert math_score(f"so $\\boxed{{{answer}}}$.", want) == 1.0


@pytest.mark.parametrize(("text", "truth", "want"), [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{ 0.5 }", ".5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)", 1.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{\\text{Monday}}", "\\text{Tuesday}", 0.0),  # a text answer is not a unit
    ("\\boxed{\\text{Monday}}", "Monday", 1.0),
    ("no box: 7", "7", 0.0),
    ("\\boxed{7", "7", 0.0),  # never closes
    ("\\fbox{4}", "4", 1.0),
    ("\\boxed 4", "4", 1.0),
    ("\\boxed{3}", "The answer is $\\boxed{3}$.", 1.0),  # a full solution as ground truth
    ("\\boxed{72.0}", "72", 1.0),
])
def test_math_boxed(text, truth, want):
    assert math_score(text, truth) == want


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{a}{b}} x") == "\\frac{a}{b}"
    assert last_boxed("nothing") is None
