"""``weightsync`` CLI: argument errors name the argument and list the valid values; ``demo`` and
``serve-reward`` (and ``bench``) hand their arguments to their modules' ``main(argv)``."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from weightsync import cli
from weightsync.bench import DEFAULT_STRATEGIES
from weightsync.bench import cli as bench_cli


def _error(capsys, argv):
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    return capsys.readouterr().err


def test_unknown_shape_lists_valid_shapes(capsys):
    err = _error(capsys, ["bench", "--shape", "gpt5"])
    assert "argument --shape: unknown shape 'gpt5'" in err
    for name in ("tiny", "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "llama3-8b", "many-small"):
        assert name in err


def test_unknown_strategy_lists_valid_strategies(capsys):
    err = _error(capsys, ["bench", "--strategy", "broadcast,telepathy"])
    assert "argument --strategy: unknown strategy telepathy" in err
    assert "valid: all, broadcast, cuda_ipc, packed_cuda_ipc, naive" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--backend", "mpi"], "argument --backend: unknown backend 'mpi'; valid: gloo, nccl"),
        (["--dtype", "int8"], "argument --dtype: unsupported dtype 'int8'"),
        (["--device", "tpu"], "argument --device: unknown device 'tpu'; valid: cpu, cuda"),
        (["--repeats", "0"], "argument --repeats: repeats must be >= 1"),
        (["--bucket-mb", "0"], "argument --bucket-mb: bucket_mb must be > 0"),
        (["--repeats", "two"], "argument --repeats: invalid int value: 'two'"),
        (["--backend", "nccl"], "argument --backend: backend nccl moves CUDA tensors"),
    ],
)
def test_bad_bench_arguments(capsys, argv, expected):
    assert expected in _error(capsys, ["bench", *argv])


def test_strategy_all_and_lists_parse():
    cfg = bench_cli.parse_args(["--shape", "tiny"])
    assert cfg.strategies == DEFAULT_STRATEGIES and cfg.shape == "tiny"
    assert cfg.skip_slow_naive  # 'all' skips the per-tensor row on shapes where it takes minutes
    assert not bench_cli.parse_args(["--strategy", "naive"]).skip_slow_naive
    cfg = bench_cli.parse_args(
        ["--strategy", "packed_cuda_ipc, cuda_ipc", "--bucket-mb", "64", "--dtype", "float32",
         "--repeats", "5", "--json", "out.json", "--backend", "gloo"]
    )
    assert cfg.strategies == ["packed_cuda_ipc", "cuda_ipc"]
    assert (cfg.bucket_mb, cfg.dtype, cfg.repeats, cfg.json_path, cfg.backend) == (
        64.0, "float32", 5, "out.json", "gloo"
    )
    assert not cfg.integrity and bench_cli.parse_args(["--integrity"]).integrity


def test_unknown_command_lists_commands(capsys):
    err = _error(capsys, ["benchmark"])
    assert ("unknown command 'benchmark'; valid commands: bench, demo, serve-reward, "
            "serve-policy, make-model") in err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "serve-reward", "serve-policy"])
def test_subcommands_hand_argv_to_their_main(monkeypatch, command):
    """The real ``weightsync.demo`` / ``weightsync.servers.reward`` start vLLM; a stand-in module
    records what the dispatcher passes (this tests the dispatch only)."""
    seen = []
    fake = types.ModuleType("weightsync_test_fake_entry")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(cli._SUBCOMMANDS, command, (fake.__name__, "main", "x"))
    assert cli.main([command, "--port", "8001", "--json", "x.json"]) == 7
    assert seen == [["--port", "8001", "--json", "x.json"]]


def test_missing_subcommand_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(cli._SUBCOMMANDS, "demo", ("weightsync.no_such_module", "main", "x"))
    with pytest.raises(SystemExit) as ei:
        cli.main(["demo"])
    assert "weightsync demo: module weightsync.no_such_module is missing" in str(ei.value.code)


def test_console_script_reports_bad_shape():
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "bench", "--shape", "nope"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown shape 'nope'; valid shapes: tiny" in proc.stderr


def _parsers():
    from weightsync.demo.cli import build_parser as demo_parser
    from weightsync.servers.policy import _our_parser
    from weightsync.servers.reward import build_parser as reward_parser
    from weightsync.testing.make_model import build_parser as make_model_parser

    return {"bench": bench_cli.build_parser(), "demo": demo_parser(),
            "serve-policy": _our_parser(for_help=True), "serve-reward": reward_parser(),
            "make-model": make_model_parser()}


@pytest.mark.parametrize("command", ["bench", "demo", "serve-policy", "serve-reward",
                                     "make-model"])
def test_every_flag_has_help_with_its_default(command):
    """``--help`` of each command: every flag explained, with its default (or 'required');
    a flag that takes a duration, a size or a length says its unit."""
    parser = _parsers()[command]
    flags = [a for a in parser._actions if a.option_strings and "-h" not in a.option_strings]
    assert len(flags) >= 5
    for a in flags:
        text = a.help or ""
        assert "default" in text or "required" in text, (command, a.option_strings, text)
        name = a.option_strings[-1]
        unit = next((u for suffix, u in (("-s", " s"), ("-bytes", "bytes"), ("-mb", "MB"),
                                         ("-len", "tokens")) if name.endswith(suffix)), None)
        if unit:
            assert unit in text, (command, name, text)
    if command == "serve-policy":
        assert any("--model" in a.option_strings for a in flags)  # vLLM's, listed with ours


def test_serve_policy_help_lists_model_and_vllm_defaults(capsys):
    from weightsync.servers.policy import parse_args

    with pytest.raises(SystemExit) as ei:
        parse_args(["--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "--model DIR" in out and "weightsync make-model --kind policy" in out
    assert "--update-timeout-s SECONDS" in out and "(default 600 s)" in out
    assert "default on CPU: float32" in out


def test_serve_policy_runs_prompt_logprobs_alone_by_default_only_for_lora_on_cpu():
    """``--prompt-logprobs-alone``: given, or ``auto`` (LoRA on vLLM's CPU build), as parsed."""
    from weightsync.servers.policy import _our_parser, prompt_logprobs_alone

    assert _our_parser().parse_args([]).prompt_logprobs_alone is None  # the config's "auto"
    assert _our_parser().parse_args(["--prompt-logprobs-alone", "on"]).prompt_logprobs_alone == "on"
    with pytest.raises(SystemExit):
        _our_parser().parse_args(["--prompt-logprobs-alone", "sometimes"])
    cases = {("auto", True, True): True, ("auto", True, False): False,
             ("auto", False, True): False, ("on", False, False): True, ("off", True, True): False}
    for (mode, lora, cpu), want in cases.items():
        assert prompt_logprobs_alone(mode, lora=lora, cpu=cpu) is want, (mode, lora, cpu)
    with pytest.raises(ValueError, match="prompt_logprobs_alone"):
        prompt_logprobs_alone("yes", lora=True, cpu=True)
