"""Reward types: validation names the field, wire round-trips, training-mode parsing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from weightsync.reward.types import (
    PoolingType,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
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


def test_pooling_type_values_are_the_plans():
    assert PoolingType("last") is PoolingType.LAST and PoolingType.LAST.value == "last"
    assert [m.value for m in PoolingType] == ["last", "mean", "cls", "all", "step"]
    assert PoolingType.LAST == "last"  # a str enum: compares with the plain spelling
    assert PoolingType.parse(" Step ") is PoolingType.STEP and PoolingType.STEP.vllm_name == "STEP"
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
        ({"input": None}, "input: missing"),
        ({"input": "a", "temperature": 1}, "unknown field"),
        ({}, "input: missing"),
        ([1, 2], "JSON object"),
    ],
)
def test_scoring_request_rejects_bad_input(body, field):
    with pytest.raises(ValueError, match=field):
        ScoringRequest.from_dict(body)


def test_scoring_request_roundtrip():
    r = ScoringRequest("rm", ["a", "b"], normalize=False)  # the plan's order: model, inputs
    d = json.loads(json.dumps(r.to_dict()))
    assert d == {"input": ["a", "b"], "normalize": False, "model": "rm", "pooling_type": "last"}
    back = ScoringRequest.from_dict(d)
    assert back == r and back.texts == ["a", "b"] and len(back) == 2
    single = ScoringRequest(inputs="x")  # the design's defaults: activation, last-token pooling
    assert single.texts == ["x"] and single.to_dict() == {
        "input": "x", "normalize": True, "pooling_type": "last"}
    step = ScoringRequest(inputs=["a"], pooling_type="STEP", step_tag="<|step|>", n_labels=2)
    d = json.loads(json.dumps(step.to_dict()))
    assert d == {"input": ["a"], "normalize": True, "pooling_type": "step",
                 "step_tag": "<|step|>", "n_labels": 2}
    assert ScoringRequest.from_dict(d) == step and step.pooling_type is PoolingType.STEP
    # a wire request without pooling_type asks for the server's own pooling
    assert ScoringRequest.from_dict({"input": "a"}).pooling_type is None
    with pytest.raises(ValueError, match="model: must be a string"):
        ScoringRequest(["a"])  # texts where the plan puts the model: named, not guessed
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.normalize = True  # frozen, as the spec and plan declare it


def test_scoring_request_has_the_references_fields_and_defaults():
    """The plan's fields, order and defaults, plus the spec's ``return_hidden_states``."""
    fields = [(f.name, f.default) for f in dataclasses.fields(ScoringRequest)]
    assert fields[:6] == [("model", None), ("inputs", None), ("pooling_type", PoolingType.LAST),
                          ("normalize", True), ("n_labels", 1), ("return_hidden_states", False)]
    spec = {"model": "reward-model", "input": ["a", "b"], "pooling_type": "last",
            "normalize": True}  # what the reference client sends
    r = ScoringRequest.from_dict(spec)
    assert (r.model, r.texts, r.pooling_type, r.normalize, r.n_labels) == (
        "reward-model", ["a", "b"], PoolingType.LAST, True, 1)
    assert ScoringRequest.from_dict({"input": "a"}).normalize is True
    assert ScoringRequest.from_dict({"input": "a", "use_activation": False}).normalize is False
    assert ScoringRequest.from_dict({"input": "a", "return_hidden_states": True}).return_hidden_states
    assert ScoringRequest(inputs="a").checked_labels() is None  # 1: any model, as the reference
    assert ScoringRequest(inputs="a", n_labels=3).checked_labels() == 3


def test_scoring_response_as_the_spec_builds_it():
    """A fake client in a test builds ``ScoringResponse(scores=[...])``; the plan reads
    ``results``, ``model`` and ``usage``."""
    r = ScoringResponse(scores=[0.5, 0.25])
    assert (r.hidden_states, r.metadata, r.version) == (None, {}, None)
    assert r.results == [ScoringResult(0.5, 0), ScoringResult(0.25, 1)]
    spec = ScoringResponse(scores=[0.85], hidden_states=None,
                           metadata={"model": "rm", "usage": {"prompt_tokens": 3}})
    assert (spec.model, spec.usage) == ("rm", {"prompt_tokens": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.scores = []


def test_scoring_response_roundtrip_one_and_many_labels():
    r1 = ScoringResponse([0.5, -1], version=3, metadata={"model": "m",
                                                         "usage": {"prompt_tokens": 7}})
    d = json.loads(json.dumps(r1.to_dict()))
    assert d["data"] == [{"index": 0, "score": 0.5}, {"index": 1, "score": -1.0}]
    assert d["usage"] == {"prompt_tokens": 7} and d["version"] == 3 and d["model"] == "m"
    assert ScoringResponse.from_dict(d) == r1 and r1.n_labels == 1
    r3 = ScoringResponse([[1, 2, 3], [4, 5, 6]], version=0)
    back = ScoringResponse.from_dict(json.loads(json.dumps(r3.to_dict())))
    assert back.scores == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]] and back.n_labels == 3
    assert flatten_scores(back.scores, label=2) == [3.0, 6.0]
    # the reference server's answer: no version, no pooling_type
    spec_answer = {"model": "m", "data": [{"score": 0.85, "index": 0}],
                   "usage": {"prompt_tokens": 3}}
    got = ScoringResponse.from_dict(spec_answer)
    assert got.pooling_type is PoolingType.LAST and got.version is None
    assert got.metadata == {"model": "m", "usage": {"prompt_tokens": 3}}


def test_scoring_response_step_scores():
    r = ScoringResponse([[0.1, 0.2], [], [0.3]], version=2, pooling_type="step")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["pooling_type"] == "step" and d["data"][1] == {"index": 1, "score": []}
    back = ScoringResponse.from_dict(d)
    assert back.scores == r.scores and back.version == 2 and back.n_labels == 1
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
    with pytest.raises(ValueError, match="missing field 'data'"):
        ScoringResponse.from_dict({"version": 0})
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


def test_scoring_response_in_the_plans_results_form_equals_the_specs():
    from weightsync.reward.types import ScoringResult

    spec = ScoringResponse([0.25, 0.5], metadata={"model": "rm", "usage": {"prompt_tokens": 7}})
    plan = ScoringResponse(results=[ScoringResult(0.5, 1), ScoringResult(0.25, 0)], model="rm",
                           usage={"prompt_tokens": 7})
    positional = ScoringResponse([ScoringResult(0.25, 0), ScoringResult(0.5, 1)], "rm",
                                 {"prompt_tokens": 7})
    assert spec == plan == positional
    assert plan.scores == [0.25, 0.5] and plan.model == "rm" and plan.usage == {"prompt_tokens": 7}
    assert plan.results == [ScoringResult(0.25, 0), ScoringResult(0.5, 1)]
    assert ScoringResponse(results=[ScoringResult(1.0)]) == ScoringResponse([1.0])
    with pytest.raises(ValueError, match="not both"):
        ScoringResponse([1.0], results=[ScoringResult(1.0)])
    with pytest.raises(ValueError, match="indices must be 0..n-1"):
        ScoringResponse(results=[ScoringResult(1.0, 3)])
    with pytest.raises(ValueError, match="model: 'a' but metadata"):
        ScoringResponse([1.0], metadata={"model": "b"}, model="a")
