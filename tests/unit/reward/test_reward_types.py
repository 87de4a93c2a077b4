"""Reward types: validation names the field, wire round-trips, training-mode parsing."""

from __future__ import annotations

import json

import pytest

from weightsync.reward.types import (
    PoolingType,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    flatten_scores,
    is_head_param,
    non_head_params,
)


def test_training_mode_is_str_enum_and_parses():
    assert RewardModelTrainingMode.HEAD_ONLY == "head_only"
    assert RewardModelTrainingMode.parse("LORA") is RewardModelTrainingMode.LORA
    assert RewardModelTrainingMode.parse("head_only") is RewardModelTrainingMode.HEAD_ONLY
    assert RewardModelTrainingMode.parse(RewardModelTrainingMode.FULL) is RewardModelTrainingMode.FULL
    with pytest.raises(ValueError, match="training_mode must be one of"):
        RewardModelTrainingMode.parse("partial")
    with pytest.raises(ValueError, match="training_mode"):
        RewardModelTrainingMode.parse(3)


def test_pooling_type():
    assert PoolingType.parse("last") is PoolingType.LAST
    assert PoolingType.parse(" Step ") is PoolingType.STEP and PoolingType.STEP.wire == "step"
    assert PoolingType.LAST.is_sequence_level and not PoolingType.STEP.is_sequence_level
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingType.parse("max")


def test_head_patterns():
    assert is_head_param("score.weight")
    assert not is_head_param("model.layers.0.self_attn.q_proj.weight")
    assert non_head_params(["score.weight", "model.norm.weight"]) == ["model.norm.weight"]
    assert non_head_params(["v.w", "x.w"], patterns=["re:^v\\."]) == ["x.w"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": []}, "input: empty list"),
        ({"input": ["a", 3]}, "items must be strings"),
        ({"input": 5}, "input: must be a string or a list"),
        ({"input": "a", "use_activation": "yes"}, "use_activation"),
        ({"input": "a", "normalize": "yes"}, "normalize"),
        ({"input": "a", "normalize": True, "use_activation": False}, "disagree"),
        ({"input": "a", "pooling_type": "max"}, "pooling_type"),
        ({"input": "a", "return_hidden_states": 1}, "return_hidden_states"),
        ({"input": "a", "n_labels": 0}, "n_labels"),
        ({"input": "a", "step_tag": "<s>"}, "step_tag: only with pooling_type='step'"),
        ({"input": "a", "pooling_type": "step", "step_tag_id": -1}, "step_tag_id"),
        ({"input": "a", "pooling_type": "step", "step_tag": ""}, "step_tag"),
        ({"input": "a", "model": 1}, "model"),
        ({"input": "a", "temperature": 1}, "unknown field"),
        ({}, "input: missing"),
        ([1, 2], "JSON object"),
    ],
)
def test_scoring_request_rejects_bad_input(body, field):
    with pytest.raises(ValueError, match=field):
        ScoringRequest.from_dict(body)


def test_scoring_request_roundtrip():
    r = ScoringRequest(["a", "b"], normalize=False, model="rm")
    d = json.loads(json.dumps(r.to_dict()))
    assert d == {"input": ["a", "b"], "normalize": False, "model": "rm"}
    back = ScoringRequest.from_dict(d)
    assert back == r and back.texts == ["a", "b"] and len(back) == 2
    single = ScoringRequest("x")  # the design's default: the model's activation applied
    assert single.texts == ["x"] and single.to_dict()["normalize"] is True
    step = ScoringRequest(["a"], pooling_type="STEP", step_tag="<|step|>", n_labels=2)
    d = json.loads(json.dumps(step.to_dict()))
    assert d == {"input": ["a"], "normalize": True, "pooling_type": "step",
                 "step_tag": "<|step|>", "n_labels": 2}
    assert ScoringRequest.from_dict(d) == step and step.pooling_type is PoolingType.STEP


