"""The rule-based default reward: GSM8K's final number, MATH's last ``\\boxed{}``, the rule per
data source and its registry."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.rules import (
    RULES,
    default_compute_score,
    final_number,
    gsm8k_score,
    last_boxed,
    math_score,
    register_rule,
)


@pytest.mark.parametrize(("text", "truth", "method", "want"), [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "strict", 1.0),
    ("#### 1,200.", "1200", "strict", 1.0),  # comma and trailing period ignored
    ("#### $72.0", "72", "strict", 1.0),  # 72.0 is 72
    ("The answer is 72", "72", "strict", 0.0),  # strict needs ####
    ("The answer is 72", "72", "flexible", 1.0),
    ("first 5, then #### 6 and finally 7", "6", "strict", 1.0),  # the number after ####
    ("first 5, then #### 6 and finally 7", "7", "flexible", 1.0),  # the last number
    ("#### 71", "72", "strict", 0.0),
    ("#### -3", "-3", "strict", 1.0),
])
def test_gsm8k_final_number(text, truth, method, want):
    assert gsm8k_score(text, truth, method=method) == want


def test_gsm8k_ground_truth_may_be_a_full_solution_and_format_score_applies():
    solution = "Janet has 16 eggs, eats 3 and bakes with 4: 16 - 3 - 4 = 9.\n#### 9"
    assert gsm8k_score("... so #### 9", solution) == 1.0
    assert gsm8k_score("#### 8", "9", format_score=0.1) == 0.1  # found an answer, wrong
    assert gsm8k_score("no number here", "9", format_score=0.1) == 0.0  # no answer at all
    assert final_number("no digits") is None
    with pytest.raises(ValueError, match="method"):
        final_number("#### 1", "greedy")


@pytest.mark.parametrize(("text", "truth", "want"), [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{ 0.5 }", ".5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)", 1.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("no box: 7", "7", 0.0),
    ("\\boxed{7", "7", 0.0),  # never closes
    ("\\fbox{4}", "4", 1.0),
    ("\\boxed 4", "4", 1.0),
    ("\\boxed{3}", "The answer is $\\boxed{3}$.", 1.0),  # a full solution as ground truth
])
def test_math_boxed(text, truth, want):
    assert math_score(text, truth) == want


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{a}{b}} x") == "\\frac{a}{b}"
    assert last_boxed("nothing") is None


def test_default_compute_score_picks_the_rule_by_data_source_and_drops_unknown_kwargs():
    assert default_compute_score("openai/gsm8k", "#### 3", "3", {}) == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "3", {},
                                 strict_box_verify=True, reward_router_address="x:1") == 1.0
    with pytest.raises(ValueError, match=r"data_source 'my/data'.*known data sources:.*openai/gsm8k"):
        default_compute_score("my/data", "x", "y")


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
