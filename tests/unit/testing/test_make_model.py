"""``weightsync make-model``: writes a tiny policy / reward model that transformers loads, with a
chat template; says what it wrote and how to serve it; refuses to overwrite; no DeepSpeed
warning (the policy run as a user would: a fresh process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def make_model(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    return subprocess.run([sys.executable, "-m", "weightsync.cli", "make-model", *args],
                          capture_output=True, text=True, timeout=180, env=env)


def test_policy_model_with_a_chat_template(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_model("--kind", "policy", str(tmp_path / "policy"))
    assert out.returncode == 0, out.stderr
    assert "Setting accelerator" not in out.stderr and "Writing model shards" not in out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"wrote a causal LM (*ForCausalLM) to "
                               f"{tmp_path / 'policy'}: qwen2, hidden 64, 2 layers")
    assert lines[1] == (f"serve it: weightsync serve-policy --model {tmp_path / 'policy'} "
                        f"--max-model-len 512")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert model.config.max_position_embeddings == 512 and model.dtype == torch.float32
    assert not model.config.tie_word_embeddings  # greedy answers then follow the weights
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "user: Hello\nassistant:"


def test_reward_model(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from weightsync.testing.make_model import main

    assert main(["--kind", "reward", "--family", "llama", "--num-labels", "2",
                 str(tmp_path / "rm")]) == 0
    assert "serve it: weightsync serve-reward --model" in capsys.readouterr().out
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.num_labels == 2


def test_refusals_exit_2_naming_the_argument(tmp_path, capsys):
    from weightsync.testing.make_model import main

    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text("{}")
    for args, needle in [
        (["--kind", "reward", str(tmp_path / "rm")], "already holds a model (config.json); "
                                                      "choose another DIR or pass --force"),
        (["--kind", "policy", "--num-labels", "3", str(tmp_path / "x")],
         "--num-labels: only for --kind reward"),
        (["--kind", "critic", str(tmp_path / "x")], "invalid choice: 'critic'"),
        (["--kind", "policy", "--hidden-size", "32", str(tmp_path / "x")], "head size 16"),
    ]:
        with pytest.raises(SystemExit) as ei:
            main(args)
        assert ei.value.code == 2
        assert needle in capsys.readouterr().err
