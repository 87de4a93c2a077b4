"""The demo's trainer-side parts, without a server: data, Bradley-Terry training, config, CLI args.

Fast (a few seconds, one tiny model built per module); the end-to-end run is test_demo.py.
"""

from __future__ import annotations

import json

import pytest

from weightsync.demo import data as dd


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from weightsync.testing.tiny_models import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("demo-parts") / "m")


def test_pairs_are_deterministic_and_disjoint():
    a = dd.make_preference_split(num_train=50, num_eval=20, seed=3)
    b = dd.make_preference_split(num_train=50, num_eval=20, seed=3)
    assert a == b
    assert len(a.train) == 50 and len(a.eval) == 20
    assert not set(a.train) & set(a.eval)
    assert a != dd.make_preference_split(num_train=50, num_eval=20, seed=4)
    for p in a.eval:
        assert p.chosen.rsplit(" ", 1)[1] in dd.POSITIVE_WORDS
        assert p.rejected.rsplit(" ", 1)[1] in dd.NEGATIVE_WORDS
        assert p.chosen_text().startswith(f"Question: {p.prompt}\nAnswer: ")


def test_pairwise_accuracy_counts_ties_half_and_rejects_bad_input():
    assert dd.pairwise_accuracy([1.0, 0.0, 2.0, 5.0], [0.0, 1.0, 2.0, 4.0]) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="equally long"):
        dd.pairwise_accuracy([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-empty"):
        dd.pairwise_accuracy([], [])
    with pytest.raises(ValueError, match="n must be >= 1"):
        dd.make_pairs(0)


def test_last_tokens_of_chosen_and_rejected_differ(tiny_model_dir):
    """What makes the preference learnable by a last-token head: the final token differs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    last_pos = {tok(f"x {w}")["input_ids"][-1] for w in dd.POSITIVE_WORDS}
    last_neg = {tok(f"x {w}")["input_ids"][-1] for w in dd.NEGATIVE_WORDS}
    assert not last_pos & last_neg


def test_features_reproduce_the_transformers_forward(tiny_model_dir):
    import torch

    from weightsync.demo import train as dt

    model, tok = dt.load_reward_model(tiny_model_dir)
    texts = dd.pair_texts(dd.make_pairs(12, seed=1))[0]
    feats = dt.pooled_features(model, tok, texts, batch_size=5)  # padding inside batches
    ref = torch.tensor(dt.hf_scores(model, tok, texts, batch_size=12))
    assert torch.allclose((feats @ model.score.weight.T)[:, 0], ref, atol=1e-5)


def test_head_training_lifts_accuracy_and_touches_only_the_head(tiny_model_dir):
    import torch

    from weightsync.demo import train as dt

    torch.set_num_threads(1)
    model, tok = dt.load_reward_model(tiny_model_dir)
    before = {n: p.clone() for n, p in model.named_parameters()}
    split = dd.make_preference_split(num_train=128, num_eval=32, seed=0)
    ec, er = dd.pair_texts(split.eval)
    s = dt.hf_scores(model, tok, ec + er)
    acc0 = dd.pairwise_accuracy(s[:32], s[32:])
    tc, tr = dd.pair_texts(split.train)
    res = dt.train_head(
        model, dt.pooled_features(model, tok, tc), dt.pooled_features(model, tok, tr), steps=200
    )
    assert res.trained == ["score.weight"] and res.loss_last < res.loss_first
    s = dt.hf_scores(model, tok, ec + er)
    acc1 = dd.pairwise_accuracy(s[:32], s[32:])
    assert acc1 > acc0 and acc1 >= 0.9
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == ["score.weight"]
    assert not any(p.requires_grad for p in model.parameters())
    assert list(dt.head_params(model)) == ["score.weight"]


def test_train_head_rejects_mismatched_features(tiny_model_dir):
    import torch

    from weightsync.demo import train as dt

    model, _ = dt.load_reward_model(tiny_model_dir)
    with pytest.raises(ValueError, match="chosen features"):
        dt.train_head(model, torch.zeros(4, 64), torch.zeros(3, 64), steps=1)


def test_demo_config_defaults_match_yaml_and_overrides_apply(tmp_path):
    from weightsync import demo
    from weightsync.config import preset_path
    from weightsync.demo.config import DemoConfig, load_demo_config

    assert load_demo_config(preset_path("demo")) == DemoConfig() == load_demo_config()
    assert DemoConfig().mode == "rlhf"  # the main job is the RLHF loop
    args = demo.build_parser().parse_args(
        ["--strategy", "packed_cuda_ipc", "--mode", "full", "--steps", "7", "--seed", "5"]
    )
    cfg = demo.apply_overrides(load_demo_config(), args)
    assert cfg.strategy == {"type": "packed_cuda_ipc"}
    assert cfg.mode == "full" and cfg.train.full_steps == 7 and cfg.train.steps == 300
    assert cfg.model.seed == cfg.data.seed == cfg.policy.seed == cfg.rlhf.seed == 5
    rlhf = demo.apply_overrides(load_demo_config(), demo.build_parser().parse_args(
        ["--steps", "3"]))
    assert rlhf.mode == "rlhf" and rlhf.rlhf.steps == 3 and rlhf.train.steps == 300
    dashed = demo.build_parser().parse_args(["--mode", "head-only"])
    assert demo.apply_overrides(load_demo_config(), dashed).mode == "head_only"
    assert demo.strategy_label(DemoConfig().strategy) == "broadcast/gloo"
    cuda = demo.apply_overrides(load_demo_config(), demo.build_parser().parse_args(["--device", "cuda"]))
    # fewer than two GPUs (none here): CUDA IPC into servers on the trainer's GPU
    assert cuda.strategy == {"type": "cuda_ipc"} and cuda.train.device == "cuda"


def test_demo_bad_config_and_args_exit_2_naming_the_problem(tmp_path, capsys):
    from weightsync import demo

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    assert demo.main(["--config", str(bad)]) == 2
    assert "stepz" in capsys.readouterr().err
    bad.write_text("trainer: {}\n")
    assert demo.main(["--config", str(bad)]) == 2
    assert "trainer" in capsys.readouterr().err
    assert demo.main(["--strategy", "carrier_pigeon"]) == 2
    err = capsys.readouterr().err
    assert "carrier_pigeon" in err and "packed_cuda_ipc" in err
    with pytest.raises(SystemExit):
        demo.main(["--mode", "sideways"])
    bad.write_text("rlhf:\n  group_size: 1\n")
    assert demo.main(["--config", str(bad)]) == 2
    assert "rlhf.group_size must be >= 2" in capsys.readouterr().err
    bad.write_text("rlhf:\n  prompts_per_step: 99\n")
    assert demo.main(["--config", str(bad)]) == 2
    assert "prompts_per_step" in capsys.readouterr().err


def test_result_record_is_strict_json():
    from weightsync.demo import DemoResult

    r = DemoResult(strategy="broadcast/gloo", strategy_config={"type": "broadcast"}, mode="head_only")
    text = json.dumps(r.to_dict(), allow_nan=False)
    d = json.loads(text)
    for key in ("strategy", "sync_seconds", "bytes_synced", "version_before", "version_after",
                "accuracy_before", "accuracy_after", "max_abs_err_vs_hf"):
        assert key in d
    assert d["sync_seconds"] is None and d["passed"] is True
