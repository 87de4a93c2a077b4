"""Rule-based rewards: the default reward function, one rule per data source, as verl's
``default_compute_score`` dispatches them.

``default_compute_score(data_source, solution_str, ground_truth, extra_info=None, ...)`` is what
the reward loop calls when no ``custom_reward_function`` is configured (verl's name and
signature). It finds the sample's rule in three tables, in this order: ``RULES`` (the exact data
source name), ``PREFIX_RULES`` (a name that starts with the key: ``aime2024``) and
``SUBSTRING_RULES`` (a name that contains the key: ``countdown_3to4``). It returns the rule's
result as verl does: a dict as it is (``math_dapo``'s ``{"score", "acc", "pred"}``), anything
else as a float. Keyword arguments a rule does not take (``reward_router_address`` from the
worker, ``sandbox_fusion_url``) are dropped. The sources whose checker runs the model's code
(``UNAVAILABLE``) raise ``RuleUnavailableError`` saying why; an unknown source raises
``UnknownDataSourceError`` (a ``ValueError`` and, as verl raises, a ``NotImplementedError``)
listing the known ones. ``@register_rule(name, ...)`` adds a rule, also for an unavailable
source (that is how a sandbox is plugged in). The rules live one family a module
(``score_*``); this module only maps names to them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from weightsync.reward_loop.score_countdown import countdown_score
from weightsync.reward_loop.score_dapo import dapo_score
from weightsync.reward_loop.score_geo3k import geo3k_score
from weightsync.reward_loop.score_gsm8k import final_number, gsm8k_score
from weightsync.reward_loop.score_math import last_boxed, math_score, normalize_math
from weightsync.reward_loop.score_prime import prime_score
from weightsync.reward_loop.score_qa import qa_em_score

__all__ = ["PREFIX_RULES", "RULES", "SUBSTRING_RULES", "UNAVAILABLE", "RuleUnavailableError",
           "UnknownDataSourceError", "default_compute_score", "final_number", "find_rule",
           "gsm8k_score", "last_boxed", "math_score", "normalize_math", "register_rule"]

Rule = Callable[..., Any]

_NUMINA = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
           "numina_cn_k12", "numina_olympiads")
_SEARCH_R1 = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
              "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")

#: data source -> rule ``(solution_str, ground_truth, **kwargs) -> float | dict``
RULES: dict[str, Rule] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,  # ours: the short name
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math_dapo": dapo_score,
    "math": dapo_score,
    "math_dapo_reasoning": dapo_score,
    "hiyouga/geometry3k": geo3k_score,
    **dict.fromkeys(_NUMINA, prime_score),
    **dict.fromkeys(_SEARCH_R1, qa_em_score),
}
#: a data source that starts with the key -> rule
PREFIX_RULES: dict[str, Rule] = {"aime": dapo_score}
#: a data source that contains the key -> rule
SUBSTRING_RULES: dict[str, Rule] = {"countdown": countdown_score}

_CODE = ("its checker runs the model's code against test cases, which needs a sandbox (verl: "
         "sandbox_fusion at sandbox_fusion_url, or prime_code's local executor); weightsync "
         "runs no model-written code")
#: data sources verl scores with a service or code execution -> why they are not here
UNAVAILABLE: dict[str, str] = dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), _CODE)


class UnknownDataSourceError(ValueError, NotImplementedError):
    """No rule for a data source (a ``NotImplementedError`` too, what verl raises)."""


class RuleUnavailableError(NotImplementedError):
    """A data source verl knows whose checker needs a service this package does not run."""


def register_rule(*data_sources: str) -> Callable[[Rule], Rule]:
    """Register ``fn(solution_str, ground_truth, **kwargs) -> float | dict`` as the rule of each
    of ``data_sources`` (exact names; also an ``UNAVAILABLE`` one, which it then serves).

    Args:
        *data_sources: the names.

    Returns:
        The decorator; it returns ``fn`` unchanged.

    Raises:
        ValueError: a name already has another rule (raised when decorating).
    """

    def deco(fn: Rule) -> Rule:
        for name in data_sources:
            if name in RULES and RULES[name] is not fn:
                raise ValueError(f"rule for data source {name!r} is already registered "
                                 f"({RULES[name].__qualname__})")
        for name in data_sources:
            RULES[name] = fn
        return fn

    return deco


def find_rule(data_source: str) -> Rule:
    """The rule of ``data_source``: an exact name, then a prefix, then a substring.

    Args:
        data_source: the sample's data source.

    Returns:
        The rule.

    Raises:
        RuleUnavailableError: verl scores it with a service (``UNAVAILABLE``).
        UnknownDataSourceError: no rule matches.
    """
    name = str(data_source)
    if name in RULES:
        return RULES[name]
    if name in UNAVAILABLE:
        raise RuleUnavailableError(
            f"data_source {name!r}: not available here: {UNAVAILABLE[name]}. Plug a checker in "
            f"with @weightsync.reward_loop.register_rule({name!r}) or configure "
            f"custom_reward_function")
    for table, test in ((PREFIX_RULES, name.startswith), (SUBSTRING_RULES, name.__contains__)):
        for key, rule in table.items():
            if test(key):
                return rule
    known = [*sorted(RULES), *(f"{k}*" for k in PREFIX_RULES),
             *(f"*{k}*" for k in SUBSTRING_RULES)]
    raise UnknownDataSourceError(
        f"data_source {name!r}: no rule-based reward for it; known data sources: "
        f"{', '.join(known)} (register one with weightsync.reward_loop.register_rule, or "
        f"configure custom_reward_function)")


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None, sandbox_fusion_url: str | None = None,
                          concurrent_semaphore: Any = None, memory_limit_mb: int | None = None,
                          **kwargs: Any) -> float | dict:
    """The rule of ``data_source`` applied to one response (verl's signature).

    Args:
        data_source: picks the rule (``find_rule``).
        solution_str: the decoded response.
        ground_truth: the sample's ground truth, in the form its rule reads.
        extra_info: the sample's extra info (no built-in rule reads it).
        sandbox_fusion_url: verl's code-sandbox address; taken for its signature (the code
            sources are ``UNAVAILABLE``), passed to a registered rule that takes it.
        concurrent_semaphore: the same, verl's sandbox concurrency guard.
        memory_limit_mb: the same, verl's sandbox memory limit.
        **kwargs: passed to the rule when it takes them (``strict_box_verify`` for
            ``math_dapo``), else dropped.

    Returns:
        A dict result as the rule returns it, any other result as a float.

    Raises:
        RuleUnavailableError: see ``find_rule``.
        UnknownDataSourceError: see ``find_rule``.
    """
    rule = find_rule(data_source)
    offered = {"extra_info": extra_info, "sandbox_fusion_url": sandbox_fusion_url,
               "concurrent_semaphore": concurrent_semaphore,
               "memory_limit_mb": memory_limit_mb, **kwargs}
    params = inspect.signature(rule).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        offered = {k: v for k, v in offered.items() if k in params}
    result = rule(solution_str, ground_truth, **offered)
    return result if isinstance(result, dict) else float(result)
