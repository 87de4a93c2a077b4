"""``RewardModelCreditAssigner`` and the GRPO / ScaleRL assigners against hand-computed values.

Every expected number below is worked out by hand in the comments next to it (combined rewards,
group means, population standard deviations); the code under test computes none of them. ``z``
only applies ``(x - mean) / (std + 1e-8)`` to those hand-given constants.
"""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from weightsync.reward.advantages import (
    EpisodicReturn,
    GRPOAssigner,
    PerStepReward,
    ScaleRLAssigner,
)
from weightsync.reward.credit import (
    MODES,
    RewardModelCreditAssigner,
    make_rm_grpo_assigner,
    make_rm_scalerl_assigner,
)
from weightsync.reward.rollout import CreditAssigner, Rollout, Step

EPS = 1e-8
# the non-default knob each mode is tested with (rm_coeff only for bonus, alpha only for weighted)
KNOBS = {"replace": {}, "add": {}, "multiply": {}, "weighted": {"alpha": 0.25},
         "bonus": {"rm_coeff": 0.5}}


def z(values, mean, std):
    return [(v - mean) / (std + EPS) for v in values]


def ro(rid, rewards, *, rm=None, step_rm=None, group=None, prompt=None):
    """A rollout with one step per reward; ``rm``: sequence score, ``step_rm``: step scores."""
    steps = [
        Step(i, prompt if (prompt and i == 0) else f"{rid}-obs{i}", f"{rid}-act{i}", reward=r,
             meta={} if step_rm is None else {"rm_score": step_rm[i]})
        for i, r in enumerate(rewards)
    ]
    meta = {}
    if rm is not None:
        meta["rm_score"] = rm
    if group is not None:
        meta["initial_obs"] = group
    return Rollout(id=rid, steps=steps, meta=meta)


def compute(mode, rollouts, *, level="sequence", inner=None):
    return RewardModelCreditAssigner(mode, score_level=level, inner_assigner=inner,
                                     **KNOBS[mode]).compute(rollouts)


# -- no inner assigner ------------------------------------------------------------------------------

# rollout a: env rewards [1, 2] (R = 3), sequence score 0.5; rollout b: env [-1], score 2
SEQ_NO_INNER = {
    # mode: (weight of every step of a, weight of b)
    "replace": (0.5, 2.0),                                   # rm
    "add": (3.5, 1.0),                                       # R + rm: 3 + .5, -1 + 2
    "multiply": (1.5, -2.0),                                 # R * rm: 3 * .5, -1 * 2
    "weighted": (1.125, 1.25),                               # .25 R + .75 rm: .75 + .375, -.25 + 1.5
    "bonus": (3.25, 0.0),                                    # R + .5 rm: 3 + .25, -1 + 1
}


@pytest.mark.parametrize("mode", MODES)
def test_sequence_level_without_inner_gives_every_step_the_combined_return(mode):
    rollouts = [ro("a", [1.0, 2.0], rm=0.5), ro("b", [-1.0], rm=2.0)]
    wa, wb = SEQ_NO_INNER[mode]
    got = compute(mode, rollouts)
    assert list(got) == [("a", 0), ("a", 1), ("b", 0)]
    assert got == pytest.approx({("a", 0): wa, ("a", 1): wa, ("b", 0): wb})


# rollout a: env [1, 2], step scores [.5, -1]; rollout b: env [-1], step score [2]
STEP_NO_INNER = {
    "replace": (0.5, -1.0, 2.0),
    "add": (1.5, 1.0, 1.0),                                  # 1 + .5, 2 - 1, -1 + 2
    "multiply": (0.5, -2.0, -2.0),                           # 1 * .5, 2 * -1, -1 * 2
    "weighted": (0.625, -0.25, 1.25),                        # .25 + .375, .5 - .75, -.25 + 1.5
    "bonus": (1.25, 1.5, 0.0),                               # 1 + .25, 2 - .5, -1 + 1
}


