"""Search-R1's question-answering rule (verl's ``searchR1_nq``, ``searchR1_triviaqa``,
``searchR1_popqa``, ``searchR1_hotpotqa``, ``searchR1_2wikimultihopqa``, ``searchR1_musique``,
``searchR1_bamboogle``): exact match (EM). The answer is the last ``<answer>...</answer>`` of the
response; it scores ``score`` when, normalised as SQuAD's evaluation does (lower case, no
punctuation, no articles ``a``/``an``/``the``, single spaces), it equals one of the ground
truth's ``target`` answers, else ``format_score``; 0.0 without an answer. A right answer in a
response with more than 10 ``<answer>`` or ``</answer>`` tags scores a quarter (so a model does
not learn to spray tags). ``subem_score`` is the substring variant (a target contained in the
answer), verl's ``compute_score_subem``, for use as a custom reward. Pure Python.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

MAX_ANSWER_TAGS = 10
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles dropped, one space."""
    text = text.lower().translate(_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _targets(ground_truth: Any) -> list[str]:
    target = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if target is None:
        raise ValueError(f"ground_truth: a dict with 'target' (one answer or a list), got "
                         f"{ground_truth!r}")
    if isinstance(target, str) or not isinstance(target, Iterable):
        return [str(target)]
    return [str(t) for t in target]


def em_check(prediction: str, golden_answers: Any) -> bool:
    """True when ``prediction`` normalises to one of ``golden_answers`` (a string or a list)."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) == pred for g in _targets(golden_answers))


def subem_check(prediction: str, golden_answers: Any) -> bool:
    """True when one of ``golden_answers``, normalised, is inside the normalised prediction."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) in pred for g in _targets(golden_answers))


def extract_answer(solution_str: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` (stripped), or None."""
    found = re.findall(r"<answer>(.*?)</answer>", solution_str, re.DOTALL)
    return found[-1].strip() if found else None


def qa_em_score(solution_str: str, ground_truth: Any, format_score: float = 0.0,
                score: float = 1.0) -> float:
    """verl's search-R1 exact-match score of one response.

    Args:
        solution_str: the response.
        ground_truth: ``{"target": [answers]}`` (verl's search-R1 data), or the answers.
        format_score: the score of an answer that is wrong.
        score: the score of a right answer.

    Returns:
        ``score`` (a quarter of it with more than 10 answer tags), ``format_score``, or 0.0
        without an answer.

    Raises:
        ValueError: ``ground_truth`` is a dict without ``target``.
    """
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, ground_truth):
        return format_score
    tags = max(solution_str.count("<answer>"), solution_str.count("</answer>"))
    return score / 4 if tags > MAX_ANSWER_TAGS else score


def subem_score(solution_str: str, ground_truth: Any, format_score: float = 0.0,
                score: float = 1.0) -> float:
    """The substring variant of ``qa_em_score`` (no tag-count penalty, as verl's)."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return score if subem_check(answer, ground_truth) else format_score
