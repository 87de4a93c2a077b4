"""Metadata checks run before any byte moves (weightsync/validation.py, WeightLoader.validate)."""

from __future__ import annotations

import pytest

from weightsync.errors import WeightMismatchError
from weightsync.interfaces import WeightLoader
from weightsync.types import TensorMeta
from weightsync.validation import check_metadata, find_mismatches, size_offenders

EXPECTED = {
    m.name: m
    for m in [
        TensorMeta("model.embed_tokens.weight", "float32", [64, 16]),
        TensorMeta("model.layers.0.self_attn.q_proj.weight", "float32", [16, 16]),
        TensorMeta("model.layers.0.self_attn.q_proj.bias", "float32", [16]),
        TensorMeta("model.norm.weight", "float32", [16]),
        TensorMeta("score.weight", "float32", [1, 16]),
    ]
}


def test_matching_metadata_passes():
    check_metadata(list(EXPECTED.values()), EXPECTED)
    check_metadata([EXPECTED["score.weight"]], EXPECTED)  # a subset is fine (head-only update)
    assert find_mismatches(EXPECTED.values(), EXPECTED) == []


def test_every_offender_is_listed_with_its_problem():
    incoming = [
        TensorMeta("model.layers.0.self_attn.q_proj.weight", "float32", [16, 16]),  # fine
        TensorMeta("model.layers.0.self_attn.q_prj.weight", "float32", [16, 16]),  # typo
        TensorMeta("score.weight", "float32", [3, 16]),  # wrong shape
        TensorMeta("model.norm.weight", "bfloat16", [16]),  # wrong dtype
        TensorMeta("lora_A.weight", "float32", [4, 16]),  # unknown, nothing close
        TensorMeta("model.layers.0.self_attn.q_proj.bias", "float32", [16]),
        TensorMeta("model.layers.0.self_attn.q_proj.bias", "float32", [16]),  # sent twice
    ]
    with pytest.raises(WeightMismatchError) as e:
        check_metadata(incoming, EXPECTED, target="engine0")
    err = e.value
    assert isinstance(err, ValueError)  # callers may catch it as a ValueError too
    lines = err.offenders
    assert len(lines) == 5, lines
    joined = "\n".join(lines)
    assert (
        "model.layers.0.self_attn.q_prj.weight: not a parameter of the target "
        "(did you mean 'model.layers.0.self_attn.q_proj.weight'?)" in joined
    )
    assert "score.weight: shape [3, 16] but target has [1, 16]" in joined
    assert "model.norm.weight: dtype bfloat16 but target has float32" in joined
    assert "lora_A.weight: not a parameter of the target" in joined
    assert "lora_A.weight: not a parameter of the target (did you mean" not in joined
    assert "model.layers.0.self_attn.q_proj.bias: sent more than once in one update" in joined
    msg = str(err)
    assert msg.startswith("5 parameter(s) do not match the engine0; nothing was loaded")
    for line in lines:
        assert line in msg


def test_dtype_check_can_be_turned_off():
    incoming = [TensorMeta("model.norm.weight", "bfloat16", [16])]
    check_metadata(incoming, EXPECTED, check_dtype=False)
    with pytest.raises(WeightMismatchError):
        check_metadata(incoming, EXPECTED)


def test_no_expected_metadata_still_catches_duplicates():
    check_metadata([TensorMeta("anything", "float32", [1])], None)
    with pytest.raises(WeightMismatchError, match="x: sent more than once"):
        check_metadata([TensorMeta("x", "float32", [1])] * 2, None)


def test_long_offender_lists_are_truncated_in_the_message_but_kept_whole():
    incoming = [TensorMeta(f"extra.{i}.weight", "float32", [1]) for i in range(35)]
    with pytest.raises(WeightMismatchError) as e:
        check_metadata(incoming, EXPECTED)
    assert len(e.value.offenders) == 35
    assert "... and 15 more" in str(e.value)


class _Loader(WeightLoader):
    def __init__(self, expected):
        self._expected = expected

    async def load_weights(self, named_tensors):  # pragma: no cover - never reached here
        raise AssertionError("validation must run first")

    def expected_metadata(self):
        return self._expected


def test_loader_validate_uses_expected_metadata():
    _Loader(EXPECTED).validate([EXPECTED["score.weight"]])
    with pytest.raises(WeightMismatchError, match="score.weight: shape"):
        _Loader(EXPECTED).validate([TensorMeta("score.weight", "float32", [2, 16])])
    _Loader(None).validate([TensorMeta("whatever", "int8", [3])])  # unknown target: no check


def test_size_limits_bound_what_an_update_may_make_an_engine_allocate():
    """No tensor bigger than its target (a loader that casts would accept float64); a whole
    update (a start's manifest) no more tensors and no more bytes than the model; an unknown
    target has no limits."""
    whole = list(EXPECTED.values())
    assert size_offenders(whole, EXPECTED, whole_update=True) == []
    assert size_offenders([TensorMeta("model.norm.weight", "float16", [16])], EXPECTED) == []
    wide = TensorMeta("model.norm.weight", "float64", [16])
    assert size_offenders([wide], EXPECTED) == [
        "model.norm.weight: 128 bytes (float64[16]) but the target holds 64 (float32[16]); send "
        "the engine's dtype"]
    # an alias the loader accepts (e.g. a tied head's second name) can still not grow the update
    alias = TensorMeta("lm_head.weight", "float32", [64, 16])
    assert size_offenders([*whole, alias], EXPECTED, whole_update=True) == [
        "the update has 6 tensors but the model only 5",
        f"the update carries {sum(m.nbytes for m in whole) + alias.nbytes} bytes but the "
        f"model's parameters hold {sum(m.nbytes for m in whole)}"]
    assert size_offenders([*whole, alias], EXPECTED) == []  # per chunk: only per-tensor limits
    assert size_offenders([wide, alias], None, whole_update=True) == []