@pytest.mark.parametrize("mode", MODES)
def test_step_level_without_inner_gives_each_step_its_combined_reward(mode):
    rollouts = [ro("a", [1.0, 2.0], step_rm=[0.5, -1.0]), ro("b", [-1.0], step_rm=[2.0])]
    a0, a1, b0 = STEP_NO_INNER[mode]
    assert compute(mode, rollouts, level="step") == pytest.approx(
        {("a", 0): a0, ("a", 1): a1, ("b", 0): b0})


# env [1, 2], sequence score .5: the score is credited at the last step, every step keeps
# env * (the mode's env factor), so a return-based inner assigner sees combine(R, rm)
SEQ_SHAPED_STEPS = {
    "replace": (0.0, 0.5),                                   # factor 0; last + .5
    "add": (1.0, 2.5),                                       # factor 1; last + .5
    "multiply": (0.5, 1.0),                                  # factor .5 (the score); nothing added
    "weighted": (0.25, 0.875),                               # factor .25; last + .75 * .5
    "bonus": (1.0, 2.25),                                    # factor 1; last + .5 * .5
}


@pytest.mark.parametrize("mode", MODES)
def test_sequence_score_is_credited_at_the_final_step_for_an_inner_assigner(mode):
    rollouts = [ro("a", [1.0, 2.0], rm=0.5)]
    s0, s1 = SEQ_SHAPED_STEPS[mode]
    assert compute(mode, rollouts, inner=PerStepReward()) == pytest.approx(
        {("a", 0): s0, ("a", 1): s1})
    # and with an explicit EpisodicReturn inner: the same as no inner at all
    assert compute(mode, rollouts, inner=EpisodicReturn()) == pytest.approx(
        compute(mode, rollouts))


def test_replace_ignores_env_rewards_and_final_step_is_list_order_not_index():
    rollouts = [Rollout("r", [Step(5, "o", "a", reward=float("nan")), Step(2, "o2", "b")],
                        {"rm_score": 3.0})]
    got = RewardModelCreditAssigner("replace", inner_assigner=PerStepReward()).compute(rollouts)
    assert got == {("r", 5): 0.0, ("r", 2): 3.0}


# -- GRPO / ScaleRL inner assigners, sequence level ---------------------------------------------------


def seq_batch():
    """Groups: p (meta initial_obs), q (no meta: falls back to the shared first prev_obs), a
    group of one, and a group whose two rollouts are identical (equal in every mode)."""
    return [
        ro("p1", [1.0, 1.0], rm=1.0, group="p"),            # R = 2
        ro("p2", [0.0], rm=3.0, group="p"),                 # R = 0
        ro("p3", [1.0], rm=-1.0, group="p"),                # R = 1
        ro("q1", [2.0], rm=0.0, prompt="q-prompt"),
        ro("q2", [0.0], rm=2.0, prompt="q-prompt"),
        ro("s1", [5.0], rm=7.0, group="solo"),
        ro("m1", [1.0], rm=2.0, group="same"),
        ro("m2", [1.0], rm=2.0, group="same"),
    ]


