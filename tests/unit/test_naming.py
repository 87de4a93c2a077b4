"""weightsync.naming: training names -> engine names, table-driven over Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch

from weightsync.naming import (
    NamingError,
    engine_named_tensors,
    engine_names,
    is_lora_param,
    strip_wrappers,
    tied_aliases,
    to_engine_name,
)

# (source name, expected engine name or None = not sent)
TABLE = [
    # plain HF
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("score.weight", "score.weight"),
    ("lm_head.weight", "lm_head.weight"),
    # PEFT
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
     "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
     "model.layers.0.self_attn.q_proj.bias"),
    ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("base_model.model.score.modules_to_save.default.weight", "score.weight"),
    ("base_model.model.score.original_module.weight", None),
    ("base_model.model.score.modules_to_save.other.weight", None),
    # FSDP1 / activation checkpointing / compile / DDP / DeepSpeed
    ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight",
     "model.layers.0.mlp.up_proj.weight"),
    ("model.layers.1._checkpoint_wrapped_module.self_attn.o_proj.weight",
     "model.layers.1.self_attn.o_proj.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("module.model.norm.weight", "model.norm.weight"),
    ("module.module.score.weight", "score.weight"),
    # everything at once
    ("module._orig_mod.base_model.model.model.layers.0._checkpoint_wrapped_module.mlp."
     "down_proj.base_layer.weight", "model.layers.0.mlp.down_proj.weight"),
    # a name that merely contains "module" inside is untouched
    ("model.submodule.weight", "model.submodule.weight"),
    ("model.module.weight", "model.module.weight"),
]


@pytest.mark.parametrize(("src", "dst"), TABLE)
def test_to_engine_name_table(src: str, dst: str | None) -> None:
    assert to_engine_name(src) == dst


LORA = [
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
    "base_model.model.model.embed_tokens.lora_embedding_A.default",
    "base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector.default.weight",
    "_fsdp_wrapped_module.model.layers.0.mlp.up_proj.lora_A.default.weight",
]


@pytest.mark.parametrize("name", LORA)
def test_lora_tensors_are_refused(name: str) -> None:
    assert is_lora_param(name)
    with pytest.raises(NamingError, match="unmerged adapter"):
        to_engine_name(name)


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "score.weight", "model.lora.weight",
             "model.flora_A.weight"]
)
def test_non_lora_names(name: str) -> None:
    assert not is_lora_param(name)


def test_strip_wrappers_keeps_single_component() -> None:
    assert strip_wrappers("module") == "module"


def test_engine_names_lists_every_offender() -> None:
    with pytest.raises(NamingError) as e:
        engine_names(LORA[:2] + ["score.weight"])
    assert "lora_A" in str(e.value) and "lora_B" in str(e.value)
    with pytest.raises(NamingError, match="both map to 'score.weight'"):
        engine_names(["score.weight", "module.score.weight"])


def _tiny(family: str, kind: str, tie: bool):
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=97, pad_token_id=0,
                  num_labels=3, tie_word_embeddings=tie)
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    model_cls = getattr(transformers, f"{prefix}For{kind}")
    torch.manual_seed(0)
    return model_cls(cfg_cls(**common))


FAMILIES = [
    (f, k, t)
    for f in ("llama", "qwen2")
    for k, t in (("CausalLM", True), ("CausalLM", False), ("SequenceClassification", False))
]


@pytest.mark.parametrize(("family", "kind", "tie"), FAMILIES)
def test_real_models_round_trip_through_peft(family: str, kind: str, tie: bool) -> None:
    """Every non-adapter name of a PEFT-wrapped model maps to the plain model's name; tied
    lm_head is sent once under the embedding name."""
    import peft

    model = _tiny(family, kind, tie)
    plain = dict(model.named_parameters(remove_duplicate=False))
    expected = set(plain) - ({"lm_head.weight"} if tie else set())
    assert set(dict(engine_named_tensors(list(plain.items())))) == expected

    task = "CAUSAL_LM" if kind == "CausalLM" else "SEQ_CLS"
    pm = peft.get_peft_model(
        model, peft.LoraConfig(task_type=task, r=2, target_modules="all-linear")
    )
    named = list(pm.named_parameters(remove_duplicate=False))
    non_lora = [(n, t) for n, t in named if not is_lora_param(n)]
    got = dict(engine_named_tensors(non_lora))
    assert set(got) == expected
    if tie:
        assert "model.embed_tokens.weight" in got and "lm_head.weight" not in got
    if kind == "SequenceClassification":
        # the trained head copy is the one sent
        trained = dict(named)["base_model.model.score.modules_to_save.default.weight"]
        assert got["score.weight"] is trained
    with pytest.raises(NamingError, match="unmerged"):
        list(engine_named_tensors(named))


def test_tied_aliases_prefer_embedding_even_when_head_comes_first() -> None:
    w = torch.zeros(4, 2)
    named = [("lm_head.weight", w), ("model.embed_tokens.weight", w), ("x.weight", torch.ones(1))]
    assert tied_aliases(named) == {"lm_head.weight": "model.embed_tokens.weight"}
    out = list(engine_named_tensors(named))
    assert [n for n, _ in out] == ["model.embed_tokens.weight", "x.weight"]


def test_views_of_one_storage_are_not_tied() -> None:
    base = torch.zeros(8)
    named = [("a", base[:4]), ("b", base[4:])]
    assert tied_aliases(named) == {}
