"""DAPO's math rule (verl's ``math_dapo``, ``math``, ``math_dapo_reasoning`` and every data source
whose name starts with ``aime``): the answer of the line ``Answer: ...`` (the last one, case
ignored) in the last 300 characters of the response, normalised the way Minerva's checker does,
equals the normalised ground truth. ``strict_box_verify=True`` instead takes the last
``\\boxed{...}`` of the last 100 characters (or from 100 characters before the last pause token
on) and compares it with the ground truth as written. The result is verl's dict: ``score`` 1.0
or -1.0, ``acc`` (bool) and ``pred`` (the normalised answer). Minerva's normalisation keeps the
text after the last ``=``, drops spaces, ``$``, ``\\text{}`` / ``\\textbf{}`` / ``\\overline{}``
wrappers, degrees and the unit and filler words of competition answers, completes shorthand TeX
(``\\fracab`` -> ``\\frac{a}{b}``, ``\\sqrta`` -> ``\\sqrt{a}``) and drops the commas of a plain
number. Pure Python.
"""

from __future__ import annotations

import re
from typing import Any

#: characters of the response's end that are searched (verl's value: a final answer is short
#: and ends the response)
TAIL_CHARS = 300
STRICT_TAIL_CHARS = 100
ANSWER_LINE = r"(?i)Answer\s*:\s*([^\n]+)"

_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
             ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
             ("\\text{m}", "\\text{}"))
# the unit and filler words of competition answers (the list of Minerva's normaliser, Lewkowycz
# et al. 2022, appendix D), then TeX that carries no value
_WORDS = ("square ways integers dollars mph inches hours km units sue points feet minutes digits "
          "cents degrees cm gm pounds meters meals edges students childrentickets multiples")
_REMOVED = (*_WORDS.split()[:9], "\\ldots", *_WORDS.split()[9:], "\\text{s}", "\\text{.}",
            "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}",
            r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots")


def boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced; only the braced form)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def normalize_final_answer(answer: str) -> str:
    """Minerva's canonical spelling of a final answer (the module docstring lists the rules).

    Args:
        answer: the answer text (one line).

    Returns:
        Its normalised form; two answers are the same when these are equal.
    """
    s = answer.split("=")[-1]
    for old, new in _REPLACED:
        s = s.replace(old, new)
    for word in _REMOVED:
        s = s.replace(word, "")
    s = re.sub(r"^.*?\$(.*?)\$.*$", r"$\1$", s)  # the first $...$ span, if any
    for wrapper in ("text", "textbf", "overline"):
        s = re.sub(r"\\" + wrapper + r"\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)  # \fracab -> \frac{a}{b}
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)  # \sqrta -> \sqrt{a}
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def minerva_correct(solution_str: str, ground_truth: str) -> tuple[bool, str]:
    """(right?, normalised answer) of the last ``Answer:`` line; ``[INVALID]`` without one."""
    found = re.findall(ANSWER_LINE, solution_str)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    return pred == normalize_final_answer(ground_truth), pred


def strict_box_correct(solution_str: str, ground_truth: str,
                       pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    """(right?, boxed answer) under ``strict_box_verify``: the last box of the end of the text.

    Raises:
        ValueError: ``pause_tokens_index`` is given without 4 entries.
    """
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index: 4 indices, got {len(pause_tokens_index)}")
        tail = solution_str[max(0, pause_tokens_index[-1] - STRICT_TAIL_CHARS):]
    else:
        tail = solution_str[-STRICT_TAIL_CHARS:]
    pred = boxed_content(tail)
    return pred == ground_truth, pred


def dapo_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
               pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """verl's ``math_dapo`` score of one response.

    Args:
        solution_str: the response (its last 300 characters are read).
        ground_truth: the answer.
        strict_box_verify: take the last ``\\boxed{}`` and compare it as written.
        pause_tokens_index: with ``strict_box_verify``, the 4 pause tokens' positions.

    Returns:
        ``{"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}``.
    """
    tail = solution_str[-TAIL_CHARS:]
    truth = str(ground_truth)
    if strict_box_verify:
        correct, pred = strict_box_correct(tail, truth, pause_tokens_index)
    else:
        correct, pred = minerva_correct(tail, truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