S2, S23, S14 = math.sqrt(2), math.sqrt(2 / 3), math.sqrt(14) / 3
# GRPO: per mode the advantages of p1, p2, p3 and of q1, q2 (solo and same are 0)
SEQ_GRPO = {
    # combined p = [1, 3, -1]: mean 1, var (0 + 4 + 4) / 3 = 8/3; q = [0, 2]: mean 1, std 1
    "replace": (z([1, 3, -1], 1, math.sqrt(8 / 3)), z([0, 2], 1, 1)),
    # p = [3, 3, 0]: mean 2, var (1 + 1 + 4) / 3 = 2; q = [2, 2]: equal -> 0
    "add": (z([3, 3, 0], 2, S2), [0.0, 0.0]),
    # p = [2, 0, -1]: mean 1/3, var (25 + 1 + 16) / 27 = 14/9; q = [0, 0] -> 0
    "multiply": (z([2, 0, -1], 1 / 3, S14), [0.0, 0.0]),
    # p = [.5 + .75, 2.25, .25 - .75] = [1.25, 2.25, -.5]: mean 1, var 3.875 / 3; q = [.5, 1.5]
    "weighted": (z([1.25, 2.25, -0.5], 1.0, math.sqrt(3.875 / 3)), z([0.5, 1.5], 1.0, 0.5)),
    # p = [2.5, 1.5, .5]: mean 1.5, var 2/3; q = [2, 1]: mean 1.5, std .5
    "bonus": (z([2.5, 1.5, 0.5], 1.5, S23), z([2.0, 1.0], 1.5, 0.5)),
}
# ScaleRL: the same group-centred values over one batch std (groups without spread left out)
SEQ_SCALERL = {
    # centred p [0, 2, -2], q [-1, 1]: sum of squares 10 over 5 -> std sqrt 2
    "replace": (z([0, 2, -2], 0, S2), z([-1, 1], 0, S2)),
    # p [1, 1, -2] (q has no spread): 6 / 3 -> std sqrt 2
    "add": (z([1, 1, -2], 0, S2), [0.0, 0.0]),
    # p [5/3, -1/3, -4/3] only: std sqrt(14) / 3
    "multiply": (z([5 / 3, -1 / 3, -4 / 3], 0, S14), [0.0, 0.0]),
    # p [.25, 1.25, -1.5], q [-.5, .5]: (3.875 + .5) / 5 = .875
    "weighted": (z([0.25, 1.25, -1.5], 0, math.sqrt(0.875)), z([-0.5, 0.5], 0, math.sqrt(0.875))),
    # p [1, 0, -1], q [.5, -.5]: (2 + .5) / 5 = .5
    "bonus": (z([1, 0, -1], 0, math.sqrt(0.5)), z([0.5, -0.5], 0, math.sqrt(0.5))),
}


def _expect(batch, p, q):
    adv = dict(zip(["p1", "p2", "p3", "q1", "q2"], [*p, *q], strict=True))
    adv.update(s1=0.0, m1=0.0, m2=0.0)
    return {(r.id, s.index): adv[r.id] for r in batch for s in r.steps}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inner,table", [(GRPOAssigner, SEQ_GRPO), (ScaleRLAssigner, SEQ_SCALERL)],
                         ids=["grpo", "scalerl"])
def test_sequence_level_group_advantages(mode, inner, table):
    batch = seq_batch()
    got = compute(mode, batch, inner=inner())
    expected = _expect(batch, *table[mode])
    assert list(got) == list(expected)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert got[("p1", 0)] == got[("p1", 1)]  # the rollout's advantage on each of its steps
    for rid in ("s1", "m1", "m2"):  # a group of one, and equal scores: exactly 0, not rounding
        assert got[(rid, 0)] == 0.0


def step_batch():
    return [
        ro("p1", [1.0, 0.0], step_rm=[1.0, 2.0], group="p"),
        ro("p2", [2.0], step_rm=[-1.0], group="p"),
        ro("p3", [0.0], step_rm=[0.0], group="p"),
        ro("q1", [1.0], step_rm=[0.0], group="q"),
        ro("q2", [0.0], step_rm=[1.0], group="q"),
        ro("s1", [1.0], step_rm=[1.0], group="solo"),
    ]


