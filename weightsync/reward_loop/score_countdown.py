"""Countdown's rule (TinyZero's task; the scorer of verl's pull request #1405, for data sources
whose name contains ``countdown``, which verl's dispatcher has not merged): the response must
give an equation, as the last ``<answer>...</answer>`` on the last line of the assistant's turn
(after ``Assistant:`` or ``<|im_start|>assistant``), that uses each of the ground truth's
``numbers`` exactly once and evaluates to its ``target`` (within 1e-5). Right: ``score`` (1.0);
an equation that is wrong, uses other numbers or does not evaluate: ``format_score`` (0.1); no
equation: 0.0. The equation is evaluated by our own arithmetic reader over Python's ``ast``
(numbers, ``+ - * /``, parentheses; nothing else is ever run). Pure Python.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

_TURN_MARKERS = ("Assistant:", "<|im_start|>assistant")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def extract_equation(solution_str: str) -> str | None:
    """The equation of the last ``<answer>`` on the last line of the assistant's turn, or None
    (no turn marker, or no answer on that line)."""
    for marker in _TURN_MARKERS:
        if marker in solution_str:
            turn = solution_str.split(marker, 1)[1]
            break
    else:
        return None
    found = re.findall(r"<answer>(.*?)</answer>", turn.split("\n")[-1])
    return found[-1].strip() if found else None


def uses_numbers(equation: str, numbers: list[int]) -> bool:
    """True when the integers written in ``equation`` are ``numbers``, each used once."""
    return sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(int(n) for n in numbers)


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def evaluate(equation: str) -> float | None:
    """The value of an arithmetic ``equation``, or None when it is not one (other characters,
    other operators, a syntax error, a division by zero)."""
    if not re.fullmatch(r"[\d+\-*/().\s]+", equation):
        return None
    try:
        return float(_value(ast.parse(equation, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def countdown_score(solution_str: str, ground_truth: Any, format_score: float = 0.1,
                    score: float = 1.0) -> float:
    """The countdown score of one response.

    Args:
        solution_str: the response, with the assistant's turn marker.
        ground_truth: ``{"target": int, "numbers": [int, ...]}``.
        format_score: the score of an equation that is not right.
        score: the score of a right equation.

    Returns:
        ``score``, ``format_score``, or 0.0 without an equation.

    Raises:
        ValueError: ``ground_truth`` lacks ``target`` or ``numbers``.
    """
    if not isinstance(ground_truth, dict) or not {"target", "numbers"} <= set(ground_truth):
        raise ValueError(f"ground_truth: a dict with 'target' and 'numbers', got "
                         f"{ground_truth!r}")
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    if not uses_numbers(equation, list(ground_truth["numbers"])):
        return format_score
    value = evaluate(equation)
    if value is None or abs(value - float(ground_truth["target"])) >= 1e-5:
        return format_score
    return score
