"""Rule-based rewards: the default reward function, one rule per data source.

``default_compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` is
what the reward loop calls when no ``custom_reward_function`` is configured (verl's name and
signature): it looks the sample's ``data_source`` up in ``RULES`` and returns the rule's score.
An unknown data source is a ``ValueError`` that lists the known ones; ``@register_rule(name,
...)`` adds a rule. Pure Python, no heavy import; called in a reward-loop worker's executor.

Built-in rules:

- GSM8K (``openai/gsm8k``, ``gsm8k``): ``gsm8k_score``. The answer is the number after the
  last ``####`` (``method="strict"``, verl's default and GSM8K's answer format) or the last
  number of the text (``"flexible"``); 1.0 when it equals the ground truth's final number
  (commas, ``$`` and a trailing period ignored; ``72.0`` equals ``72``), else ``format_score``
  (0.0) when an answer was found, 0.0 without one.
- MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``,
  ``math``): ``math_score``. The answer is the content of the last ``\\boxed{...}`` (or
  ``\\fbox{...}``, braces balanced); a ground truth given as a full solution is reduced the same
  way. Both are normalised (spaces, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``,
  ``\\text{...}`` units, ``^\\circ``, ``\\%``, ``$``, a trailing period, ``0.5`` vs ``.5``) and
  compared as strings, then as numbers; 1.0 on a match.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

#: data source -> rule ``(solution_str, ground_truth, **kwargs) -> float``
RULES: dict[str, Callable[..., float]] = {}

_NUMBER = r"-?[\d,]*\.?\d+"


def register_rule(*data_sources: str) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Register ``fn(solution_str, ground_truth, **kwargs) -> float`` as the rule of each of
    ``data_sources``; a source registered twice with another function is an error."""

    def deco(fn: Callable[..., float]) -> Callable[..., float]:
        for name in data_sources:
            if name in RULES and RULES[name] is not fn:
                raise ValueError(f"rule for data source {name!r} is already registered "
                                 f"({RULES[name].__qualname__})")
            RULES[name] = fn
        return fn

    return deco


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None, **kwargs: Any) -> float:
    """The rule of ``data_source`` applied to ``solution_str``; keyword arguments a rule does
    not take (``strict_box_verify`` from the DAPO manager, the router address) are dropped."""
    rule = RULES.get(str(data_source))
    if rule is None:
        raise ValueError(f"data_source {data_source!r}: no rule-based reward for it; known data "
                         f"sources: {', '.join(sorted(RULES))} (register one with "
                         f"weightsync.reward_loop.register_rule, or configure "
                         f"custom_reward_function)")
    import inspect

    params = inspect.signature(rule).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return float(rule(solution_str, ground_truth, **kwargs))


# --------------------------------------------------------------------------------------------
# GSM8K: the final number
# --------------------------------------------------------------------------------------------


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def final_number(text: str, method: str = "strict") -> str | None:
    """The answer of a GSM8K-style text: after the last ``####`` (strict) or the last number
    (flexible); None when there is none."""
    if method == "strict":
        found = re.findall(r"####\s*\$?\s*(" + _NUMBER + ")", text)
    elif method == "flexible":
        found = re.findall(_NUMBER, text)
    else:
        raise ValueError(f"method: 'strict' or 'flexible', got {method!r}")
    found = [f for f in found if re.search(r"\d", f)]
    return _clean_number(found[-1]) if found else None


@register_rule("openai/gsm8k", "gsm8k")
def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    answer = final_number(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = final_number(truth, "strict") or final_number(truth, "flexible") or truth.strip()
    return score if _same_number(answer, _clean_number(truth)) else format_score


# --------------------------------------------------------------------------------------------
# MATH: the last \boxed{...}
# --------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of a
    ``\\boxed 5`` without braces; None when there is none or it never closes."""
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


def normalize_math(answer: str) -> str:
    """A canonical spelling of a MATH answer (see the module docstring)."""
    s = answer.strip()
    s = re.sub(r"\\text\{\s*[a-zA-Z ]+\}\s*$", "", s)  # a trailing unit
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""),
                     ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("$", "")):
        s = s.replace(old, new)
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"(?<![\d])\.(\d)", r"0.\1", s)  # .5 -> 0.5
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


@register_rule("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
               "math")
def math_score(solution_str: str, ground_truth: Any) -> float:
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    a, b = normalize_math(answer), normalize_math(truth)
    return 1.0 if a == b or _same_number(a, b) else 0.0
