"""What one reward-model update carries: name normalisation, training-mode selection and checks
(``weightsync.reward.selection``). No server needed: every refusal here happens before any
request."""

from __future__ import annotations

import pytest

from weightsync.errors import WeightMismatchError
from weightsync.reward.selection import TrainingModeWarning, select_params

torch = pytest.importorskip("torch")

SD = {
    "model.embed_tokens.weight": torch.zeros(8, 4),
    "model.layers.10.mlp.up_proj.weight": torch.zeros(6, 4),
    "model.layers.2.mlp.up_proj.weight": torch.zeros(6, 4),
    "model.norm.weight": torch.ones(4),
    "score.weight": torch.ones(1, 4),
}


def names(named):
    return [n for n, _ in named]


def test_full_keeps_everything_in_natural_order():
    got = select_params(dict(reversed(list(SD.items()))), "full")
    assert names(got) == ["model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight",
                          "model.layers.10.mlp.up_proj.weight", "model.norm.weight",
                          "score.weight"]


@pytest.mark.parametrize("prefix", ["module.", "base_model.model.", "_fsdp_wrapped_module.",
                                    "_orig_mod."])
def test_training_wrapper_names_become_engine_names(prefix):
    wrapped = {prefix + n: t for n, t in SD.items()}
    assert names(select_params(wrapped, "full")) == names(select_params(SD, "full"))


def test_peft_names_base_layer_and_original_module_copy():
    sd = {"base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": torch.zeros(4, 4),
          "base_model.model.model.norm.weight": torch.ones(4),
          "base_model.model.score.original_module.weight": torch.zeros(1, 4),
          "base_model.model.score.modules_to_save.default.weight": torch.ones(1, 4)}
    got = select_params(sd, "lora")
    assert names(got) == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
                          "score.weight"]
    assert torch.equal(dict(got)["score.weight"], torch.ones(1, 4))  # the trained copy


def test_head_only_keeps_the_head_and_warns_with_what_it_dropped():
    with pytest.warns(TrainingModeWarning) as rec:
        got = select_params(SD, "head_only")
    assert names(got) == ["score.weight"]
    msg = str(rec[0].message)
    assert "kept the 1 head tensor(s)" in msg and "dropped 4 other(s)" in msg
    assert "model.embed_tokens.weight, model.layers.2.mlp.up_proj.weight" in msg
    # only the head given: no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert names(select_params({"score.weight": SD["score.weight"]}, "head_only")) == [
            "score.weight"]
    # custom head patterns
    with pytest.warns(TrainingModeWarning):
        assert names(select_params(SD, "head_only", ["re:^model\\.norm\\."])) == [
            "model.norm.weight"]


def test_refusals_name_the_offenders():
    with pytest.raises(WeightMismatchError, match="model.norm.weight: not a head parameter"):
        select_params({"model.norm.weight": SD["model.norm.weight"]}, "head_only")
    with pytest.raises(WeightMismatchError, match="full mode requires backbone"):
        select_params({"score.weight": SD["score.weight"]}, "full")
    with pytest.raises(WeightMismatchError, match="sends the merged backbone too"):
        select_params({"score.weight": SD["score.weight"]}, "lora")
    lora = {**SD, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight":
            torch.zeros(2, 4)}
    for mode in ("lora", "full", "head_only"):  # never dropped, whatever the mode
        with pytest.raises(WeightMismatchError, match=r"lora_A.default.weight: an unmerged LoRA "
                                                      r"tensor; publish the PEFT model itself"):
            select_params(lora, mode)
    with pytest.raises(ValueError, match="nothing to send"):
        select_params({}, "full")
    with pytest.raises(TypeError, match="'x' is a str, not a tensor"):
        select_params({"x": "y"}, "full")
    with pytest.raises(ValueError, match="training_mode must be one of"):
        select_params(SD, "partial")


