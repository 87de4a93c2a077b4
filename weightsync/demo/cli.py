"""Command line of ``weightsync demo``: one real train -> sync -> score cycle on a vLLM-served
reward model.

Entry points: ``weightsync demo [...]`` (the ``weightsync`` dispatcher calls ``main(argv)``) and
``python -m weightsync.demo [...]``. Runs on CPU with nothing downloaded, in about a minute:

1. build a tiny ``Qwen2ForSequenceClassification`` (random weights, offline tokenizer) in a
   temp dir;
2. start the reward server on it as a real subprocess (``weightsync.servers.reward``, vLLM) on a
   free port; it boots while the trainer works;
3. build a synthetic preference set (``weightsync.demo.data``), take the transformers reference
   scores of the held-out pairs, and train the head in this process with the Bradley-Terry loss
   (``--mode head_only``: only ``score.weight``; ``--mode full``: a short full fine-tune);
4. once the server is healthy, score the held-out pairs through it (pairwise accuracy before,
   and served == transformers for the untouched model);
5. publish the new weights through the configured strategy (``VLLMRewardClient.sync_weights``:
   gloo broadcast by default, ``--strategy packed_cuda_ipc`` for shared memory);
6. score again: served scores must equal transformers' for the trained model (max abs error
   <= 1e-4), the version must have risen by one, and pairwise accuracy must have risen.

A summary table closes the run; ``--json PATH`` writes the record (also when the run breaks).
Exit code 0 when every check holds, 1 when one fails or the run breaks, 2 for bad arguments,
130 on Ctrl-C. The server subprocess is stopped on every path (normal exit, exception, Ctrl-C,
SIGTERM/SIGHUP, interpreter exit). This module is the command line; the run itself is
``weightsync.demo.run`` (``run_demo(cfg)`` for library use).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from weightsync.demo.config import (
    STRATEGY_PRESETS,
    TRAIN_MODES,
    DemoConfig,
    load_demo_config,
    strategy_from_name,
)
from weightsync.demo.report import Progress, format_table
from weightsync.demo.run import DemoResult, run_demo, strategy_label

# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightsync demo",
        description=(
            "Train a tiny vLLM-served reward model's head in this process, publish it through a "
            "weight-sync strategy, and check served scores == transformers and accuracy rose."
        ),
    )
    p.add_argument("--config", help="demo YAML (default: the shipped demo preset, weightsync/configs/demo.yaml)")
    p.add_argument(
        "--strategy",
        help="broadcast (gloo, default) | packed_cuda_ipc | cuda_ipc | broadcast_nccl | a "
        "strategy YAML | any registered strategy type",
    )
    p.add_argument("--mode", choices=TRAIN_MODES, help="head_only (default) or full")
    p.add_argument("--family", choices=("qwen2", "llama"), help="tiny model family")
    p.add_argument("--steps", type=int, help="training steps (head_only: train.steps, full: train.full_steps)")
    p.add_argument("--seed", type=int, help="seed for model and data")
    p.add_argument("--num-eval", type=int, help="held-out pairs")
    p.add_argument("--device", choices=("cpu", "cuda"), help="trainer device")
    p.add_argument("--json", dest="json_path", help="write the result record to this path")
    p.add_argument("--workdir", help="keep model, logs and caches here (default: a temp dir, removed)")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the summary")
    return p


def apply_overrides(cfg: DemoConfig, args: argparse.Namespace) -> DemoConfig:
    if args.strategy:
        cfg.strategy = strategy_from_name(args.strategy)
    if args.mode:
        cfg.train.mode = args.mode
    if args.family:
        cfg.model.family = args.family
    if args.steps is not None:
        if cfg.train.mode == "full":
            cfg.train.full_steps = args.steps
        else:
            cfg.train.steps = args.steps
    if args.seed is not None:
        cfg.model.seed = cfg.data.seed = args.seed
    if args.num_eval is not None:
        cfg.data.num_eval = args.num_eval
    if args.device:
        cfg.train.device = args.device
        if args.device == "cuda" and not args.strategy and cfg.strategy == STRATEGY_PRESETS["broadcast"]:
            cfg.strategy = dict(STRATEGY_PRESETS["broadcast_nccl"])  # gloo is the CPU default
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
    progress(f"weightsync demo: mode {cfg.train.mode}, strategy {strategy_label(cfg.strategy)}")
    result = DemoResult.for_config(cfg)
    code = 0
    try:
        run_demo(cfg, progress=progress, workdir=args.workdir, result=result)
    except KeyboardInterrupt:
        print("weightsync demo: interrupted", file=sys.stderr)
        result.failures.append("interrupted")
        code = 130
    except SystemExit as e:  # SIGTERM / SIGHUP (see weightsync.demo.server.signals_raise_system_exit); the server is down
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
        print(summary_table(result))
        code = 0 if result.passed else 1
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
        print(f"\nwrote {args.json_path}")
    return code

