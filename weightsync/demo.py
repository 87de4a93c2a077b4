"""``weightsync demo``: one real train -> sync -> score cycle on a vLLM-served reward model.

Entry points: ``weightsync demo [...]`` (the CLI dispatches to ``main(argv)``) and
``python -m weightsync.demo [...]``. Runs on CPU with nothing downloaded, in about a minute:

1. build a tiny ``Qwen2ForSequenceClassification`` (random weights, offline tokenizer) in a
   temp dir;
2. start the reward server on it as a real subprocess (``weightsync.reward.server``, vLLM) on a
   free port; it boots while the trainer works;
3. build a synthetic preference set (``weightsync.demo_data``), take the transformers reference
   scores of the held-out pairs, and train the head in this process with the Bradley-Terry loss
   (``--mode head_only``: only ``score.weight``; ``--mode full``: a short full fine-tune);
4. once the server is healthy, score the held-out pairs through it (pairwise accuracy before,
   and served == transformers for the untouched model);
5. publish the new weights through the configured strategy (``VLLMRewardClient.sync_weights``:
   gloo broadcast by default, ``--strategy packed_cuda_ipc`` for shared memory);
6. score again: served scores must equal transformers' for the trained model (max abs error
   <= 1e-4), the version must have risen by one, and pairwise accuracy must have risen.

A summary table closes the run; ``--json PATH`` writes the record. Exit code 0 when every check
holds, 1 when one fails or the run breaks, 2 for bad arguments. The server subprocess is
stopped on every path (normal exit, exception, Ctrl-C, SIGTERM, interpreter exit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from weightsync.demo_config import (
    TRAIN_MODES,
    DemoConfig,
    load_demo_config,
    strategy_from_name,
)
from weightsync.demo_report import Progress, format_table


@dataclass(kw_only=True)
class DemoResult:
    """What one demo run measured; ``to_dict()`` is the ``--json`` record."""

    strategy: str
    strategy_config: dict[str, Any]
    mode: str
    sync_seconds: float = float("nan")
    bytes_synced: int = 0
    expected_bytes: int = 0
    num_tensors_synced: int = 0
    version_before: int | None = None
    version_after: int | None = None
    accuracy_before: float = float("nan")
    accuracy_after: float = float("nan")
    hf_accuracy_after: float = float("nan")
    max_abs_err_vs_hf: float = float("nan")
    max_abs_err_before: float = float("nan")
    num_eval_pairs: int = 0
    num_train_pairs: int = 0
    train_steps: int = 0
    train_loss_first: float = float("nan")
    train_loss_last: float = float("nan")
    train_seconds: float = float("nan")
    server_ready_seconds: float = float("nan")
    total_seconds: float = float("nan")
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe record (NaN, i.e. not measured, becomes null)."""
        d = {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in dataclasses.asdict(self).items()
        }
        d["passed"] = self.passed
        return d


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
    p.add_argument("--config", help="demo YAML (default: configs/demo.yaml)")
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
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def strategy_label(strategy_cfg: dict[str, Any]) -> str:
    kind = str(strategy_cfg.get("type", "?"))
    backend = strategy_cfg.get("backend")
    return f"{kind}/{backend}" if backend else kind


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[str]:
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as d:
            yield d


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into SystemExit so ``finally`` blocks stop the server."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _as_scores(result: Any) -> list[float]:
    """``score_batch`` result -> floats (a list, or a ScoringResponse with ``scores``)."""
    scores = getattr(result, "scores", result)
    if isinstance(scores, tuple) and len(scores) == 2 and not isinstance(scores[0], float):
        scores = getattr(scores[0], "scores", scores[0])
    out = []
    for s in scores:
        if isinstance(s, (list, tuple)):
            if len(s) != 1:
                raise ValueError(f"demo expects one label per text, got {len(s)}")
            s = s[0]
        out.append(float(s))
    return out


def _stat(stats: Any, name: str, default: Any = None) -> Any:
    if stats is None:
        return default
    if isinstance(stats, dict):
        return stats.get(name, default)
    return getattr(stats, name, default)


async def _score(client: Any, texts: list[str]) -> list[float]:
    return _as_scores(await client.score_batch(texts))


def new_result(cfg: DemoConfig) -> DemoResult:
    return DemoResult(
        strategy=strategy_label(cfg.strategy), strategy_config=dict(cfg.strategy),
        mode=cfg.train.mode,
    )


