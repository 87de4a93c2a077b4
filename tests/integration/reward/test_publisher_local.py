"""``RewardModelPublisher`` streaming through a strategy (``comm``) into a real engine process.

One ``LocalEngineProcess`` (a module with the tiny reward model's engine names) and one
publisher with ``comm = broadcast/gloo`` for the module; the publisher is driven through
the blocking ``publish`` (its own loop). Checked: FULL, HEAD_ONLY and LORA land exactly what the mode
says (digests vs the model / PEFT's merge), versions rise; every bad input is refused before any
byte moves (engine version and digests unchanged); explicit params travel in one deterministic
order; rank rules.
"""

from __future__ import annotations

import copy

import pytest
import torch

from weightsync.errors import WeightMismatchError
from weightsync.reward.publisher import RewardModelPublisher, create_reward_publisher
from weightsync.reward.types import RewardModelTrainingMode as Mode

pytestmark = pytest.mark.slow


def _model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                   num_labels=1, pad_token_id=0)
    return transformers.Qwen2ForSequenceClassification(cfg)


def _peft(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj", "up_proj"]))


def _train(model, steps: int = 2, seed: int = 0) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1, 128, (4, 10), generator=g)
        loss = ((model(input_ids=ids).logits - torch.randn(4, 1, generator=g)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _digest(t) -> str:
    from weightsync.digest import tensor_digest

    return tensor_digest(t)


@pytest.fixture(scope="module")
def rig():
    from weightsync.clients import FanOutClient
    from weightsync.local import LocalEngineProcess

    base = _model()
    metas = [{"name": n, "dtype": "float32", "shape": list(t.shape)}
             for n, t in base.state_dict().items()]
    engine = LocalEngineProcess.spawn("weightsync.local.modules:metas_module",
                                      {"metas": metas, "fill": "zeros"}, name="publisher-engine",
                                      num_threads=1)
    client = FanOutClient([engine], timeout_s=60)
    pub = RewardModelPublisher(client, {"type": "broadcast", "backend": "gloo", "timeout_s": 60},
                               src_rank=0, rank=0, bucket_size_mb=0.05, timeout_s=60)

    def state():
        digests = pub._run(engine.call("state_digest"))
        version = pub._run(engine.call("get_version"))
        return version, {n: d["digest"] for n, d in digests.items()}

    try:
        yield {"engine": engine, "pub": pub, "state": state, "base": base}
    finally:
        try:
            pub.close_sync()
        finally:
            engine.stop()


def test_each_mode_lands_what_it_says(rig) -> None:
    pub, state = rig["pub"], rig["state"]
    model = copy.deepcopy(rig["base"])

    stats = pub.publish(model, 1, training_mode=Mode.FULL)
    version, got = state()
    assert version == 1 and stats.versions == [1]
    assert got == {n: _digest(t) for n, t in model.state_dict().items()}

    _train(model, seed=1)  # everything moved; a head-only update sends only the head
    stats = pub.publish(model, 2, training_mode="head_only")
    assert stats.num_tensors == 1
    version, got2 = state()
    assert version == 2
    assert got2["score.weight"] == _digest(model.score.weight)
    assert {n: d for n, d in got2.items() if n != "score.weight"} == {
        n: d for n, d in got.items() if n != "score.weight"}

    peft_model = _peft(model)
    _train(peft_model, seed=2)
    stats = pub.publish(peft_model, 3, training_mode=Mode.LORA)
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    version, got3 = state()
    assert version == 3
    assert got3 == {n: _digest(t) for n, t in merged.items()}
    assert got3["score.weight"] != got2["score.weight"]  # the modules_to_save head was trained


def test_bad_input_is_refused_before_any_byte_moves(rig) -> None:
    pub, state = rig["pub"], rig["state"]
    before = state()
    model = copy.deepcopy(rig["base"])
    sd = model.state_dict()
    peft_model = _peft(copy.deepcopy(model))
    cases = {
        "head_only without a head": (
            lambda: pub.publish({"model.norm.weight": sd["model.norm.weight"]},
                                training_mode=Mode.HEAD_ONLY),
            "model.norm.weight: not a head parameter"),
        "full without backbone": (
            lambda: pub.publish({"score.weight": sd["score.weight"]}, training_mode="full"),
            "full mode requires backbone weights"),
        "lora without backbone": (
            lambda: pub.publish({"score.weight": sd["score.weight"]}, training_mode="lora"),
            "sends the merged backbone too"),
        "unmerged lora tensors": (
            lambda: pub.publish(dict(peft_model.state_dict()), training_mode="lora"),
            "lora_A.default.weight: an unmerged LoRA tensor"),
        "unknown name (engine refuses the manifest)": (
            lambda: pub.publish({**sd, "model.layers.7.mlp.up_proj.weight": sd[
                "model.layers.0.mlp.up_proj.weight"]}, training_mode="full"),
            "model.layers.7.mlp.up_proj.weight: not a parameter of the target"),
        "lora mode on a model without adapters": (
            lambda: pub.publish(model, training_mode="lora"), "no active LoRA adapter"),
        "full mode on a model with adapters": (
            lambda: pub.publish(peft_model, training_mode="full"),
            "has active LoRA adapters"),
    }
    for what, (call, needle) in cases.items():
        with pytest.raises(WeightMismatchError) as e:
            call()
        assert needle in str(e.value), (what, str(e.value))
        assert state() == before, f"{what}: the engine changed"


def test_head_only_state_dict_keeps_the_head_and_warns(rig) -> None:
    from weightsync.reward.selection import TrainingModeWarning

    pub, state = rig["pub"], rig["state"]
    version, before = state()
    model = copy.deepcopy(rig["base"])
    _train(model, seed=9)
    sd = {f"_fsdp_wrapped_module.{n}": t for n, t in model.state_dict().items()}
    with pytest.warns(TrainingModeWarning, match=r"kept the 1 head tensor\(s\)"):
        stats = pub.publish(sd, training_mode=Mode.HEAD_ONLY)
    assert stats.num_tensors == 1
    version2, got = state()
    assert version2 == version + 1 and got["score.weight"] == _digest(model.score.weight)
    assert {n: d for n, d in got.items() if n != "score.weight"} == {
        n: d for n, d in before.items() if n != "score.weight"}


def test_unknown_names_refused_locally_with_engine_metadata(rig) -> None:
    model = copy.deepcopy(rig["base"])
    metas = [{"name": n, "dtype": "float32", "shape": list(t.shape)}
             for n, t in model.state_dict().items() if "layers.1." not in n]
    pub = RewardModelPublisher(None, None, rank=0, engine_metadata=metas)  # nothing to send to
    with pytest.raises(WeightMismatchError) as e:
        pub.metadata(model, "full")
    assert len(e.value.offenders) == len([n for n in model.state_dict() if "layers.1." in n])
    wrong = {n: {"dtype": "float32", "shape": list(t.shape)} for n, t in model.state_dict().items()}
    wrong["score.weight"]["shape"] = [2, 64]
    with pytest.raises(WeightMismatchError, match=r"score.weight: shape \[1, 64\] but target"):
        RewardModelPublisher(None, rank=0, engine_metadata=wrong).metadata(model, "head_only")


def test_explicit_params_travel_in_one_order() -> None:
    sd = _model().state_dict()
    names = list(sd)
    pub = RewardModelPublisher(None, rank=0)
    a = [m.name for m in pub.metadata(dict(reversed(list(sd.items()))), "full")]
    b = [m.name for m in pub.metadata({n: sd[n] for n in sorted(names)}, "full")]
    prefixed = {f"module.{n}": t for n, t in sd.items()}  # wrapper prefixes are normalised
    c = [m.name for m in pub.metadata(prefixed, "full")]
    assert a == b == c and sorted(a) == sorted(names)
    big = {f"model.layers.{i}.w": torch.zeros(1) for i in (10, 2, 1)}
    assert [m.name for m in pub.metadata(big, "full")] == [
        "model.layers.1.w", "model.layers.2.w", "model.layers.10.w"]


def test_rank_rules() -> None:
    model = _model()
    # a non-sending rank of an unsharded model does nothing (no control needed at all)
    assert RewardModelPublisher(None, src_rank=0, rank=1).publish(
        model, training_mode="full") is None
    assert create_reward_publisher(None, rank0_only=True, rank=3).publish(
        model.state_dict(), training_mode="full") is None
    with pytest.raises(ValueError, match="rank0_only=True needs src_rank=0"):
        RewardModelPublisher(None, src_rank=1, rank0_only=True)
