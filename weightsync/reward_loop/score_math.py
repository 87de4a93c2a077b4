"""MATH's rule (verl's ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
``HuggingFaceH4/MATH-500``): the content of the response's last ``\\boxed{...}`` against the
ground truth, both normalised the way the MATH benchmark's checker does (Hendrycks et al.) and
compared as strings, then as numbers. The normalisation (``normalize_math``) drops spaces,
``\\left``/``\\right``, ``\\!``, degrees, ``\\%``, ``$``, a trailing unit (``5 \\text{ cm}``) and
a short left-hand side (``k = 5``); spells ``\\dfrac``/``\\tfrac`` as ``\\frac``, ``\\frac12`` as
``\\frac{1}{2}``, ``\\sqrt3`` as ``\\sqrt{3}``, ``.5`` as ``0.5``, ``0.5`` and ``1/2`` as
``\\frac{1}{2}``, ``72.0`` as ``72``. A ground truth given as a full solution is reduced to its
last box first. Pure Python; the other math rules build on ``last_boxed`` and ``normalize_math``.
"""

from __future__ import annotations

import re
from typing import Any


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text``.

    Args:
        text: a response or a solution.

    Returns:
        The content (braces balanced), or the word after ``\\boxed`` written without braces
        (``\\boxed 5``); None when there is no box or it never closes.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    open_at = rest.find("{")
    head = rest.split("{", 1)[0]
    if open_at < 0 or head.strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\boxed\s+([^\s$]+)", rest)
        return m.group(1) if m else None
    depth = 0
    for i in range(open_at, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[open_at + 1:i]
    return None


_DROPPED = ("\n", "\\left", "\\right", "\\!", "\\,", "\\;", "^{\\circ}", "^\\circ", "\\%", "%",
            "\\$", "$")


def normalize_math(answer: str) -> str:
    """A canonical spelling of a MATH answer (the module docstring lists the rules).

    Args:
        answer: one answer, without its ``\\boxed{}``.

    Returns:
        The answer's canonical spelling; two answers are the same when these are equal.
    """
    s = answer.strip().replace("\\\\", "\\")
    s = re.sub(r"^(.+?)\s*\\text\{\s*[a-zA-Z ]+\}\s*$", r"\1", s)  # a trailing unit
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^}]*)\}", r"\1", s)
    for old in _DROPPED:
        s = s.replace(old, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:  # "k = 5", "x=3"
        s = sides[1]
    s = re.sub(r"\\sqrt([^{\[\s\\])", r"\\sqrt{\1}", s)  # \sqrt3 -> \sqrt{3}
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"(?<![\d])\.(\d)", r"0.\1", s)  # .5 -> 0.5
    s = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", s)  # \frac1{72} -> \frac{1}{72}
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def same_math_answer(answer: str, truth: str) -> bool:
    """True when the two answers normalise to one spelling or one number."""
    a, b = normalize_math(answer), normalize_math(truth)
    return a == b or _same_number(a, b)


def math_score(solution_str: str, ground_truth: Any) -> float:
    """verl's MATH score of one response.

    Args:
        solution_str: the response; its last ``\\boxed{}`` is the answer.
        ground_truth: the answer, or a full solution whose last box holds it.

    Returns:
        1.0 when the answer matches, else 0.0 (also without a box).
    """
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if same_math_answer(answer, truth) else 0.0
