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
    r = ScoringRequest(["a", "b"], use_activation=True, model="rm")
    d = json.loads(json.dumps(r.to_dict()))
    assert d == {"input": ["a", "b"], "use_activation": True, "model": "rm"}
    back = ScoringRequest.from_dict(d)
    assert back == r and back.texts == ["a", "b"] and len(back) == 2
    single = ScoringRequest("x")
    assert single.texts == ["x"] and single.to_dict()["use_activation"] is False


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