def run_demo(
    cfg: DemoConfig,
    *,
    progress: Progress | None = None,
    workdir: str | None = None,
    result: DemoResult | None = None,
) -> DemoResult:
    """Run the whole cycle; never leaves the server running. Raises on a broken run (server did
    not start, sync failed; ``result``, when given, keeps what was measured until then); a run
    that completes but fails a check returns a result with ``failures``."""
    progress = progress or Progress()
    result = result or new_result(cfg)
    with _workdir(workdir) as wd, _sigterm_raises():
        server = None
        try:
            server = _run(cfg, result, progress, wd)
        finally:
            if server is not None:
                progress("stopping reward server")
                server.stop()
    result.total_seconds = progress.elapsed
    return result


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers / the hub between the demo's own lines."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _run(cfg: DemoConfig, result: DemoResult, progress: Progress, wd: str) -> Any:
    import torch

    from weightsync import demo_data, demo_train
    from weightsync.demo_server import RewardServerProcess
    from weightsync.tiny_models import build_tiny_reward_model

    torch.set_num_threads(max(1, cfg.train.threads))
    _quiet_transformers()
    m = cfg.model
    model_dir = os.path.join(wd, "tiny-reward-model")
    progress(
        f"building tiny {m.family} reward model (hidden {m.hidden_size}, {m.num_layers} layers) "
        f"in {model_dir}"
    )
    build_tiny_reward_model(
        model_dir, family=m.family, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, seed=m.seed,
    )

    server = RewardServerProcess(
        model_dir, scratch_dir=wd, host=cfg.server.host,
        extra_args=["--max-model-len", str(cfg.server.max_model_len), *cfg.server.extra_args],
    ).start()
    progress(f"reward server starting (pid {server.pid}, {server.url}, log {server.log_path})")
    try:
        _trainer_and_sync(cfg, result, progress, server, model_dir, demo_data, demo_train)
    except BaseException as e:
        if "last log lines" not in str(e) and not server.health():
            progress(f"reward server log tail:\n{server.log_tail(2000)}")
        raise
    return server


def _trainer_and_sync(cfg, result, progress, server, model_dir, demo_data, demo_train) -> None:
    from weightsync.reward.types import RewardModelTrainingMode

    # --- trainer side, while the server boots -------------------------------------------------
    split = demo_data.make_preference_split(
        num_train=cfg.data.num_train, num_eval=cfg.data.num_eval, seed=cfg.data.seed
    )
    result.num_train_pairs, result.num_eval_pairs = len(split.train), len(split.eval)
    eval_chosen, eval_rejected = demo_data.pair_texts(split.eval)
    eval_texts = eval_chosen + eval_rejected
    train_chosen, train_rejected = demo_data.pair_texts(split.train)
    progress(
        f"synthetic preference set: {len(split.train)} train / {len(split.eval)} held-out pairs"
    )

    model, tok = demo_train.load_reward_model(model_dir, device=cfg.train.device)
    hf_before = demo_train.hf_scores(model, tok, eval_texts)
    n = len(eval_chosen)
    progress(
        "transformers reference, before training: pairwise accuracy "
        f"{demo_data.pairwise_accuracy(hf_before[:n], hf_before[n:]):.3f}"
    )

    if cfg.train.mode == "head_only":
        progress(f"training the head (score.weight only), {cfg.train.steps} Adam steps, Bradley-Terry")
        fc = demo_train.pooled_features(model, tok, train_chosen)
        fr = demo_train.pooled_features(model, tok, train_rejected)
        tr = demo_train.train_head(
            model, fc, fr, steps=cfg.train.steps, lr=cfg.train.lr,
            batch_size=cfg.train.batch_size, seed=cfg.data.seed,
        )
        params = demo_train.head_params(model)
        mode = RewardModelTrainingMode.HEAD_ONLY
    else:
        progress(f"full fine-tune, {cfg.train.full_steps} Adam steps, Bradley-Terry")
        tr = demo_train.train_full(
            model, tok, train_chosen, train_rejected, steps=cfg.train.full_steps,
            lr=cfg.train.full_lr, batch_size=cfg.train.full_batch_size, seed=cfg.data.seed,
        )
        params = demo_train.all_params(model)
        mode = RewardModelTrainingMode.FULL
    result.train_steps, result.train_seconds = tr.steps, tr.seconds
    result.train_loss_first, result.train_loss_last = tr.loss_first, tr.loss_last
    result.expected_bytes = sum(t.numel() * t.element_size() for t in params.values())
    hf_after = demo_train.hf_scores(model, tok, eval_texts)
    result.hf_accuracy_after = demo_data.pairwise_accuracy(hf_after[:n], hf_after[n:])
    progress(
        f"trained in {tr.seconds:.1f}s: loss {tr.loss_first:.4f} -> {tr.loss_last:.4f}; "
        f"transformers accuracy now {result.hf_accuracy_after:.3f}"
    )

    # --- the server ----------------------------------------------------------------------------
    result.server_ready_seconds = progress.elapsed
    waited = server.wait_healthy(timeout_s=cfg.server.startup_timeout_s, progress=progress)
    result.server_ready_seconds = progress.elapsed
    progress(f"reward server healthy (waited {waited:.1f}s more)")
    asyncio.run(_serve_side(cfg, result, progress, server, params, mode, eval_texts, n,
                            hf_before, hf_after, demo_data))


