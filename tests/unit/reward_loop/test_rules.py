"""The rule-based default reward: verl's data-source dispatch (exact names, the ``aime`` prefix,
the ``countdown`` substring), its return types, the sources needing a sandbox, the registry."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.rules import (
    RULES,
    UNAVAILABLE,
    RuleUnavailableError,
    UnknownDataSourceError,
    default_compute_score,
    find_rule,
    register_rule,
)

# every data source verl's default_compute_score (verl/utils/reward_score/__init__.py) names,
# with one right and one wrong response in the form its data has, and the right score
GSM8K = ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "#### 71", "72")
MATH = ("so $\\boxed{\\frac{1}{2}}$.", "\\boxed{\\frac{1}{3}}", "\\frac12")
NUMINA = ("The answer is \\boxed{x^2 + y^2 + 4x - 6y + 13}", "The answer is 13",
          "(x + 2)^2 + (y - 3)^2")
GEO3K = ("<think>The angles sum to 180.</think> \\boxed{30}", "<think>x</think> \\boxed{31}", "30")
SEARCH = ("<answer> Beijing </answer>", "<answer> Shanghai </answer>", {"target": ["Beijing"]})
COUNTDOWN = ("Assistant: <answer>44 + 19 + 35</answer>", "Assistant: <answer>44 + 19 - 35</answer>",
             {"target": 98, "numbers": [44, 19, 35]})
FLOAT_SOURCES = [
    ("openai/gsm8k", *GSM8K, 1.0, 0.0),
    ("lighteval/MATH", *MATH, 1.0, 0.0),
    ("DigitalLearningGmbH/MATH-lighteval", *MATH, 1.0, 0.0),
    ("HuggingFaceH4/MATH-500", *MATH, 1.0, 0.0),
    *[(name, *NUMINA, 1.0, 0.0) for name in (
        "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
        "numina_cn_k12", "numina_olympiads")],
    ("hiyouga/geometry3k", *GEO3K, 1.0, 0.1),
    *[(name, *SEARCH, 1.0, 0.0) for name in (
        "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
        "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")],
    ("countdown", *COUNTDOWN, 1.0, 0.1),  # any name containing "countdown"
    ("my_countdown_3to4", *COUNTDOWN, 1.0, 0.1),
]
DAPO_SOURCES = ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"]


@pytest.mark.parametrize(("source", "right", "wrong", "truth", "hit", "miss"), FLOAT_SOURCES)
def test_every_local_source_scores_right_and_wrong_as_a_float(source, right, wrong, truth, hit,
                                                              miss):
    got = default_compute_score(source, right, truth, {})
    assert type(got) is float and got == pytest.approx(hit)
    assert default_compute_score(source, wrong, truth, None) == pytest.approx(miss)


@pytest.mark.parametrize("source", DAPO_SOURCES)
def test_dapo_sources_return_verl_dict(source):
    assert default_compute_score(source, "17 * 2\nAnswer: 34", "34") == {
        "score": 1.0, "acc": True, "pred": "34"}
    assert default_compute_score(source, "Answer: 35", "34")["score"] == -1.0


def test_keywords_reach_a_rule_that_takes_them_and_are_dropped_otherwise():
    boxed = "so \\boxed{34}"
    assert default_compute_score("math_dapo", boxed, "34")["acc"] is False  # no Answer: line
    assert default_compute_score("math_dapo", boxed, "34", strict_box_verify=True)["acc"] is True
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "3", {}, strict_box_verify=True,
                                 reward_router_address="x:1",
                                 sandbox_fusion_url="http://sandbox") == 1.0


@pytest.mark.parametrize("source", ["codecontests", "apps", "codeforces", "taco"])
def test_code_sources_say_why_they_are_not_available(source):
    assert source in UNAVAILABLE
    with pytest.raises(RuleUnavailableError, match=rf"'{source}'.*sandbox.*register_rule"):
        default_compute_score(source, "print(1)", '{"inputs": [""], "outputs": ["1"]}',
                              sandbox_fusion_url="http://127.0.0.1:1")


def test_unknown_source_is_value_and_not_implemented_error_listing_the_known():
    with pytest.raises(UnknownDataSourceError,
                       match=r"data_source 'my/data'.*known data sources:.*openai/gsm8k.*aime\*"):
        default_compute_score("my/data", "x", "y")
    with pytest.raises(ValueError):
        find_rule("my/data")
    with pytest.raises(NotImplementedError):  # what verl raises
        find_rule("my/data")


def test_register_rule_adds_a_source_and_refuses_a_second_function():
    @register_rule("unit-test/exact")
    def exact(solution_str, ground_truth):
        return float(solution_str.strip() == ground_truth)

    try:
        assert default_compute_score("unit-test/exact", " yes ", "yes") == 1.0
        with pytest.raises(ValueError, match="already registered"):
            register_rule("unit-test/exact")(lambda s, g: 0.0)
    finally:
        RULES.pop("unit-test/exact")


def test_a_registered_rule_plugs_a_sandbox_into_an_unavailable_source():
    seen = {}

    @register_rule("apps")
    def my_sandbox(solution_str, ground_truth, sandbox_fusion_url=None, **kwargs):
        seen.update(url=sandbox_fusion_url, extra_info=kwargs.get("extra_info"))
        return {"score": 1.0, "passed": 3}

    try:
        got = default_compute_score("apps", "print(1)", "tests", {"id": 7},
                                    sandbox_fusion_url="http://sandbox:8080")
        assert got == {"score": 1.0, "passed": 3}
        assert seen == {"url": "http://sandbox:8080", "extra_info": {"id": 7}}
    finally:
        RULES.pop("apps")
    with pytest.raises(RuleUnavailableError):
        find_rule("apps")


def test_no_rule_raises_on_garbage_responses():
    """A model writes anything: every rule answers a score, never an exception (which would fail
    the batch). Fixed-seed random mixes of the tokens the rules look for."""
    import random

    rng = random.Random(0)
    pieces = ["\\boxed{", "}", "{", "\\frac", "\\sqrt", "Answer:", "<answer>", "</answer>",
              "Assistant:", "####", "=", "\\begin{pmatrix}", "\\end{pmatrix}", "&", "\\\\", "^",
              "(", ")", "x", "y", "z", "12", "9", ".", ",", "\\pi", " is ", "<think>",
              "</think>", "\\text{", "**", "/", "-", " ", "\n", "$"]
    truths = {"openai/gsm8k": "72", "lighteval/MATH": "\\frac{1}{2}", "math_dapo": "34",
              "numina_olympiads": "x^2+1", "hiyouga/geometry3k": "3\\sqrt{2}",
              "searchR1_nq": {"target": ["Beijing"]},
              "countdown": {"target": 10, "numbers": [2, 5]}}
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        for source, truth in truths.items():
            got = default_compute_score(source, text, truth)
            score = got["score"] if isinstance(got, dict) else got
            assert -1.0 <= score <= 1.0, (source, text, got)
        assert default_compute_score("numina_olympiads", text, text) in (0.0, 1.0)
