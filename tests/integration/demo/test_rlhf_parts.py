"""The RLHF demo's trainer-side parts, without servers: the toy task, the policy trainer, the
checks, the record and the plot. Fast (tiny models, a few seconds); the end-to-end run with
both servers is ``test_demo.py::test_demo_rlhf_reward_rises_and_both_versions_advance``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from weightsync.demo.config import DemoConfig
from weightsync.demo.policy import PolicyTrainer, Sample
from weightsync.demo.rlhf import RLHFResult, StepRecord, check
from weightsync.demo.task import LetterTask, scoring_text
from weightsync.testing.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("rlhf-parts") / "policy", family="llama")


def test_task_judge_pairs_and_determinism(tok):
    task = LetterTask(tok, letter="e", completion_tokens=8)
    assert task.judge("bee tree") == 4 and task.judge("xyz") == 0
    assert 0.1 < task.token_fraction < 0.4  # a fifth or so of the vocabulary has an "e"
    pairs = task.pairs(40, seed=3)
    assert pairs == task.pairs(40, seed=3) != task.pairs(40, seed=4)
    for p in pairs:
        assert p.chosen.startswith(p.prompt + "\n") and p.rejected.startswith(p.prompt + "\n")
        chosen, rejected = (t[len(p.prompt) + 1:] for t in (p.chosen, p.rejected))
        assert task.judge(chosen) > task.judge(rejected)
    # the pairs span the counts a policy can reach, from none to nearly every token
    counts = [task.judge(p.chosen[len(p.prompt) + 1:]) for p in pairs]
    assert min(counts) <= 3 and max(counts) >= 8
    assert scoring_text("P", "c") == "P\nc" and scoring_text("P", "") == "P"
    with pytest.raises(ValueError, match="letter"):
        LetterTask(tok, letter="ee")


def _samples(tok, n=4, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = f"Prompt number {i}:"
        ids = tok(prompt).input_ids
        comp = [rng.randrange(4, len(tok)) for _ in range(5 + i)]  # lengths differ: masks
        out.append(Sample(prompt, ids, tok.decode(comp), comp, [], 0))
    return out


def test_policy_logprobs_equal_a_plain_forward_per_sample(policy_dir, tok):
    trainer = PolicyTrainer(policy_dir, lr=1e-2)
    samples = _samples(tok)
    with torch.no_grad():
        lp, mask = trainer.logprobs(samples)
    assert lp.shape == mask.shape == (4, 8) and mask.sum(-1).tolist() == [5, 6, 7, 8]
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = trainer.model(ids).logits[0]
        ref = torch.log_softmax(logits, -1)[
            torch.arange(len(s.prompt_ids) - 1, ids.shape[1] - 1), s.completion_ids]
        assert torch.allclose(lp[i, : len(ref)], ref, atol=1e-5)
        assert (lp[i, len(ref):] == 0).all()


def test_policy_update_raises_the_advantaged_samples_logprob(policy_dir, tok):
    from weightsync.reward.presets import make_grpo_with_rm

    trainer = PolicyTrainer(policy_dir, lr=1e-2)
    samples = _samples(tok)
    with torch.no_grad():
        before = trainer.logprobs(samples)[0].sum(-1)
    first, last = trainer.update(samples, [1.0, -1.0, 1.0, -1.0],
                                 make_grpo_with_rm(group_size=4).loss, epochs=3)
    with torch.no_grad():
        after = trainer.logprobs(samples)[0].sum(-1)
    assert last < first
    delta = (after - before).tolist()
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0, delta
    served = [Sample(s.prompt, s.prompt_ids, s.completion, s.completion_ids,
                     trainer.logprobs([s])[0][0, : len(s.completion_ids)].tolist(), 1)
              for s in samples]
    assert trainer.max_logprob_gap(served) < 1e-5
    with pytest.raises(RuntimeError, match="no log-probability per token"):
        trainer.max_logprob_gap(samples)  # no served log-probabilities at all


def _result(rewards, *, policy=None, rm=(0, 1), gap=1e-6):
    r = RLHFResult(strategy="broadcast/gloo", strategy_config={"type": "broadcast"})
    r.rm_version_before, r.rm_version_after = rm
    r.policy_version_before = 0
    r.rm_max_abs_err_vs_hf = 1e-6
    policy = policy or list(range(1, len(rewards) + 1))
    r.steps = [StepRecord(step=i, mean_reward=x, sync_seconds=0.01, policy_version=v,
                          rm_version=rm[1], sampled_version=v - 1, judge_score=float(i),
                          logprob_gap=gap) for i, (x, v) in enumerate(zip(rewards, policy, strict=True))]
    r.policy_version_after = policy[-1]
    return r


def test_checks_name_what_went_wrong():
    cfg = DemoConfig()
    cfg.rlhf.steps = 4
    ok = _result([-1.0, 0.0, 2.0, 3.0])
    check(cfg, ok)
    assert ok.failures == [] and (ok.reward_first, ok.reward_last) == (-0.5, 2.5)
    flat = _result([1.0, 1.0, 1.1, 1.0])
    check(cfg, flat)
    assert any("did not rise" in f for f in flat.failures)
    stuck = _result([-1.0, 0.0, 2.0, 3.0], policy=[1, 2, 2, 3], rm=(0, 0), gap=0.5)
    check(cfg, stuck)
    text = " ".join(stuck.failures)
    assert "policy versions [1, 2, 2, 3]" in text and "reward model version went 0 -> 0" in text
    assert "log-probabilities differ" in text


def test_record_is_strict_json_with_the_step_fields():
    r = _result([-1.0, 2.0])
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert set(d["steps"][0]) >= {"step", "mean_reward", "sync_seconds", "policy_version",
                                  "rm_version"}
    assert d["steps"][0]["reward_std"] is None and d["passed"] is True


def test_plot_png_or_a_clear_note(tmp_path, monkeypatch):
    from weightsync.demo import plot

    steps = [{"step": i, "mean_reward": float(i), "sync_seconds": 0.01 * (i + 1),
              "judge_score": 2.0 * i} for i in range(4)]
    if plot.matplotlib_missing() is None:
        path = plot.plot_steps(steps, str(tmp_path / "p.png"), title="t")
        assert path and Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # without matplotlib (a missing package cannot be caused for real here: the import is
    # blocked for this test): no file, and the note says how to get it
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert "pip install 'weightsync[demo]'" in plot.matplotlib_missing()
    assert plot.plot_steps(steps, str(tmp_path / "q.png")) is None
    assert not (tmp_path / "q.png").exists()
