"""Geometry3K's rule (verl's ``hiyouga/geometry3k``): ``0.9 * accuracy + 0.1 * format``. The
accuracy is 1.0 when the content of the last ``\\boxed{}`` equals the ground truth under
``math_equiv.equivalent``'s strict mode (the PRM800K grader's rules, which verl's ``mathruler``
checker follows); the format is 1.0 when the response is ``<think>...</think>`` followed by a
``\\boxed{...}`` (the prompt verl's geo3k data asks for). Pure Python; sympy on first use.
"""

from __future__ import annotations

import re
from typing import Any

from weightsync.reward_loop.math_equiv import equivalent
from weightsync.reward_loop.score_math import last_boxed

FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    """1.0 when the whole response is ``<think>...</think> ... \\boxed{...} ...``, else 0.0."""
    return 1.0 if FORMAT.fullmatch(solution_str) else 0.0


def acc_reward(solution_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    """1.0 when the answer (the last box, or the whole response) equals the ground truth."""
    answer = last_boxed(solution_str) if use_boxed else solution_str
    return 1.0 if equivalent(answer, ground_truth) else 0.0


def geo3k_score(solution_str: str, ground_truth: Any, use_boxed: bool = True,
                format_score: float = 0.1) -> float:
    """verl's geo3k score of one response.

    Args:
        solution_str: the response.
        ground_truth: the answer.
        use_boxed: read the answer from the last ``\\boxed{}`` (else the whole response).
        format_score: the weight of the format reward; the accuracy has ``1 - format_score``.

    Returns:
        ``(1 - format_score) * accuracy + format_score * format``.
    """
    acc = acc_reward(solution_str, str(ground_truth), use_boxed)
    return (1.0 - format_score) * acc + format_score * format_reward(solution_str)