async def _serve_side(cfg, result, progress, server, params, mode, eval_texts, n,
                      hf_before, hf_after, demo_data) -> None:
    from weightsync.demo_server import free_port
    from weightsync.reward.client import VLLMRewardClient

    strategy = dict(cfg.strategy)
    if strategy.get("type") == "broadcast":  # the trainer hosts the group, on the loopback here
        strategy.setdefault("master_addr", server.host)
        strategy.setdefault("master_port", free_port(server.host))
    client = VLLMRewardClient(
        server.host, server.port, group_port=strategy.get("master_port"),
        connection_timeout_s=cfg.server.startup_timeout_s, enable_weight_updates=True,
        device=cfg.train.device, strategy=strategy,
    )
    try:
        result.version_before = int(await client.get_model_version())
        before = await _score(client, eval_texts)
        result.accuracy_before = demo_data.pairwise_accuracy(before[:n], before[n:])
        result.max_abs_err_before = max(abs(a - b) for a, b in zip(before, hf_before, strict=True))
        progress(
            f"served scores, version {result.version_before}: accuracy "
            f"{result.accuracy_before:.3f}, max |served - transformers| "
            f"{result.max_abs_err_before:.2e}"
        )

        nbytes = result.expected_bytes
        progress(
            f"publishing {len(params)} tensor(s), {nbytes:,} bytes, mode {mode.value}, "
            f"strategy {result.strategy}"
        )
        import time

        t0 = time.perf_counter()
        stats = await client.sync_weights(params, training_mode=mode, timeout_s=120)
        result.sync_seconds = time.perf_counter() - t0
        result.bytes_synced = int(_stat(stats, "total_bytes", nbytes))
        result.num_tensors_synced = int(_stat(stats, "num_tensors", len(params)))
        result.version_after = int(await client.get_model_version())
        progress(
            f"synced in {result.sync_seconds * 1e3:.1f} ms; server version "
            f"{result.version_before} -> {result.version_after}"
        )

        after = await _score(client, eval_texts)
        result.accuracy_after = demo_data.pairwise_accuracy(after[:n], after[n:])
        result.max_abs_err_vs_hf = max(abs(a - b) for a, b in zip(after, hf_after, strict=True))
        progress(
            f"served scores, version {result.version_after}: accuracy "
            f"{result.accuracy_after:.3f}, max |served - transformers| "
            f"{result.max_abs_err_vs_hf:.2e}"
        )
    finally:
        close = getattr(client, "close", None) or getattr(client, "aclose", None)
        if close is not None:
            ret = close()
            if asyncio.iscoroutine(ret):
                await ret
    _check(cfg, result)


def _check(cfg: DemoConfig, r: DemoResult) -> None:
    tol = cfg.check.max_abs_err
    if not r.accuracy_after > r.accuracy_before + cfg.check.min_accuracy_gain:
        r.failures.append(
            f"pairwise accuracy did not rise: {r.accuracy_before:.3f} -> {r.accuracy_after:.3f}"
        )
    if not r.max_abs_err_vs_hf <= tol:
        r.failures.append(f"served scores differ from transformers by {r.max_abs_err_vs_hf:.3e} > {tol:g}")
    if not r.max_abs_err_before <= tol:
        r.failures.append(
            f"before the sync, served scores differ from transformers by {r.max_abs_err_before:.3e} > {tol:g}"
        )
    if r.version_before is None or r.version_after != r.version_before + 1:
        r.failures.append(f"version went {r.version_before} -> {r.version_after}, expected +1")
    if r.bytes_synced != r.expected_bytes:
        r.failures.append(f"synced {r.bytes_synced} bytes, expected {r.expected_bytes}")


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
    result = new_result(cfg)
    code = 0
    try:
        run_demo(cfg, progress=progress, workdir=args.workdir, result=result)
    except KeyboardInterrupt:
        print("weightsync demo: interrupted", file=sys.stderr)
        result.failures.append("interrupted")
        code = 130
    except SystemExit as e:  # SIGTERM / SIGHUP (see _sigterm_raises); the server is down
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


if __name__ == "__main__":
    raise SystemExit(main())
