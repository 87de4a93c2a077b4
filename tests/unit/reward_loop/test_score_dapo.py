"""DAPO's math rule: the last ``Answer:`` line, Minerva-normalised; ``strict_box_verify``."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_dapo import (
    boxed_content,
    dapo_score,
    normalize_final_answer,
)

# verl's strings: the comments of verl/utils/reward_score/math_dapo.py's normalize_final_answer
# ("\fracab -> \frac{a}{b}", "\frac{abc}{bef} -> \frac{abc}{bef}", "\fracabc -> \frac{a}{b}c",
# "\sqrta -> \sqrt{a}", "\sqrtab -> sqrt{a}b")
VERL_SHORTHAND = [
    ("\\fracab", "\\frac{a}{b}"),
    ("\\frac{abc}{bef}", "\\frac{abc}{bef}"),
    ("\\fracabc", "\\frac{a}{b}c"),
    ("\\sqrta", "\\sqrt{a}"),
    ("\\sqrtab", "\\sqrt{a}b"),
]


@pytest.mark.parametrize(("answer", "want"), VERL_SHORTHAND)
def test_verl_shorthand_examples(answer, want):
    assert normalize_final_answer(answer) == want


@pytest.mark.parametrize(("answer", "want"), [
    ("1,000", "1000"),  # a plain number loses its commas
    ("(1,2)", "(1,2)"),  # a tuple keeps them
    ("$x = 5$", "5"),  # the side after the last "="
    ("10 degrees", "10"),
    ("\\text{(A)}", "(A)"),
    ("\\boxed{34}", "34"),
    ("12 \\text{ cm}^2", "12"),
])
def test_minerva_normalisation(answer, want):
    assert normalize_final_answer(answer) == want


def test_answer_line_scores_plus_or_minus_one_with_verl_dict():
    # the DAPO data's instruction: "The last line of your response should be of the form
    # Answer: $Answer" (verl's recipe/dapo)
    right = dapo_score("Let me compute 17 * 2.\nAnswer: 34", "34")
    assert right == {"score": 1.0, "acc": True, "pred": "34"}
    assert dapo_score("answer : 1,000 dollars", "1000")["acc"] is True  # case, units, commas
    wrong = dapo_score("Answer: 35", "34")
    assert wrong == {"score": -1.0, "acc": False, "pred": "35"}
    assert dapo_score("I think 34.", "34") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert dapo_score("Answer: 1\nmore\nAnswer: 34", "34")["acc"] is True  # the last line
    assert dapo_score("Answer: 34" + "x" * 300, "34")["acc"] is False  # outside the last 300


def test_strict_box_verify_compares_the_last_box_as_written():
    assert dapo_score("so \\boxed{34}", "34", strict_box_verify=True)["score"] == 1.0
    assert dapo_score("so \\boxed{ 34}", "34", strict_box_verify=True)["score"] == -1.0
    assert dapo_score("Answer: 34", "34", strict_box_verify=True) == {
        "score": -1.0, "acc": False, "pred": None}
    text = "\\boxed{34}" + "y" * 120
    assert dapo_score(text, "34", strict_box_verify=True)["acc"] is False  # outside the last 100
    assert dapo_score(text, "34", strict_box_verify=True,
                      pause_tokens_index=[0, 1, 2, 12])["acc"] is True
    with pytest.raises(ValueError, match="pause_tokens_index"):
        dapo_score(text, "34", strict_box_verify=True, pause_tokens_index=[3])
    assert boxed_content("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert boxed_content("\\boxed{1") is None
