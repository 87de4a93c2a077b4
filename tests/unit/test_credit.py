"""``RewardModelCreditAssigner``: hand-computed expectations and hypothesis properties."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from weightsync.reward.credit import MODES, RewardModelCreditAssigner, group_normalize

S = [0.5, -1.0, 2.0, 0.0]  # reward-model scores
R = [1.0, 0.0, 1.0, 0.0]  # environment rewards


# -- the modes, by hand ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"mode": "replace"}, [0.5, -1.0, 2.0, 0.0]),
        ({"mode": "add"}, [1.5, -1.0, 3.0, 0.0]),
        ({"mode": "add", "weight": 0.5}, [1.25, -0.5, 2.0, 0.0]),
        ({"mode": "multiply"}, [0.5, -0.0, 2.0, 0.0]),
        ({"mode": "weighted", "weight": 0.25}, [0.875, -0.25, 1.25, 0.0]),
        ({"mode": "weighted", "weight": 0.0}, R),
        ({"mode": "weighted", "weight": 1.0}, S),
        ({"mode": "bonus", "bonus": 0.3}, [1.3, 0.0, 1.3, 0.0]),  # s > 0 gets the bonus; s = 0 not
        ({"mode": "bonus", "bonus": 0.3, "threshold": 1.0}, [1.0, 0.0, 1.3, 0.0]),
    ],
)
def test_modes(kwargs, expected):
    assert RewardModelCreditAssigner(**kwargs).assign(S, R) == pytest.approx(expected)


def test_replace_needs_no_env_rewards_and_ignores_them():
    a = RewardModelCreditAssigner("replace")
    assert a.assign(S) == S
    assert a.assign(S, [None] * 4) == S


def test_env_rewards_may_be_booleans_scores_may_not():
    assert RewardModelCreditAssigner("add").assign([0.5, 0.5], [True, False]) == [1.5, 0.5]
    with pytest.raises(ValueError, match="rollout 0: score must be a number, got bool"):
        RewardModelCreditAssigner("replace").assign([True])


def test_multi_label_scores_need_a_label():
    scores = [[0.1, 0.9], [0.7, 0.2]]
    with pytest.raises(ValueError, match="rollout 0: the reward model gives 2 labels per text; set label_index"):
        RewardModelCreditAssigner().assign(scores)
    assert RewardModelCreditAssigner(label_index=1).assign(scores) == [0.9, 0.2]
    assert RewardModelCreditAssigner().assign([[0.4], [0.6]]) == [0.4, 0.6]  # one label in a list
    with pytest.raises(ValueError, match="rollout 0: label_index 2 but only 2 labels"):
        RewardModelCreditAssigner(label_index=2).assign(scores)


# -- group normalisation, by hand -----------------------------------------------------------------------


def test_group_normalize_by_hand():
    # group a: [1, 2, 3] mean 2, sample std 1; group b: [10, 14] mean 12, sample std sqrt(8)
    got = group_normalize([1, 10, 2, 14, 3], ["a", "b", "a", "b", "a"], eps=0.0)
    s8 = math.sqrt(8)
    assert got == pytest.approx([-1.0, -2 / s8, 0.0, 2 / s8, 1.0])


def test_group_normalize_eps_and_degenerate_groups():
    got = group_normalize([1, 2, 3], [0, 0, 0], eps=1.0)
    assert got == pytest.approx([-0.5, 0.0, 0.5])  # (x - 2) / (1 + 1)
    assert group_normalize([5.0], ["solo"]) == [0.0]  # a group of one: std 0 -> 0
    assert group_normalize([3.0, 3.0], [1, 1], eps=0.0) == [0.0, 0.0]  # constant group: no NaN
    assert group_normalize([], []) == []


def test_mean_only_normalisation():
    assert group_normalize([1, 2, 6], [0, 0, 0], scale_by_std=False) == pytest.approx([-2, -1, 3])


def test_combine_then_normalise():
    a = RewardModelCreditAssigner("add", weight=2.0, group_normalize=True, eps=0.0)
    # combined: [1+1, 0-2, 1+4, 0+0] = [2, -2, 5, 0]; groups p: [2, 5], q: [-2, 0]
    got = a.assign(S, R, ["p", "q", "p", "q"])
    assert got == pytest.approx([-1 / math.sqrt(2), -1 / math.sqrt(2), 1 / math.sqrt(2), 1 / math.sqrt(2)])


# -- rollouts ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Rollout:
    prompt: str
    response: str
    reward: float | None = None
    metadata: dict = dataclasses.field(default_factory=dict)


def test_assign_rollouts_reads_metadata_and_writes_output():
    rollouts = [
        {"prompt": "p1", "reward": 1.0, "metadata": {"rm_score": 0.5}},
        {"prompt": "p1", "reward": 0.0, "metadata": {"rm_score": 1.5}},
        Rollout("p2", "x", reward=None, metadata={"rm_score": 2.0, "reward": 1.0}),  # env in metadata
        Rollout("p2", "y", reward=1.0, metadata={"rm_score": 0.0}),
    ]
    a = RewardModelCreditAssigner("add", group_normalize=True, eps=0.0)
    # combined: [1.5, 1.5, 3.0, 1.0]; p1 constant -> 0, 0; p2 [3, 1] -> +-1/sqrt(2)
    got = a.assign_rollouts(rollouts, output_key="credit")
    h = 1 / math.sqrt(2)
    assert got == pytest.approx([0.0, 0.0, h, -h])
    assert rollouts[2].metadata["credit"] == pytest.approx(h)
    assert rollouts[0]["metadata"]["credit"] == 0.0


def test_assign_rollouts_group_fn_and_missing_group():
    rollouts = [{"q": i // 2, "metadata": {"rm_score": float(i)}} for i in range(4)]
    a = RewardModelCreditAssigner(group_normalize=True, scale_by_std=False)
    assert a.assign_rollouts(rollouts, group_key=lambda r: r["q"]) == [-0.5, 0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="rollout 0: no group field 'prompt'"):
        a.assign_rollouts(rollouts)
    rollouts[1]["prompt"] = ["unhashable"]
    rollouts[0]["prompt"] = "x"
    with pytest.raises(ValueError, match="rollout 1: group id of type list is not hashable"):
        a.assign_rollouts(rollouts)


# -- errors ------------------------------------------------------------------------------------------------


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown credit mode 'sum'; valid modes: replace, add, multiply, weighted, bonus"):
        RewardModelCreditAssigner("sum")


def test_missing_scores_named():
    with pytest.raises(ValueError, match=r"missing reward-model scores for rollouts \[1, 3\] \(2 of 4\)"):
        RewardModelCreditAssigner().assign([0.1, None, 0.2, None])
    rollouts = [{"metadata": {"rm_score": 1.0}}, {"metadata": {}}, {}]
    with pytest.raises(ValueError, match=r"rollouts \[1, 2\]"):
        RewardModelCreditAssigner().assign_rollouts(rollouts)


def test_missing_env_rewards_named():
    with pytest.raises(ValueError, match="mode 'add' needs env_rewards"):
        RewardModelCreditAssigner("add").assign(S)
    with pytest.raises(ValueError, match=r"missing environment rewards for rollouts \[2\]"):
        RewardModelCreditAssigner("multiply").assign(S, [1.0, 1.0, None, 0.0])


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="length mismatch: 4 scores but 3 env_rewards"):
        RewardModelCreditAssigner("add").assign(S, R[:3])
    with pytest.raises(ValueError, match="length mismatch: 4 rewards but 2 group ids"):
        RewardModelCreditAssigner(group_normalize=True).assign(S, None, [0, 1])
    with pytest.raises(ValueError, match="group_normalize=True needs group_ids"):
        RewardModelCreditAssigner(group_normalize=True).assign(S)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "weighted", "weight": 1.5}, "0 <= weight <= 1"),
        ({"weight": float("nan")}, "weight must be a finite number"),
        ({"eps": -1.0}, "eps must be >= 0"),
        ({"label_index": -1}, "label_index must be an int >= 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardModelCreditAssigner(**kwargs)


def test_non_finite_inputs_refused():
    with pytest.raises(ValueError, match="rollout 1: score is not finite"):
        RewardModelCreditAssigner().assign([0.0, float("inf")])
    with pytest.raises(ValueError, match="rollout 0: env reward is not finite"):
        RewardModelCreditAssigner("add").assign([0.0], [float("nan")])


# -- properties ------------------------------------------------------------------------------------------

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def grouped(draw):
    n = draw(st.integers(1, 40))
    values = draw(st.lists(finite, min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return values, groups


def _by_group(values, groups):
    out: dict = {}
    for v, g in zip(values, groups, strict=True):
        out.setdefault(g, []).append(v)
    return out


@settings(max_examples=150, deadline=None)
@given(grouped())
def test_normalised_groups_have_mean_zero(vg):
    values, groups = vg
    out = group_normalize(values, groups)
    for members in _by_group(out, groups).values():
        assert abs(statistics.fmean(members)) < 1e-6


@settings(max_examples=150, deadline=None)
@given(grouped())
def test_normalised_groups_have_unit_std_when_spread(vg):
    values, groups = vg
    out = group_normalize(values, groups, eps=0.0)
    raw = _by_group(values, groups)
    for g, members in _by_group(out, groups).items():
        if len(members) > 1 and statistics.stdev(raw[g]) > 1e-3:
            assert statistics.stdev(members) == pytest.approx(1.0, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(grouped(), finite, st.floats(0.01, 100))
def test_normalisation_ignores_per_group_shift_and_scale(vg, shift, scale):
    values, groups = vg
    assume(all(statistics.pstdev(m) > 1e-3 or len(m) == 1 for m in _by_group(values, groups).values()))
    a = group_normalize(values, groups, eps=0.0)
    b = group_normalize([v * scale + shift for v in values], groups, eps=0.0)
    assert b == pytest.approx(a, abs=1e-5)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.tuples(finite, finite), min_size=1, max_size=20),
       st.floats(0, 1))
def test_assign_matches_the_formula(mode, pairs, weight):
    s = [p[0] for p in pairs]
    r = [p[1] for p in pairs]
    got = RewardModelCreditAssigner(mode, weight=weight, bonus=0.7, threshold=0.1).assign(s, r)
    formula = {
        "replace": lambda si, ri: si,
        "add": lambda si, ri: ri + weight * si,
        "multiply": lambda si, ri: ri * si,
        "weighted": lambda si, ri: (1 - weight) * ri + weight * si,
        "bonus": lambda si, ri: ri + (0.7 if si > 0.1 else 0.0),
    }[mode]
    assert got == pytest.approx([formula(si, ri) for si, ri in pairs])
