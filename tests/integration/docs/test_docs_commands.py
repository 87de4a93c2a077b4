"""Every command line in the README and the docs runs as written on this CPU machine, or is
listed here with the test that runs it, or with why CI cannot run it (a GPU, a hub model, many
minutes). A command line is what ``_markdown.command_lines`` finds: the lines of shell fences and
indented code blocks that start with a command.

- fast: every command line found is in ``COMMANDS`` and every entry is still in the docs; every
  ``weightsync`` command line parses with its subcommand's own parser (unknown flags, bad values
  and a config the demo would refuse fail here);
- slow: ``serve-policy`` command lines parse with vLLM's parser; the ``run`` entries run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _markdown import command_lines

ROOT = Path(__file__).resolve().parents[3]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
         "examples/README.md", "examples/reward_model/README.md"]

QUICKSTART = ("quickstart", "run as written, in order, by tests/integration/docs/"
                            "test_docs_quickstart.py (free ports instead of 8000 / 8001)")
GPU_QUICKSTART = ("not in CI", "needs a GPU: tests/gpu/test_docs_quickstart_gpu.py runs the "
                                "quickstart's GPU section as written (scripts/gpu_check.sh "
                                "first-hour; the install from staged wheels)")
TESTS = ("tests", "it is the test suite's own command (CI runs scripts/run_tests.sh, which "
                  "installs with scripts/install.sh)")
#: command line -> (how it is covered, why). ``run``: executed by this file; ``quickstart``: by
#: the quickstart test; ``covered``: the test named runs it (with its output paths); ``not in
#: CI``: why not (its arguments still parse here)
COMMANDS: dict[str, tuple[str, str]] = {
    "bash scripts/install.sh && weightsync demo": (
        "covered", "install: scripts/run_tests.sh runs it first; the demo: tests/integration/demo/"
                   "test_demo.py::test_demo_rlhf_reward_rises_and_both_versions_advance, as "
                   "written, in a clean clone"),
    "bash scripts/run_tests.sh": TESTS,
    "bash scripts/install.sh --gpu && weightsync demo --device cuda": GPU_QUICKSTART,
    "bash scripts/install.sh --gpu": GPU_QUICKSTART,
    "weightsync demo --device cuda --quiet": GPU_QUICKSTART,
    "weightsync make-model --kind reward models/tiny-reward": GPU_QUICKSTART,
    "weightsync serve-reward --model models/tiny-reward --port 8001 --max-model-len 512":
        GPU_QUICKSTART,
    "weightsync serve-policy --model models/tiny-policy --port 8000 --max-model-len 512":
        GPU_QUICKSTART,
    "bash scripts/skyrl_weight_sync_tests.sh": (
        "not in CI", "fetches SkyRL's own tests from GitHub (skyrl-train's PyPI packages do not "
                     "ship them) and pytest-asyncio from PyPI; the layer they test runs in "
                     "tests/unit/compat/test_skyrl.py and tests/integration/compat/"
                     "test_skyrl_processes.py"),
    "weightsync demo": (
        "covered", "tests/integration/demo/test_demo.py::"
                   "test_demo_rlhf_reward_rises_and_both_versions_advance, as written"),
    "weightsync demo --json result.json --plot rl.png": (
        "not in CI", "the default run above plus the two output paths (--json / --plot are "
                     "used by the other demo tests); 3 more minutes of 2 cores"),
    "weightsync demo --steps 20 --seed 1": (
        "not in CI", "the default run with twice the steps: about 5 minutes"),
    "weightsync demo --mode head_only": (
        "covered", "tests/integration/demo/test_demo.py::test_demo_head_only_gloo_broadcast "
                   "(plus --json and --workdir, to inspect the result)"),
    "weightsync demo --mode full --strategy packed_cuda_ipc": (
        "covered", "tests/integration/demo/test_demo.py::"
                   "test_demo_full_mode_through_shared_memory (plus --json and --workdir)"),
    "python -m weightsync.demo --help": ("run", "seconds"),
    "weightsync make-model --kind policy models/tiny-policy": QUICKSTART,
    "export WEIGHTSYNC_API_KEY=my-token": QUICKSTART,
    'weightsync serve-policy --model models/tiny-policy --port 8000 --api-key '
    '"$WEIGHTSYNC_API_KEY" --max-model-len 512': QUICKSTART,
    "export WEIGHTSYNC_URL=http://127.0.0.1:8000 WEIGHTSYNC_API_KEY=my-token "
    "WEIGHTSYNC_MODEL=models/tiny-policy": QUICKSTART,
    "python examples/chat.py": QUICKSTART,
    "python examples/push_to_server.py": QUICKSTART,
    "WEIGHTSYNC_URL=http://127.0.0.1:8001 python examples/push_to_server.py || true": QUICKSTART,
    "weightsync bench --shape tiny --quiet": QUICKSTART,
    'weightsync serve-policy --model Qwen/Qwen2.5-7B-Instruct --port 8000 --api-key '
    '"$WEIGHTSYNC_API_KEY" --tensor-parallel-size 2 --gpu-memory-utilization 0.85 '
    '--max-model-len 8192': (
        "not in CI", "GPU only (2 GPUs) and a hub model (CI has neither); its arguments parse "
                     "in test_serve_policy_command_lines_parse"),
    "weightsync bench --shape qwen2-0.5b --strategy all --device cpu --repeats 5 --json out.json": (
        "not in CI", "a 0.5B model through 6 strategies: about 10 minutes of 2 cores; the same "
                     "code runs on the tiny shape in tests/integration/bench/test_bench.py"),
    "weightsync bench --shape many-small --strategy all --device cpu --repeats 5 --json out.json": (
        "not in CI", "thousands of tensors through 6 strategies: minutes; the tiny shape runs "
                     "in tests/integration/bench/test_bench.py"),
    "weightsync bench --shape qwen2-0.5b --strategy broadcast,cuda_ipc,packed_cuda_ipc "
    "--integrity": (
        "not in CI", "a 0.5B model, 4 variants per row: minutes; --integrity on the tiny shape: "
                     "tests/integration/bench/test_bench.py::"
                     "test_bench_integrity_variants_alternate_and_stay_bit_exact"),
    "weightsync bench --shape qwen2-0.5b --strategy broadcast,cuda_ipc,packed_cuda_ipc "
    "--repeats 5 --quiet --json ...": (
        "not in CI", "a 0.5B model through 3 strategies at three commits, in turn: minutes; the "
                     "tiny shape runs in tests/integration/bench/test_bench.py"),
    "python benchmarks/bench_load_during_syncs.py --window-s 8 --rounds 5": (
        "not in CI", "two servers under load for minutes; the load test "
                     "(tests/integration/servers/test_servers_load_during_syncs.py) runs the "
                     "same code shorter"),
    "pytest tests/integration/servers/test_servers_trainer_killed.py "
    "tests/integration/servers/test_servers_load_during_syncs.py "
    "tests/integration/servers/test_servers_fuzz.py tests/integration/test_engine_faults.py": TESTS,
    "python benchmarks/bench_load_during_syncs.py --disturb killed-join --window-s 15 "
    "--rounds 3": (
        "not in CI", "two servers under load for about 4 minutes; the same disturbance "
                     "(weightsync.bench.dead_join) runs shorter in tests/integration/servers/"
                     "test_servers_trainer_killed.py::"
                     "test_a_trainer_killed_joining_holds_no_model_request"),
    "pytest tests/unit/test_update_sink.py tests/unit/test_config_timeouts.py "
    "tests/unit/test_engine_endpoint.py tests/unit/test_validation.py tests/unit/test_types.py "
    "tests/unit/loaders/test_vllm_worker.py tests/unit/servers/test_control_rendezvous.py":
        TESTS,
    "python examples/reward_loop/grpo_step.py": (
        "covered", "tests/integration/examples/test_examples_reward_loop.py::"
                   "test_grpo_step_combines_rule_and_model (against the session's servers)"),
    "weightsync serve-reward --model models/rm-as-causal-lm --convert classify --port 8001": (
        "covered", "tests/integration/reward_loop/test_router.py: its second server is the tiny "
                   "reward model relabelled as a causal LM, served with --convert classify on a "
                   "free port"),
}
HOW = {"run", "quickstart", "covered", "not in CI", "tests"}


def docs_command_lines() -> dict[str, list[str]]:
    """command line -> the pages it appears on."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for line in command_lines((ROOT / page).read_text()):
            found.setdefault(line, []).append(page)
    return found