# per-step combined rewards summed per rollout, p = [p1, p2, p3], q = [q1, q2]
STEP_SUMS = {
    "replace": ([1 + 2, -1, 0], [0, 1]),
    "add": ([2 + 2, 1, 0], [1, 1]),
    "multiply": ([1 + 0, -2, 0], [0, 0]),
    "weighted": ([1.0 + 1.5, 0.5 - 0.75, 0], [0.25, 0.75]),       # .25 e + .75 s per step
    "bonus": ([1.5 + 1.0, 2 - 0.5, 0], [1.0, 0.5]),               # e + .5 s per step
}
# hand means / population stds of the p sums, and the centred q values
STEP_P_STATS = {
    "replace": (2 / 3, math.sqrt(78 / 27)),      # dev 7/3, -5/3, -2/3: (49 + 25 + 4) / 9 / 3
    "add": (5 / 3, math.sqrt(78 / 27)),          # dev 7/3, -2/3, -5/3
    "multiply": (-1 / 3, math.sqrt(42 / 27)),    # dev 4/3, -5/3, 1/3
    "weighted": (0.75, math.sqrt(4.625 / 3)),    # dev 1.75, -1, -.75
    "bonus": (4 / 3, math.sqrt(114 / 108)),      # dev 7/6, 1/6, -4/3
}
STEP_Q_CENTRED = {"replace": [-0.5, 0.5], "add": [0, 0], "multiply": [0, 0],
                  "weighted": [-0.25, 0.25], "bonus": [0.25, -0.25]}
# sum of squared centred values over the rollouts of groups with a spread, and their count
STEP_BATCH_SQ = {"replace": (78 / 9 + 0.5, 5), "add": (78 / 9, 3), "multiply": (42 / 9, 3),
                 "weighted": (4.625 + 0.125, 5), "bonus": (114 / 36 + 0.125, 5)}


@pytest.mark.parametrize("mode", MODES)
def test_step_level_grpo(mode):
    batch = step_batch()
    p, _ = STEP_SUMS[mode]
    mean, std = STEP_P_STATS[mode]
    qc = STEP_Q_CENTRED[mode]
    q_adv = [0.0, 0.0] if qc == [0, 0] else [c / (abs(qc[0]) + EPS) for c in qc]  # two: +-1
    adv = dict(zip(["p1", "p2", "p3", "q1", "q2"], [*z(p, mean, std), *q_adv], strict=True))
    adv["s1"] = 0.0
    expected = {(r.id, s.index): adv[r.id] for r in batch for s in r.steps}
    got = compute(mode, batch, level="step", inner=GRPOAssigner())
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_step_level_scalerl(mode):
    batch = step_batch()
    p, _ = STEP_SUMS[mode]
    mean, _ = STEP_P_STATS[mode]
    sq, n = STEP_BATCH_SQ[mode]
    std = math.sqrt(sq / n)
    adv = dict(zip(["p1", "p2", "p3"], [(x - mean) / (std + EPS) for x in p], strict=True))
    adv.update(zip(["q1", "q2"], [c / (std + EPS) for c in STEP_Q_CENTRED[mode]], strict=True))
    adv["s1"] = 0.0
    expected = {(r.id, s.index): adv[r.id] for r in batch for s in r.steps}
    got = compute(mode, batch, level="step", inner=ScaleRLAssigner())
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def spec_group_normalize(weights, rollouts):
    """The reward spec's ``_group_normalize``, transcribed: every step's weight of a group
    (rollouts grouped by ``meta["initial_obs"]``, else the first step's ``prev_obs``) pooled,
    ``(w - mean) / (std + 1e-8)`` with numpy's population std."""
    from collections import defaultdict

    groups = defaultdict(list)
    for r in rollouts:
        key = r.meta.get("initial_obs", r.steps[0].prev_obs)
        for step in r.steps:
            groups[key].append(((r.id, step.index), weights[(r.id, step.index)]))
    out = {}
    for items in groups.values():
        values = [v for _, v in items]
        mean = statistics.fmean(values)
        std = statistics.pstdev(values) + 1e-8
        out.update({k: (v - mean) / std for k, v in items})
    return out


