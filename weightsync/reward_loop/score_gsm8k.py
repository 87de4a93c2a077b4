"""GSM8K's rule (verl's ``openai/gsm8k``): the final number of the response against the ground
truth's. The answer is the number after the last ``####`` (``method="strict"``, verl's default
and GSM8K's own answer format) or the last number of the text (``"flexible"``), read from the
last 300 characters as verl does (the answer ends a response; a regex over a long text is slow).
Commas, ``$`` and a trailing period are ignored and ``72.0`` equals ``72`` (verl compares the
strings). Pure Python.
"""

from __future__ import annotations

import re
from typing import Any

#: how much of the end of a response is searched for the answer (verl's value)
TAIL_CHARS = 300
_NUMBER = r"-?[\d,]*\.?\d+"


def clean_number(text: str) -> str:
    """``text`` without commas, ``$``, surrounding spaces and a trailing period."""
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def same_number(a: str, b: str) -> bool:
    """True when the two spellings are one number (or the same string)."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def final_number(text: str, method: str = "strict") -> str | None:
    """The answer of a GSM8K-style text.

    Args:
        text: the response (only its last ``TAIL_CHARS`` characters are read).
        method: ``"strict"``: the number after the last ``####``; ``"flexible"``: the last number.

    Returns:
        The number, cleaned (``clean_number``), or None when there is none.

    Raises:
        ValueError: ``method`` is neither.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method: 'strict' or 'flexible', got {method!r}")
    tail = text[-TAIL_CHARS:]
    if method == "strict":
        found = re.findall(r"####\s*\$?\s*(" + _NUMBER + ")", tail)
    else:
        found = re.findall(_NUMBER, tail)
    found = [f for f in found if re.search(r"\d", f)]
    return clean_number(found[-1]) if found else None


def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's GSM8K score of one response.

    Args:
        solution_str: the response.
        ground_truth: the answer (``"72"``), or a full GSM8K solution ending in ``#### 72``.
        method: how the response's answer is found (``final_number``).
        format_score: the score of an answer that was found but is wrong.
        score: the score of a right answer.

    Returns:
        ``score``, ``format_score``, or 0.0 when the response has no answer.
    """
    answer = final_number(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = final_number(truth, "strict") or final_number(truth, "flexible") or truth.strip()
    return score if same_number(answer, clean_number(truth)) else format_score