def test_every_command_line_in_the_docs_is_run_or_listed_with_a_reason():
    found = docs_command_lines()
    unlisted = {c: pages for c, pages in found.items() if c not in COMMANDS}
    assert not unlisted, f"command lines in the docs that no test runs or lists: {unlisted}"
    gone = [c for c in COMMANDS if c not in found]
    assert not gone, f"listed here but no longer in the docs: {gone}"
    for command, (how, why) in COMMANDS.items():
        assert how in HOW and why, command


def _weightsync_argv(command: str) -> list[str] | None:
    """The argv after ``weightsync`` of a command line that runs weightsync, else None."""
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:1] == ["weightsync"]:
            return words[1:]
        if words[:3] == [sys.executable, "-m", "weightsync.demo"] or words[:3] == [
                "python", "-m", "weightsync.demo"]:
            return ["demo", *words[3:]]
    return None


def _parse(argv: list[str]) -> None:
    """Parse ``weightsync ARGV``'s arguments with the subcommand's own parser (nothing runs)."""
    command, rest = argv[0], argv[1:]
    if "--help" in rest:
        return  # runs in test_run_entries_run
    if command == "bench":
        from weightsync.bench.cli import parse_args

        parse_args(rest)
    elif command == "demo":
        from weightsync.demo.cli import apply_overrides, build_parser
        from weightsync.demo.config import load_demo_config

        args = build_parser().parse_args(rest)
        apply_overrides(load_demo_config(args.config), args)
    elif command == "make-model":
        from weightsync.testing.make_model import build_parser

        build_parser().parse_args(rest)
    elif command == "serve-reward":
        from weightsync.servers.reward import parse_args

        parse_args(rest)
    else:
        raise AssertionError(f"no parser check for weightsync {command}")


def test_weightsync_command_lines_parse():
    checked = 0
    for command in docs_command_lines():
        argv = _weightsync_argv(command)
        if argv is None or argv[0] == "serve-policy":
            continue
        _parse(argv)  # SystemExit(2) names the bad flag
        checked += 1
    assert checked >= 8


@pytest.mark.slow  # vLLM's argument parser
def test_serve_policy_command_lines_parse(monkeypatch):
    from weightsync.servers.policy import parse_args

    monkeypatch.setenv("WEIGHTSYNC_API_KEY", "my-token")
    lines = [c for c in docs_command_lines() if (_weightsync_argv(c) or [""])[0] == "serve-policy"]
    assert len(lines) == 3
    for command in lines:
        argv = [os.path.expandvars(a) for a in _weightsync_argv(command)[1:]]
        gpu = "--tensor-parallel-size" in argv
        cfg, args = parse_args(argv, device="cuda" if gpu else "cpu")
        assert cfg.api_key == "my-token" and args.max_model_len in (512, 8192)


@pytest.mark.slow
def test_run_entries_run(tmp_path):
    runs = [c for c, (how, _) in COMMANDS.items() if how == "run"]
    assert runs
    for command in runs:
        out = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, f"{command}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        assert "usage:" in out.stdout
