"""The numina (PRIME) rule: the answer read from free text, graded leniently."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.score_prime import extract_answer, prime_score

# verl's strings: tests/utils/reward_score/test_sandbox_on_cpu.py (prime_math_answers and
# prime_math_gts, each scored 1.0 by default_compute_score("numina_aops_forum", ...))
VERL_ANSWERS = [
    "\\begin{bmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19 \n \\end{bmatrix}",
    "\\frac{\\sqrt{505}}{7}",
    "x^2 + y^2 + 4x - 6y + 13",
]
VERL_TRUTHS = [
    "\\begin{pmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19\n \\end{pmatrix}",
    "\\frac{\\sqrt{505}}{7}",
    "(x + 2)^2 + (y - 3)^2 ",
]


@pytest.mark.parametrize(("answer", "truth"), zip(VERL_ANSWERS, VERL_TRUTHS, strict=True))
def test_verl_examples_score_one(answer, truth):
    assert prime_score(answer, truth) == 1.0


@pytest.mark.parametrize(("answer", "truth"), zip(VERL_ANSWERS, VERL_TRUTHS[1:] + VERL_TRUTHS[:1],
                                                  strict=True))
def test_verl_answers_against_another_truth_score_zero(answer, truth):
    assert prime_score(answer, truth) == 0.0


@pytest.mark.parametrize(("response", "answer"), [
    ("Step 1: ... Step 2: so the answer is \\boxed{12}.", "12"),
    ("The final answer: 7", "7"),
    ("42 is the answer", "42"),
    ("We get x = 3", "3"),
    ("It is 5. Check: fine", "5"),  # the part before the last ". "
    ("\\frac{1}{2}", "\\frac{1}{2}"),  # no marker: the whole response
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(("response", "truth", "want"), [
    ("So the answer is \\boxed{12}.", "12", 1.0),
    ("The answer is 13", "12", 0.0),
    ("Thus x = 0.5", "\\frac12", 1.0),
    ("The answer is 3.14159", "\\pi", 1.0),  # within PRIME's tolerance
    ("no idea", "12", 0.0),
])
def test_prime_score(response, truth, want):
    assert prime_score(response, truth) == want
