"""Tiny-model builder: loads back in transformers, tokenizer is a real BPE, bad shapes refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from weightsync.testing.tiny_models import (
    build_tiny_causal_lm,
    build_tiny_reward_model,
    build_tokenizer,
)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_reward_model_roundtrip(tmp_path, family):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = build_tiny_reward_model(tmp_path / family, family=family, num_labels=3, seed=1)
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["pad_token_id"] is not None and cfg["num_attention_heads"] == 2
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__.lower().startswith(family)
    assert model.config.num_labels == 3 and model.dtype == torch.float32
    ids = tok(["the model is helpful today.", "a policy was rude!"]).input_ids
    assert ids[0] != ids[1] and len(set(ids[0])) > 3  # a real tokenizer, not a constant map
    enc = tok(["hi", "the model is good"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


def test_seed_determinism_and_head_std(tmp_path):
    from safetensors.torch import load_file

    a = load_file(os.path.join(build_tiny_reward_model(tmp_path / "a", seed=3), "model.safetensors"))
    b = load_file(os.path.join(build_tiny_reward_model(tmp_path / "b", seed=3), "model.safetensors"))
    c = load_file(os.path.join(build_tiny_reward_model(tmp_path / "c", seed=3, head_std=1.0), "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert c["score.weight"].std() > 5 * a["score.weight"].std()


def test_causal_lm_tied(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_causal_lm(tmp_path / "lm", family="llama", tie_word_embeddings=True)
    m = AutoModelForCausalLM.from_pretrained(path)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_bad_shapes_refused(tmp_path):
    with pytest.raises(ValueError, match="head size 16"):
        build_tiny_reward_model(tmp_path / "x", hidden_size=64, num_heads=4)
    with pytest.raises(ValueError, match="family"):
        build_tiny_reward_model(tmp_path / "x", family="gpt2")
    with pytest.raises(ValueError, match="num_labels"):
        build_tiny_reward_model(tmp_path / "x", num_labels=0)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def test_tokenizer_shared_across_seeds(tmp_path):
    """Models of different seeds share one tokenizer (their weights are interchangeable)."""
    a = build_tiny_reward_model(tmp_path / "a", seed=0)
    b = build_tiny_reward_model(tmp_path / "b", seed=7)
    with open(os.path.join(a, "tokenizer.json")) as fa, open(os.path.join(b, "tokenizer.json")) as fb:
        assert fa.read() == fb.read()
