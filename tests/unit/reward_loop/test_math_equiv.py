"""The math-answer grader behind the numina and geo3k rules: strings, then sympy values."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.math_equiv import equivalent, latex_to_sympy

# verl's strings: tests/utils/reward_score/test_sandbox_on_cpu.py's prime_math_answers and
# prime_math_gts ("mat test", "frac test", "symbolic test"), all graded right there
VERL_PAIRS = [
    ("\\begin{bmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19 \n \\end{bmatrix}",
     "\\begin{pmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19\n \\end{pmatrix}"),
    ("\\frac{\\sqrt{505}}{7}", "\\frac{\\sqrt{505}}{7}"),
    ("x^2 + y^2 + 4x - 6y + 13", "(x + 2)^2 + (y - 3)^2 "),
]


@pytest.mark.parametrize(("given", "truth"), VERL_PAIRS)
@pytest.mark.parametrize("tolerance", [None, 1e-4])
def test_verl_pairs_are_equivalent(given, truth, tolerance):
    assert equivalent(given, truth, tolerance)


@pytest.mark.parametrize(("given", "truth"), [
    (VERL_PAIRS[0][0].replace("19", "18"), VERL_PAIRS[0][1]),  # one entry differs
    ("\\begin{pmatrix} 1 & 2 \\end{pmatrix}", VERL_PAIRS[0][1]),  # another shape
    ("\\frac{\\sqrt{504}}{7}", "\\frac{\\sqrt{505}}{7}"),
    ("x^2 + y^2 + 4x - 6y + 12", "(x + 2)^2 + (y - 3)^2 "),
])
def test_wrong_answers_are_not(given, truth):
    assert not equivalent(given, truth, 1e-4)


@pytest.mark.parametrize(("given", "truth", "strict", "lenient"), [
    ("2\\sqrt{3}", "\\sqrt{12}", True, True),  # sympy
    ("\\frac{\\pi}{4}", "0.25\\pi", True, True),
    ("\\sqrt[3]{8}", "2", False, True),  # integer truth: strict wants an integer spelling
    ("10/2", "5", False, True),
    ("2/4", "1/2", False, True),  # unreduced fractions count as written when strict
    ("(1, 2)", "(1,2)", True, True),
    ("[1, 2)", "(1, 2)", False, False),  # an interval's brackets matter
    ("(1, 3)", "(1, 2)", False, False),
    ("1,000", "1000", True, True),  # thousands commas
    ("7 3/4", "\\frac{31}{4}", True, True),  # a mixed number (verl's prime_math docstring)
    ("50", "0.5", False, True),  # lenient reads a percentage either way
    ("3.14159", "\\pi", False, True),  # within 1e-4
    ("3.2", "\\pi", False, False),
    ("5 \\text{ cm}", "5", True, True),
    ("\\text{Monday}", "monday", True, True),
    ("Monday", "Tuesday", False, False),
    (None, "1", False, False),
])
def test_strict_and_lenient_modes(given, truth, strict, lenient):
    assert equivalent(given, truth) is strict
    assert equivalent(given, truth, 1e-4) is lenient


@pytest.mark.parametrize(("latex", "value"), [
    ("\\frac{1}{2}", "1/2"), ("\\dfrac{3}{4}", "3/4"), ("2\\sqrt{3}", "2*sqrt(3)"),
    ("\\sqrt[3]{8}", "2"), ("3\\pi", "3*pi"), ("2 \\cdot 3", "6"), ("x^{2}", "x**2"),
])
def test_latex_to_sympy_reads_tex(latex, value):
    from sympy import sympify

    assert latex_to_sympy(latex) - sympify(value) == 0


@pytest.mark.parametrize("unsafe", [
    "2^{1000}", "2^{2^{3}}", "abc", "x+y+z", "\\unknown{1}", "__import__", "1" * 300, "",
])
def test_what_sympy_might_hang_on_or_cannot_read_is_not_evaluated(unsafe):
    assert latex_to_sympy(unsafe) is None


def test_large_powers_are_compared_at_points_not_expanded():
    # expanding either side has ~10^4 terms; the fixed points settle it at once
    assert equivalent("(x+y)^{99}(x-y)^{99}", "(x^2-y^2)^{99}")
    assert not equivalent("(x+y)^{99}(x-y)^{99}", "(x^2-y^2)^{98}")
    assert equivalent("\\frac{1}{x}", "x^{-1}")
    assert equivalent("\\sqrt{x^2}", "\\sqrt{x^2}")