@pytest.mark.parametrize("mode", MODES)
def test_step_level_grpo_pools_every_steps_weight_as_the_spec(mode):
    """The RM GRPO preset at step level normalises every step's combined reward within its
    group, as the spec's assigner does (not one return per rollout)."""
    batch = step_batch()
    combined = compute(mode, batch, level="step")  # per-step combined rewards, no inner
    want = spec_group_normalize(combined, batch)
    got = make_rm_grpo_assigner(None, mode, score_level="step", **KNOBS[mode]).compute(batch)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if abs(value) < 1e-6:  # an all-equal group: the spec's rounding noise, our exact 0
            assert abs(got[key]) < 1e-6, key
        else:
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # pool="rollout" (the sequence-level default) gives both steps of p1 one value
    rollout = make_rm_grpo_assigner(None, mode, score_level="step", pool="rollout",
                                    **KNOBS[mode]).compute(batch)
    assert rollout[("p1", 0)] == rollout[("p1", 1)]
    if combined[("p1", 0)] != combined[("p1", 1)]:
        assert got[("p1", 0)] != got[("p1", 1)]


def test_grpo_pool_is_checked():
    with pytest.raises(ValueError, match="pool must be one of"):
        GRPOAssigner(pool="token")


# -- the group assigners on their own -----------------------------------------------------------------


def test_grpo_on_env_rewards_by_hand():
    # group g: returns [1, 3, 5, 7, 9]... minus 5 -> dev [-4, -2, 0, 2, 4], var 40 / 5 = 8
    batch = [ro(f"g{i}", [float(x)], group="g") for i, x in enumerate([1, 3, 5, 7, 9])]
    got = GRPOAssigner(group_size=5).compute(batch)
    assert list(got.values()) == pytest.approx(z([1, 3, 5, 7, 9], 5, math.sqrt(8)))
    dr = GRPOAssigner(scale_by_std=False).compute(batch)  # Dr. GRPO: only centred
    assert list(dr.values()) == pytest.approx([-4, -2, 0, 2, 4])


def test_population_std_and_eps_1e8_are_used():
    # two rollouts 0 and 2: population std 1 (sample std would be sqrt 2); eps 1e-8
    got = GRPOAssigner().compute([ro("a", [0.0], group="g"), ro("b", [2.0], group="g")])
    assert got[("a", 0)] == -1 / (1 + 1e-8) and got[("b", 0)] == 1 / (1 + 1e-8)


def test_equal_rewards_give_exact_zero_where_float_noise_would_not():
    # 0.1 three times: fsum / 3 != 0.1 in floating point; (x - mean) / 1e-8 would be ~1e-9
    batch = [ro(f"r{i}", [0.1], group="g") for i in range(3)]
    for assigner in (GRPOAssigner(), ScaleRLAssigner()):
        assert set(assigner.compute(batch).values()) == {0.0}


def test_all_groups_without_spread_give_all_zero_in_scalerl():
    batch = [ro("a", [1.0], group="g"), ro("b", [4.0], group="h")]  # two groups of one
    assert ScaleRLAssigner().compute(batch) == {("a", 0): 0.0, ("b", 0): 0.0}


def test_group_key_callable_and_other_meta_key():
    batch = [ro("a", [0.0]), ro("b", [2.0]), ro("c", [5.0])]
    batch[0].meta["q"] = batch[1].meta["q"] = "x"
    batch[2].meta["q"] = "y"
    by_key = GRPOAssigner(group_key="q").compute(batch)
    by_fn = GRPOAssigner(group_key=lambda r: r.meta["q"]).compute(batch)
    assert by_key == by_fn == pytest.approx({("a", 0): -1.0, ("b", 0): 1.0, ("c", 0): 0.0})


def test_group_size_is_enforced_with_the_group_named():
    batch = [ro("a", [0.0], group="g"), ro("b", [1.0], group="g"), ro("c", [1.0], group="h")]
    with pytest.raises(ValueError, match=r"group_size=2 but 1 group\(s\) have another size \('h': 1\)"):
        make_rm_grpo_assigner(2, "replace").compute([
            ro(r.id, [0.0], rm=1.0, group=r.meta["initial_obs"]) for r in batch])
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        GRPOAssigner(0)


