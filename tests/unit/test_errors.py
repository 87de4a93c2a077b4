"""``WeightMismatchError``'s message says what to do: tensors sent in another dtype than the
engine serves are summed up in one line that names ``push(..., dtype=...)``; the offenders keep
one line per tensor (the contract for code that reads them)."""

from __future__ import annotations

import pytest

from weightsync.errors import (
    EngineDiedError,
    EngineUnreachableError,
    WeightMismatchError,
    error_from_dict,
    error_to_dict,
    http_status,
    most_telling,
)


def test_a_whole_model_in_the_wrong_dtype_is_one_line_with_the_fix():
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(27)]
    err = WeightMismatchError([f"{n}: dtype bfloat16 but target has float32" for n in names],
                              target="vLLM model tiny")
    lines = str(err).splitlines()
    assert lines == [
        "27 parameter(s) do not match the vLLM model tiny; nothing was loaded:",
        "  27 tensors (model.layers.0.mlp.up_proj.weight, model.layers.1.mlp.up_proj.weight, "
        "model.layers.2.mlp.up_proj.weight, ...) are bfloat16 but the target holds float32; "
        "send float32: push(..., dtype=\"float32\") casts on the way",
    ]
    assert len(err.offenders) == 27  # still one offender per tensor
    # the same message after a trip over the wire (server -> client)
    again = error_from_dict(error_to_dict(err), engine="http://h:1")
    assert isinstance(again, WeightMismatchError) and str(again).splitlines()[1] == lines[1]


def test_other_offenders_keep_their_own_lines_next_to_the_dtype_summary():
    err = WeightMismatchError([
        "a: dtype float16 but target has float32",
        "b: shape [3] but target has [4]",
        "c: dtype bfloat16 but target has float32",
        "d: dtype bfloat16 but target has float32",
    ])
    assert str(err).splitlines()[1:] == [
        "  a: dtype float16 but target has float32; send float32: push(..., dtype=\"float32\") "
        "casts on the way",
        "  b: shape [3] but target has [4]",
        "  2 tensors (c, d) are bfloat16 but the target holds float32; send float32: "
        "push(..., dtype=\"float32\") casts on the way",
    ]


@pytest.mark.parametrize("cls", [EngineUnreachableError, EngineDiedError])
def test_an_unreachable_engine_is_not_a_dead_one(cls):
    err = cls("no engine at http://127.0.0.1:1")
    assert isinstance(err, EngineUnreachableError) == (cls is EngineUnreachableError)
    assert not isinstance(EngineUnreachableError("x"), EngineDiedError)
    back = error_from_dict(error_to_dict(err))
    assert type(back) is cls and http_status(err) == 502
    # it explains the collectives that broke on the other engines, as a dead engine does
    assert most_telling([TimeoutError("e0: slow"), err]) is err


def test_an_error_carried_as_text_comes_back_typed():
    """vLLM passes a worker's exception on as text (``collective_rpc``, its routes' JSON): the
    wire dict rides inside the message and the same typed error comes back out of it."""
    from weightsync.errors import error_from_text, error_to_text

    e = WeightMismatchError(["model.norm.weight: shape [3] but target has [64]"])
    text = f"RuntimeError: Worker failed with error '{error_to_text(e)}', please check the log"
    back = error_from_text(text, engine="vLLM engine", method="start_weight_update")
    assert isinstance(back, WeightMismatchError) and back.offenders == e.offenders
    assert error_from_text("RuntimeError: something else") is None


def test_tensors_sent_to_an_fp8_engine_are_told_to_quantise_not_to_cast():
    from weightsync.errors import WeightMismatchError

    e = WeightMismatchError([f"l{i}.weight: dtype bfloat16 but target has float8_e4m3fn"
                             for i in range(4)] + ["norm.weight: dtype float32 but target has "
                                                   "bfloat16"])
    text = str(e)
    assert "4 tensors (l0.weight, l1.weight, l2.weight, ...) are bfloat16 but the target " \
        "holds float8_e4m3fn; the engine serves FP8 weights: ws.connect(..., quantize=" in text
    assert 'dtype="float8_e4m3fn"' not in text
    assert 'norm.weight: dtype float32 but target has bfloat16; send bfloat16: push(..., ' \
        'dtype="bfloat16")' in text