def test_scoring_request_speaks_the_designs_fields():
    """What the reward design's client sends parses, with the design's defaults."""
    spec = {"model": "reward-model", "input": ["a", "b"], "pooling_type": "last",
            "normalize": True}
    r = ScoringRequest.from_dict(spec)
    assert (r.model, r.texts, r.pooling_type, r.normalize) == (
        "reward-model", ["a", "b"], PoolingType.LAST, True)
    assert ScoringRequest.from_dict({"input": "a"}).normalize is True  # the design's default
    assert ScoringRequest.from_dict({"input": "a", "use_activation": False}).normalize is False
    assert ScoringRequest.from_dict({"input": "a", "return_hidden_states": False})


def test_scoring_response_roundtrip_one_and_many_labels():
    r1 = ScoringResponse([0.5, -1], version=3, prompt_tokens=7, model="m")
    d = json.loads(json.dumps(r1.to_dict()))
    assert d["data"] == [{"index": 0, "score": 0.5}, {"index": 1, "score": -1.0}]
    assert d["usage"] == {"prompt_tokens": 7} and d["version"] == 3
    assert ScoringResponse.from_dict(d) == r1 and r1.n_labels == 1
    r3 = ScoringResponse([[1, 2, 3], [4, 5, 6]], version=0)
    back = ScoringResponse.from_dict(json.loads(json.dumps(r3.to_dict())))
    assert back.scores == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]] and back.n_labels == 3
    assert flatten_scores(back.scores, label=2) == [3.0, 6.0]
    spec_answer = {"model": "m", "data": [{"score": 0.85, "index": 0}],
                   "usage": {"prompt_tokens": 3}, "version": 1}  # no pooling_type: sequence
    assert ScoringResponse.from_dict(spec_answer).pooling_type is PoolingType.LAST


def test_scoring_response_step_scores():
    r = ScoringResponse([[0.1, 0.2], [], [0.3]], version=2, pooling_type="step")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["pooling_type"] == "step" and d["data"][1] == {"index": 1, "score": []}
    back = ScoringResponse.from_dict(d)
    assert back == r and back.n_labels == 1
    r3 = ScoringResponse([[[1, 2, 3]], [[4, 5, 6], [7, 8, 9]]], version=0, pooling_type="step")
    assert r3.n_labels == 3 and r3.scores[1][1] == [7.0, 8.0, 9.0]
    with pytest.raises(ValueError, match="a list per text"):
        ScoringResponse([0.5], version=0, pooling_type="step")
    with pytest.raises(ValueError, match=r"scores\[0\]: mixes"):
        ScoringResponse([[0.5, [1.0]]], version=0, pooling_type="step")


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(scores=[1.0, [1.0]], version=0), "mixes"),
        (dict(scores=[[1.0], [1.0, 2.0]], version=0), "different"),
        (dict(scores=["a"], version=0), "expected a number"),
        (dict(scores=[1.0], version=-1), "version"),
        (dict(scores=[1.0], version=True), "version"),
    ],
)
def test_scoring_response_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ScoringResponse(**kwargs)


def test_scoring_response_from_dict_errors():
    with pytest.raises(ValueError, match="missing field 'version'"):
        ScoringResponse.from_dict({"data": []})
    with pytest.raises(ValueError, match="indices"):
        ScoringResponse.from_dict({"data": [{"index": 1, "score": 0.0}], "version": 0})


def test_training_mode_offenders():
    from weightsync.reward.types import training_mode_offenders

    backbone = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert training_mode_offenders(["score.weight"], "head_only") == []
    bad = training_mode_offenders(["score.weight", *backbone], "head_only")
    assert len(bad) == 2 and all("not a head parameter" in b for b in bad)
    assert training_mode_offenders(backbone + ["score.weight"], "full", whole_update=True) == []
    only_head = training_mode_offenders(["score.weight"], "full", whole_update=True)
    assert len(only_head) == 1 and "requires backbone" in only_head[0]
    assert training_mode_offenders(["score.weight"], "full") == []  # one chunk may be head-only
    lora = training_mode_offenders(["model.layers.0.self_attn.q_proj.lora_A.default.weight"], "lora")
    assert len(lora) == 1 and "unmerged LoRA" in lora[0]
    assert training_mode_offenders(["v_head.summary.weight"], "head_only") == []
    assert training_mode_offenders(["head.w"], "head_only", head_patterns=["re:^head\\."]) == []
