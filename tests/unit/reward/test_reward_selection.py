"""What one reward-model update carries: name normalisation, training-mode selection and checks
(``weightsync.reward.selection``), and the client's defaults. No server needed: every refusal
here happens before any request."""

from __future__ import annotations

import pytest

from weightsync.errors import WeightMismatchError, WeightSyncError
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


def test_client_defaults_and_local_refusals():
    from weightsync.reward.client import RewardModelClient, VLLMRewardClient

    c = VLLMRewardClient()
    assert (c.host, c.port, c.group_port, c.connection_timeout_s, c.enable_weight_updates,
            c.device, c.model_name) == ("127.0.0.1", 8001, None, 60.0, False, None, None)
    assert c.base_url == "http://127.0.0.1:8001" and isinstance(c, RewardModelClient)
    with pytest.raises(WeightSyncError, match="enable_weight_updates=True"):
        c.sync_weights(SD)
    assert VLLMRewardClient(device=0).strategy_cfg["backend"] == "nccl"  # an int is cuda:n
    assert VLLMRewardClient(device="cpu", group_port=51217).strategy_cfg == {
        "type": "broadcast", "backend": "gloo", "master_port": 51217, "master_addr": "127.0.0.1"}
    assert VLLMRewardClient(host="10.0.0.7", device="cuda:1").strategy_cfg == {
        "type": "broadcast", "backend": "nccl"}  # a remote server: the node's address, any port
    # a strategy given any way the front door takes one: a name, a preset, a whole preset mapping
    assert VLLMRewardClient(strategy="cuda_ipc", bucket_size_mb=8).strategy_cfg == {
        "type": "cuda_ipc", "bucket_size_mb": 8}
    assert VLLMRewardClient(strategy="broadcast_gloo").strategy_cfg["backend"] == "gloo"
    assert VLLMRewardClient(strategy={"strategy": {"type": "packed_cuda_ipc"}}).strategy_cfg == {
        "type": "packed_cuda_ipc"}
    on = VLLMRewardClient(enable_weight_updates=True, port=9)  # nothing listens on port 9
    with pytest.raises(WeightMismatchError, match="not a head parameter"):
        on.sync_weights({"model.norm.weight": SD["model.norm.weight"]}, training_mode="head_only")
    on.close_sync()
