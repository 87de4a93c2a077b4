"""Command line of ``weightsync demo``, the main job.

Entry points: ``weightsync demo [...]`` (the ``weightsync`` dispatcher calls ``main(argv)``) and
``python -m weightsync.demo [...]``. Runs on CPU with nothing downloaded.

``--mode rlhf`` (default): the RLHF loop of ``weightsync.demo.rlhf`` (``run_rlhf``): a reward
model trained on judge-labelled preference pairs and pushed to the reward server, then RL
steps in which the policy served by ``weightsync serve-policy`` samples groups of completions,
the reward server scores them, ``make_grpo_with_rm`` assigns credit, the trainer takes a few
policy-gradient steps on its copy and pushes it back. Both servers start at once, as
subprocesses. A progress bar per step, a summary table, a PNG of mean reward and sync time per
step and the JSON record (``{"steps": [{"step", "mean_reward", "sync_seconds",
"policy_version", "rm_version", ...}], ...}``), both written to ``--out DIR`` (default
``results/``, which git ignores) unless ``--plot PATH`` / ``--json PATH`` say where (the PNG is
skipped with a note without matplotlib, or with ``--no-plot``).

``--mode head_only`` / ``full`` (``head-only`` too): one train -> sync -> score cycle of the
reward model alone (``weightsync.demo.run``): train its head (or all of it) on synthetic
preferences, publish through the configured strategy, check served scores == transformers.

Exit code 0 when every check holds, 1 when one fails or the run breaks, 2 for bad arguments,
130 on Ctrl-C; the record is written on failure too. Every server subprocess is stopped on every
path (normal exit, exception, Ctrl-C, SIGTERM/SIGHUP, interpreter exit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from weightsync.demo.config import (
    DEMO_MODES,
    STRATEGY_PRESETS,
    DemoConfig,
    load_demo_config,
    strategy_from_name,
)
from weightsync.demo.report import Progress, format_table
from weightsync.demo.run import DemoResult, run_demo, strategy_label

DEFAULT_OUT = "results"  # relative to the current directory; the repository's .gitignore has it
PLOT_NAME = "weightsync-demo.png"
RECORD_NAME = "weightsync-demo.json"

# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightsync demo",
        description=(
            "RLHF with tiny models, on CPU or GPU: train a reward model, push it to a vLLM reward "
            "server, then sample from a vLLM policy server, score, assign GRPO credit, update "
            "the policy and push it back, step after step (--mode rlhf, the default). "
            "--mode head_only | full: one train -> sync -> score cycle of the reward model."
        ),
    )
    d = load_demo_config()
    p.add_argument("--config", metavar="YAML",
                   help="demo YAML (default: the shipped demo preset, weightsync/configs/demo.yaml)")
    p.add_argument(
        "--strategy",
        help="broadcast (gloo) | packed_cuda_ipc | cuda_ipc | broadcast_nccl | a strategy YAML | "
        f"any registered strategy type (default: the preset's, {strategy_label(d.strategy)})",
    )
    p.add_argument("--mode", type=_mode, metavar="{rlhf,head_only,full}",
                   help="rlhf: the RLHF loop; head_only / full: one reward-model cycle (default "
                        f"{d.mode})")
    p.add_argument("--family", choices=("qwen2", "llama"),
                   help=f"tiny reward model family (default {d.model.family})")
    p.add_argument("--steps", type=int,
                   help=f"rlhf: RL steps (default {d.rlhf.steps}); head_only: optimizer steps "
                        f"(default {d.train.steps}); full: optimizer steps (default "
                        f"{d.train.full_steps})")
    p.add_argument("--seed", type=int, help=f"seed for models and data (default {d.model.seed})")
    p.add_argument("--num-eval", type=int,
                   help=f"head_only / full: held-out preference pairs (default {d.data.num_eval})")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="trainer device; the servers run on a GPU whenever one is visible "
                        "(with cuda and no --strategy: cuda_ipc into servers on the trainer's "
                        "GPU, or broadcast over NCCL into servers on GPU 1 when two are "
                        f"visible) (default {d.train.device})")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help=f"folder for the PNG ({PLOT_NAME}) and the JSON record ({RECORD_NAME}), "
                        f"created if missing (default ./{DEFAULT_OUT}, which git ignores)")
    p.add_argument("--json", dest="json_path", metavar="PATH",
                   help=f"write the result record here instead (default DIR/{RECORD_NAME})")
    p.add_argument("--plot", metavar="PATH",
                   help=f"rlhf: write the PNG here instead (default DIR/{PLOT_NAME}; needs "
                        "matplotlib, the 'demo' extra)")
    p.add_argument("--no-plot", action="store_true", help="rlhf: no PNG (default: a PNG)")
    p.add_argument("--workdir", metavar="DIR",
                   help="keep models, server logs and vLLM caches here (default: a temp dir, "
                        "removed at the end)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines, only the summary (default: progress lines)")
    return p


def _mode(value: str) -> str:
    mode = value.replace("-", "_")
    if mode not in DEMO_MODES:
        raise argparse.ArgumentTypeError(f"{value!r}; choose one of {', '.join(DEMO_MODES)}")
    return mode


def apply_overrides(cfg: DemoConfig, args: argparse.Namespace) -> DemoConfig:
    if args.strategy:
        cfg.strategy = strategy_from_name(args.strategy)
    if args.mode:
        cfg.mode = args.mode
    if args.family:
        cfg.model.family = args.family
    if args.steps is not None:
        if cfg.mode == "rlhf":
            cfg.rlhf.steps = args.steps
        elif cfg.mode == "full":
            cfg.train.full_steps = args.steps
        else:
            cfg.train.steps = args.steps
    if args.seed is not None:
        cfg.model.seed = cfg.data.seed = cfg.policy.seed = cfg.rlhf.seed = args.seed
    if args.num_eval is not None:
        cfg.data.num_eval = args.num_eval
    if args.device:
        cfg.train.device = args.device
        if args.device == "cuda" and not args.strategy and cfg.strategy == STRATEGY_PRESETS["broadcast"]:
            # gloo is the CPU default: CUDA IPC on one GPU, NCCL into a second one
            from weightsync.demo.placement import default_gpu_strategy, visible_gpus

            cfg.strategy = default_gpu_strategy(visible_gpus())
    cfg.validate()
    return cfg


def summary_table(r: DemoResult) -> str:
    rows = [
        ("strategy", r.strategy),
        ("training mode", r.mode),
        ("held-out pairs", r.num_eval_pairs),
        ("train steps / seconds", f"{r.train_steps} / {r.train_seconds:.2f}"),
        ("train loss first -> last", f"{r.train_loss_first:.4f} -> {r.train_loss_last:.4f}"),
        ("tensors / bytes synced", f"{r.num_tensors_synced} / {r.bytes_synced:,}"),
        ("sync seconds", f"{r.sync_seconds:.4f}"),
        ("server version", f"{r.version_before} -> {r.version_after}"),
        ("pairwise accuracy (served)", f"{r.accuracy_before:.3f} -> {r.accuracy_after:.3f}"),
        ("max |served - transformers| before", f"{r.max_abs_err_before:.2e}"),
        ("max |served - transformers| after", f"{r.max_abs_err_vs_hf:.2e}"),
        ("server ready at", f"{r.server_ready_seconds:.1f} s"),
        ("total", f"{r.total_seconds:.1f} s"),
        ("result", "PASS" if r.passed else "FAIL: " + "; ".join(r.failures)),
    ]
    return format_table(("metric", "value"), rows)


def rlhf_tables(r: Any) -> str:
    """The per-step table and the summary of an RLHF run."""
    steps = format_table(
        ("step", "mean reward", "judge", "sync ms", "policy v", "rm v", "logprob gap", "step s"),
        [(s.step, round(s.mean_reward, 4), round(s.judge_score, 2),
          round(1e3 * s.sync_seconds, 1), s.policy_version, s.rm_version, s.logprob_gap,
          round(s.step_seconds, 2)) for s in r.steps],
    )
    syncs = [s.sync_seconds for s in r.steps]
    rows = [
        ("strategy", r.strategy),
        ("steps x prompts x group", f"{r.num_steps} x {r.prompts_per_step} x {r.group_size}"),
        ("reward model: pairs / seconds", f"{r.rm_train_pairs} / {r.rm_train_seconds:.1f}"),
        ("reward model accuracy (held-out, served)",
         f"{r.rm_accuracy:.3f} / {r.rm_served_accuracy:.3f}"),
        ("max |served - transformers| (reward)", f"{r.rm_max_abs_err_vs_hf:.2e}"),
        ("reward server version", f"{r.rm_version_before} -> {r.rm_version_after}"),
        ("policy server version", f"{r.policy_version_before} -> {r.policy_version_after}"),
        ("mean reward first -> last 2 steps", f"{r.reward_first:+.3f} -> {r.reward_last:+.3f}"),
        ("judge score first -> last 2 steps", f"{r.judge_first:.2f} -> {r.judge_last:.2f}"),
        ("policy sync ms (mean / max)",
         f"{1e3 * sum(syncs) / max(len(syncs), 1):.1f} / {1e3 * max(syncs, default=0):.1f}"),
        ("servers ready at", f"{r.servers_ready_seconds:.1f} s"),
        ("total", f"{r.total_seconds:.1f} s"),
        ("plot", r.plot_path or r.plot_note or "-"),
        ("result", "PASS" if r.passed else "FAIL: " + "; ".join(r.failures)),
    ]
    return steps + "\n\n" + format_table(("metric", "value"), rows)


def main(argv: list[str] | None = None) -> int:
    """``weightsync demo`` -> exit code (0 pass, 1 check failed or run broke, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = apply_overrides(load_demo_config(args.config), args)
    except (ValueError, FileNotFoundError) as e:
        print(f"weightsync demo: {e}", file=sys.stderr)
        return 2
    progress = Progress(quiet=args.quiet)
    progress(f"weightsync demo: mode {cfg.mode}, strategy {strategy_label(cfg.strategy)}")
    result: Any
    if cfg.mode == "rlhf":
        from weightsync.demo.rlhf import RLHFResult, run_rlhf

        result = RLHFResult(strategy=strategy_label(cfg.strategy),
                            strategy_config=dict(cfg.strategy))
        plot = None if args.no_plot else (args.plot or os.path.join(args.out, PLOT_NAME))
        if plot:
            os.makedirs(os.path.dirname(plot) or ".", exist_ok=True)

        def run() -> None:
            run_rlhf(cfg, progress=progress, workdir=args.workdir, result=result, plot_path=plot)

        def table() -> str:
            return rlhf_tables(result)
    else:
        result = DemoResult.for_config(cfg)

        def run() -> None:
            run_demo(cfg, progress=progress, workdir=args.workdir, result=result)

        def table() -> str:
            return summary_table(result)
    code = 0
    try:
        run()
    except KeyboardInterrupt:
        print("weightsync demo: interrupted", file=sys.stderr)
        result.failures.append("interrupted")
        code = 130
    except SystemExit as e:  # SIGTERM / SIGHUP (see weightsync.testing.servers.signals_raise_system_exit); the server is down
        code = e.code if isinstance(e.code, int) and e.code else 1
        print(f"weightsync demo: terminated (exit {code})", file=sys.stderr)
        result.failures.append(f"terminated by a signal (exit {code})")
    except Exception as e:  # a broken run: say what broke, no traceback wall for users
        print(f"weightsync demo: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        result.failures.append(f"run broke: {type(e).__name__}: {e}"[:2000])
        if os.environ.get("WEIGHTSYNC_DEBUG"):
            raise
        code = 1
    else:
        print()
        print(table())
        code = 0 if result.passed else 1
    json_path = args.json_path or os.path.join(args.out, RECORD_NAME)
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result.to_dict(), f, indent=2)
    print(f"\nwrote {json_path}")
    return code