# -- NaN, missing scores and other bad input ----------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_raise_naming_the_rollout_and_step(bad):
    with pytest.raises(ValueError, match=r"rollout 'a': rollout.meta\['rm_score'\] is (nan|inf)"):
        RewardModelCreditAssigner().compute([ro("a", [1.0], rm=bad)])
    with pytest.raises(ValueError, match=r"rollout 'a' step 1: step.meta\['rm_score'\] is"):
        RewardModelCreditAssigner(score_level="step").compute(
            [ro("a", [1.0, 1.0], step_rm=[0.0, bad])])
    with pytest.raises(ValueError, match=r"rollout 'b' step 0: reward is"):
        make_rm_grpo_assigner(None, "add").compute(
            [ro("a", [1.0], rm=0.0, group="g"), ro("b", [bad], rm=0.0, group="g")])
    with pytest.raises(ValueError, match=r"rollout 'b' step 0: reward is"):
        GRPOAssigner().compute([ro("a", [1.0]), ro("b", [bad])])
    with pytest.raises(ValueError, match=r"rollout 'b' step 0: reward is"):
        ScaleRLAssigner().compute([ro("a", [1.0]), ro("b", [bad])])


def test_missing_and_multi_label_scores_raise_with_advice():
    with pytest.raises(ValueError, match=r"rollout 'b': no reward-model score in "
                                         r"rollout.meta\['rm_score'\]; score the rollouts first"):
        RewardModelCreditAssigner().compute([ro("a", [1.0], rm=1.0), ro("b", [1.0])])
    with pytest.raises(ValueError, match=r"step 0: no reward-model score in step.meta"):
        RewardModelCreditAssigner(score_level="step").compute([ro("a", [1.0], rm=1.0)])
    with pytest.raises(ValueError, match=r"list of 3 numbers.*aggregate="):
        RewardModelCreditAssigner().compute([ro("a", [1.0], rm=[0.1, 0.2, 0.3])])
    with pytest.raises(ValueError, match="must be a number, got bool"):
        RewardModelCreditAssigner().compute([ro("a", [1.0], rm=True)])
    # a verifier's boolean env reward is fine
    assert RewardModelCreditAssigner("add").compute([ro("a", [True], rm=0.5)]) == {("a", 0): 1.5}