def test_dtype_cast_and_engine_metadata():
    got = select_params(SD, "full", dtype=torch.bfloat16)
    assert {t.dtype for _, t in got} == {torch.bfloat16}
    expected = {n: {"dtype": "float32", "shape": list(t.shape)} for n, t in SD.items()}
    from weightsync.reward.selection import expected_metadata

    exp = expected_metadata(expected)
    assert len(select_params(SD, "full", expected=exp)) == 5
    del exp["model.norm.weight"]
    with pytest.raises(WeightMismatchError, match="model.norm.weight: not a parameter"):
        select_params(SD, "full", expected=exp)


# -- the reward spec's semantics --------------------------------------------------------------------


def test_spec_rewrites_model_model_and_bare_layers():
    """The spec's ``_transform_params``: ``model.model.`` loses one ``model.``, a bare
    ``layers.`` gains one (a wrapper holding the HF model as ``.model``; the inner model's own
    state dict), also under PEFT's prefix."""
    sd = {"model.model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4),
          "layers.1.mlp.up_proj.weight": torch.zeros(6, 4),
          "base_model.model.model.model.norm.weight": torch.ones(4),
          "score.weight": torch.ones(1, 4)}
    assert names(select_params(sd, "full")) == [
        "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight", "score.weight"]
    from weightsync.reward.selection import reference_name

    assert reference_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    clash = {"model.model.norm.weight": torch.ones(4), "model.norm.weight": torch.ones(4),
             "score.weight": torch.ones(1, 4)}
    with pytest.raises(WeightMismatchError, match="model.norm.weight: given twice"):
        select_params(clash, "full")


LORA_SD = {**SD, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight":
           torch.zeros(2, 4),
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight":
           torch.zeros(4, 2)}


@pytest.mark.parametrize("mode", ["full", "head_only"])
def test_unmerged_lora_skip_drops_them_with_a_warning_outside_lora(mode):
    with pytest.warns(TrainingModeWarning, match=r"skipped 2 unmerged LoRA tensor\(s\).*"
                                                 r"merge_and_unload"):
        got = select_params(LORA_SD, mode, unmerged_lora="skip", head_only_extra="drop")
    assert not [n for n in names(got) if "lora_" in n]
    assert "score.weight" in names(got)


def test_unmerged_lora_skip_keeps_them_in_lora_mode_where_the_engine_refuses_them():
    with pytest.raises(WeightMismatchError, match="lora_A.default.weight: an unmerged LoRA"):
        select_params(LORA_SD, "lora", unmerged_lora="skip")
    with pytest.raises(ValueError, match="unmerged_lora must be one of"):
        select_params(SD, "full", unmerged_lora="drop")


def test_lm_head_is_a_head_by_default():
    from weightsync.reward.publisher import RewardModelPublisher

    assert "lm_head." in RewardModelPublisher.DEFAULT_HEAD_PATTERNS
    sd = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(8, 4)}
    with pytest.warns(TrainingModeWarning):
        assert names(select_params(sd, "head_only")) == ["lm_head.weight"]


def test_head_only_extra_send_sends_the_backbone_as_a_full_update():
    from weightsync.reward.selection import effective_mode

    with pytest.warns(TrainingModeWarning, match=r"sent the 1 head tensor\(s\).*sent 4 "
                                                 r"other\(s\) as well \(a full update\)"):
        got = select_params(SD, "head_only", head_only_extra="send")
    assert names(got) == names(select_params(SD, "full"))
    assert effective_mode(names(got), "head_only") == "full"
    assert effective_mode(["score.weight"], "head_only") == "head_only"
    with pytest.raises(ValueError, match="head_only_extra must be one of"):
        select_params(SD, "head_only", head_only_extra="keep")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_full_or_lora_without_a_head_warns(mode):
    backbone = {n: t for n, t in SD.items() if not n.startswith("score.")}
    with pytest.warns(TrainingModeWarning, match=rf"training_mode={mode}: no head tensor"):
        assert len(select_params(backbone, mode)) == 4
