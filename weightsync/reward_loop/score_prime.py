"""PRIME's math rule (verl's ``numina_aops_forum``, ``numina_synthetic_math``,
``numina_amc_aime``, ``numina_synthetic_amc``, ``numina_cn_k12``, ``numina_olympiads``): the
response's answer, read by ``extract_answer``, is graded against the ground truth by
``math_equiv.equivalent`` in its lenient mode (a relative tolerance of 1e-4 on numbers,
percentages read either way, sympy for expressions; verl's prime_math grader with its
``math_equal`` fallback). The score is 1.0 or 0.0, what verl's dispatcher makes of PRIME's
``(correct, format_ok, answer)``. Pure Python; sympy on first use.
"""

from __future__ import annotations

from typing import Any

from weightsync.reward_loop.math_equiv import equivalent
from weightsync.reward_loop.score_math import last_boxed

TOLERANCE = 1e-4
_AFTER = ("answer:", "answer is", "answers are")
_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_LINK = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def _cut_after(text: str, marker: str) -> str | None:
    at = text.lower().rfind(marker)
    return None if at < 0 else text[at + len(marker):].strip()


def extract_answer(response: str) -> str:
    """The answer of a free-form math response, PRIME's way.

    The text after the last "answer:" / "answer is" (or before "is the answer"), then the last
    ``\\boxed{}`` in it, then the part before the last ". ", then the part after the last
    link word ("is ", "=", ": ", "get ", ...). A response with none of these is its own answer.

    Args:
        response: the response.

    Returns:
        The answer text (possibly the whole response).
    """
    text = response
    for marker in _AFTER:
        cut = _cut_after(text, marker)
        text = text if cut is None else cut
    for marker in _BEFORE:
        at = text.lower().rfind(marker)
        text = text if at < 0 else text[:at].strip()
    boxed = last_boxed(text)
    if boxed:
        text = boxed.strip()
    if ". " in text:
        text = text[:text.rfind(". ")].strip()
    for marker in _LAST_LINK:
        cut = _cut_after(text, marker)
        text = text if cut is None else cut
    return text


def prime_score(solution_str: str, ground_truth: Any) -> float:
    """verl's numina (PRIME) score of one response.

    Args:
        solution_str: the response.
        ground_truth: the answer (LaTeX or plain).

    Returns:
        1.0 when the extracted answer equals the ground truth, else 0.0.
    """
    answer = extract_answer(str(solution_str))
    return 1.0 if equivalent(answer, str(ground_truth), TOLERANCE) else 0.0