def test_bad_batches_raise():
    with pytest.raises(ValueError, match="duplicate rollout id 'a'"):
        RewardModelCreditAssigner().compute([ro("a", [1.0], rm=1.0), ro("a", [1.0], rm=1.0)])
    with pytest.raises(ValueError, match="rollout 'a': has no steps"):
        RewardModelCreditAssigner().compute([Rollout("a", [], {"rm_score": 1.0})])
    with pytest.raises(ValueError, match=r"rollout 'a': duplicate step indices \[0\]"):
        RewardModelCreditAssigner().compute(
            [Rollout("a", [Step(0, "o", "x"), Step(0, "o", "y")], {"rm_score": 1.0})])
    with pytest.raises(ValueError, match="not hashable"):
        GRPOAssigner().compute([Rollout("a", [Step(0, ["a", "list"], "x")])])
    assert RewardModelCreditAssigner().compute([]) == {}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "sum"}, "unknown mode 'sum'"),
        ({"score_level": "token"}, "score_level must be one of"),
        ({"mode": "add", "rm_coeff": 2.0}, "rm_coeff=2.0 has no effect in mode 'add'"),
        ({"mode": "bonus", "alpha": 0.3}, "alpha=0.3 has no effect in mode 'bonus'"),
        ({"mode": "weighted", "alpha": 1.5}, r"alpha must be in \[0, 1\]"),
        ({"rm_coeff": float("nan")}, "rm_coeff is nan"),
        ({"rm_score_key": ""}, "rm_score_key must be a non-empty string"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardModelCreditAssigner(**kwargs)


def test_inner_assigner_contract_is_checked():
    class Forgetful:
        def compute(self, rollouts):
            return {(rollouts[0].id, 0): 1.0}

    with pytest.raises(ValueError, match=r"Forgetful.compute broke the CreditAssigner contract: "
                                         r"1 step\(s\) without a weight \[\('b', 0\)\]"):
        RewardModelCreditAssigner(inner_assigner=Forgetful()).compute(
            [ro("a", [1.0], rm=1.0), ro("b", [1.0], rm=1.0)])
    with pytest.raises(TypeError, match="inner_assigner must be a CreditAssigner"):
        RewardModelCreditAssigner(inner_assigner=object())


def test_compute_does_not_modify_the_rollouts_and_is_a_credit_assigner():
    batch = seq_batch()
    before = [(r.id, [s.reward for s in r.steps], dict(r.meta)) for r in batch]
    assigner = make_rm_scalerl_assigner(None, "weighted", alpha=0.25)
    assert isinstance(assigner, CreditAssigner)
    assert assigner.compute(batch) == assigner.compute(batch)
    assert [(r.id, [s.reward for s in r.steps], dict(r.meta)) for r in batch] == before


# -- properties ------------------------------------------------------------------------------------

finite_floats = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def grouped_rollouts(draw):
    n = draw(st.integers(1, 30))
    values = draw(st.lists(finite_floats, min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    return [ro(f"r{i}", [v], group=g) for i, (v, g) in enumerate(zip(values, groups, strict=True))]


def _by_group(batch, weights):
    out: dict = {}
    for r in batch:
        out.setdefault(r.meta["initial_obs"], []).append(weights[(r.id, 0)])
    return out


@settings(max_examples=100, deadline=None)
@given(grouped_rollouts())
def test_grpo_groups_have_mean_zero_and_unit_std_when_spread(batch):
    weights = GRPOAssigner().compute(batch)
    raw = _by_group(batch, {(r.id, 0): r.steps[0].reward for r in batch})
    for g, members in _by_group(batch, weights).items():
        # exact arithmetic gives 0; float64 rounds each (R - mean) by ~|R| * 1e-16, and the
        # division by a tiny spread magnifies that (values near 1e3 spread by 1e-4: ~1e-9)
        spread = statistics.pstdev(raw[g])
        rounding = 1e-12 * max(abs(v) for v in raw[g]) / (spread + 1e-8)
        assert abs(statistics.fmean(members)) < 1e-6 + rounding
        if statistics.pstdev(raw[g]) > 1e-3:
            assert statistics.pstdev(members) == pytest.approx(1.0, abs=1e-5)


@settings(max_examples=100, deadline=None)
@given(grouped_rollouts(), finite_floats, st.floats(0.01, 100))
def test_group_advantages_ignore_shift_and_positive_scale(batch, shift, scale):
    assume(all(statistics.pstdev(m) > 1e-3 or max(m) == min(m)
               for m in _by_group(batch, {(r.id, 0): r.steps[0].reward for r in batch}).values()))
    moved = [ro(r.id, [r.steps[0].reward * scale + shift], group=r.meta["initial_obs"])
             for r in batch]
    for assigner in (GRPOAssigner(eps=0.0), ScaleRLAssigner(eps=0.0)):
        a, b = assigner.compute(batch), assigner.compute(moved)
        assert list(b.values()) == pytest.approx(list(a.values()), abs=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.tuples(finite_floats, finite_floats), min_size=1,
                                         max_size=10))
def test_single_step_sequence_weights_match_the_mode_formula(mode, pairs):
    batch = [ro(f"r{i}", [e], rm=s) for i, (s, e) in enumerate(pairs)]
    got = compute(mode, batch)
    formula = {"replace": lambda s, e: s, "add": lambda s, e: e + s,
               "multiply": lambda s, e: e * s, "weighted": lambda s, e: 0.25 * e + 0.75 * s,
               "bonus": lambda s, e: e + 0.5 * s}[mode]
    assert list(got.values()) == pytest.approx([formula(s, e) for s, e in pairs])
