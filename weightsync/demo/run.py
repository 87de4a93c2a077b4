"""One train -> sync -> score cycle against a vLLM reward server: what ``weightsync demo --mode
head_only`` (or ``full``) runs.

Caller: ``weightsync.demo.cli.main`` (or library code: ``run_demo(cfg)``), in the trainer process.
The reward server is a subprocess this module starts and always stops (``finally``; SIGTERM and
SIGHUP become ``SystemExit`` while it runs so the ``finally`` runs for them too).

Order (the server boots while the trainer works, so start-up is not paid twice):
build the tiny model -> start the server -> synthetic preference set -> transformers reference
scores of the held-out pairs -> Bradley-Terry training -> wait for ``/health`` -> score the
held-out pairs through the server -> ``sync_weights`` through the configured strategy -> score
again -> checks (``check``) fill ``DemoResult.failures``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from weightsync.demo.config import DemoConfig
from weightsync.demo.report import Progress, nan_to_none
from weightsync.testing.servers import signals_raise_system_exit


@dataclass(kw_only=True)
class DemoResult:
    """What one demo run measured; ``to_dict()`` is the ``--json`` record (NaN -> null)."""

    strategy: str
    strategy_config: dict[str, Any]
    mode: str
    servers_device: str = "cpu"  # where vLLM's server ran: cpu or cuda
    sync_seconds: float = float("nan")
    bytes_synced: int = 0
    expected_bytes: int = 0
    num_tensors_synced: int = 0
    version_before: int | None = None
    version_after: int | None = None
    accuracy_before: float = float("nan")
    accuracy_after: float = float("nan")
    hf_accuracy_before: float = float("nan")
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

    @classmethod
    def for_config(cls, cfg: DemoConfig) -> DemoResult:
        return cls(strategy=strategy_label(cfg.strategy), strategy_config=dict(cfg.strategy),
                   mode=cfg.mode)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        d = nan_to_none(dataclasses.asdict(self))
        d["passed"] = self.passed
        return d


def strategy_label(strategy_cfg: dict[str, Any]) -> str:
    """``{"type": "broadcast", "backend": "gloo"}`` -> ``"broadcast/gloo"``."""
    kind = str(strategy_cfg.get("type", "?"))
    backend = strategy_cfg.get("backend")
    return f"{kind}/{backend}" if backend else kind


def check(cfg: DemoConfig, r: DemoResult) -> None:
    """Append to ``r.failures`` every acceptance condition that does not hold."""
    tol, _ = cfg.check.tolerances(r.servers_device)
    if not r.accuracy_after > r.accuracy_before + cfg.check.min_accuracy_gain:
        r.failures.append(
            f"pairwise accuracy did not rise: {r.accuracy_before:.3f} -> {r.accuracy_after:.3f}"
        )
    if not r.max_abs_err_vs_hf <= tol:
        r.failures.append(
            f"served scores differ from transformers by {r.max_abs_err_vs_hf:.3e} > {tol:g}"
        )
    if not r.max_abs_err_before <= tol:
        r.failures.append(
            "before the sync, served scores differ from transformers by "
            f"{r.max_abs_err_before:.3e} > {tol:g}"
        )
    if r.version_before is None or r.version_after != r.version_before + 1:
        r.failures.append(f"version went {r.version_before} -> {r.version_after}, expected +1")
    if r.bytes_synced != r.expected_bytes:
        r.failures.append(f"synced {r.bytes_synced} bytes, expected {r.expected_bytes}")


def run_demo(
    cfg: DemoConfig,
    *,
    progress: Progress | None = None,
    workdir: str | None = None,
    result: DemoResult | None = None,
) -> DemoResult:
    """Run the whole cycle; the server is down again when this returns or raises.

    Raises on a broken run (server did not start, sync failed); ``result``, when given, keeps
    what was measured until then. A run that completes but fails a check returns a result with
    ``failures``.
    """
    run = DemoRun(cfg, progress or Progress(), result or DemoResult.for_config(cfg))
    with _workdir(workdir) as wd, signals_raise_system_exit():
        try:
            run.run(wd)
        finally:
            run.stop_server()
    run.result.total_seconds = run.progress.elapsed
    return run.result


@dataclass
class _Trained:
    """The trainer side's output: what to publish and the transformers reference scores."""

    params: dict[str, Any]
    mode: Any  # RewardModelTrainingMode
    eval_texts: list[str]
    num_pairs: int
    hf_before: list[float]
    hf_after: list[float]


class DemoRun:
    """The steps of one run; ``result`` fills in as they go."""

    def __init__(self, cfg: DemoConfig, progress: Progress, result: DemoResult) -> None:
        self.cfg, self.progress, self.result = cfg, progress, result
        self.server: Any = None  # RewardServerProcess

    def run(self, wd: str) -> None:
        import torch

        torch.set_num_threads(max(1, self.cfg.train.threads))  # the server needs a core too
        _quiet_transformers()
        model_dir = self.build_model(wd)
        self.start_server(model_dir, wd)
        try:
            trained = self.train(model_dir)
            self.wait_for_server()
            asyncio.run(self.score_sync_score(trained))
        except BaseException as e:
            if "last log lines" not in str(e) and not self.server.health():
                self.progress(f"reward server log tail:\n{self.server.log_tail(2000)}")
            raise
        check(self.cfg, self.result)

    def stop_server(self) -> None:
        if self.server is not None:
            self.progress("stopping reward server")
            self.server.stop()
            self.server = None

    # -- steps --------------------------------------------------------------------------------
    def build_model(self, wd: str) -> str:
        from weightsync.testing.tiny_models import build_tiny_reward_model

        m = self.cfg.model
        model_dir = os.path.join(wd, "tiny-reward-model")
        self.progress(
            f"building tiny {m.family} reward model (hidden {m.hidden_size}, {m.num_layers} "
            f"layers) in {model_dir}"
        )
        return build_tiny_reward_model(
            model_dir, family=m.family, hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, seed=m.seed,
        )

    def start_server(self, model_dir: str, wd: str) -> None:
        from weightsync.demo.placement import plan_placement
        from weightsync.testing.servers import RewardServerProcess

        s = self.cfg.server
        place = plan_placement(self.cfg.train.device, self.cfg.strategy)
        self.result.servers_device = "cuda" if place.servers_on_gpu else "cpu"
        self.server = RewardServerProcess(
            model_dir, scratch_dir=wd, host=s.host, env=place.server_env,
            extra_args=["--max-model-len", str(s.max_model_len), *place.server_args,
                        *s.extra_args],
        ).start()
        self.progress(
            f"reward server starting (pid {self.server.pid}, {self.server.url}, "
            f"log {self.server.log_path})"
        )

    def train(self, model_dir: str) -> _Trained:
        from weightsync.demo import data as demo_data
        from weightsync.demo import train as demo_train
        from weightsync.reward.types import RewardModelTrainingMode

        cfg, r, progress = self.cfg, self.result, self.progress
        split = demo_data.make_preference_split(
            num_train=cfg.data.num_train, num_eval=cfg.data.num_eval, seed=cfg.data.seed
        )
        r.num_train_pairs, r.num_eval_pairs = len(split.train), len(split.eval)
        eval_chosen, eval_rejected = demo_data.pair_texts(split.eval)
        train_chosen, train_rejected = demo_data.pair_texts(split.train)
        n = len(eval_chosen)
        progress(f"synthetic preference set: {len(split.train)} train / {n} held-out pairs")

        model, tok = demo_train.load_reward_model(model_dir, device=cfg.train.device)
        hf_before = demo_train.hf_scores(model, tok, eval_chosen + eval_rejected)
        r.hf_accuracy_before = demo_data.pairwise_accuracy(hf_before[:n], hf_before[n:])
        progress(f"transformers, before training: pairwise accuracy {r.hf_accuracy_before:.3f}")

        if cfg.mode == "head_only":
            progress(f"training the head only (score.weight), {cfg.train.steps} Adam steps, "
                     "Bradley-Terry loss")
            tr = demo_train.train_head(
                model,
                demo_train.pooled_features(model, tok, train_chosen),
                demo_train.pooled_features(model, tok, train_rejected),
                steps=cfg.train.steps, lr=cfg.train.lr, batch_size=cfg.train.batch_size,
                seed=cfg.data.seed,
            )
            params, mode = demo_train.head_params(model), RewardModelTrainingMode.HEAD_ONLY
        else:
            progress(f"full fine-tune, {cfg.train.full_steps} Adam steps, Bradley-Terry loss")
            tr = demo_train.train_full(
                model, tok, train_chosen, train_rejected, steps=cfg.train.full_steps,
                lr=cfg.train.full_lr, batch_size=cfg.train.full_batch_size, seed=cfg.data.seed,
            )
            params, mode = demo_train.all_params(model), RewardModelTrainingMode.FULL
        r.train_steps, r.train_seconds = tr.steps, tr.seconds
        r.train_loss_first, r.train_loss_last = tr.loss_first, tr.loss_last
        r.expected_bytes = sum(t.numel() * t.element_size() for t in params.values())
        hf_after = demo_train.hf_scores(model, tok, eval_chosen + eval_rejected)
        r.hf_accuracy_after = demo_data.pairwise_accuracy(hf_after[:n], hf_after[n:])
        progress(
            f"trained in {tr.seconds:.1f}s: loss {tr.loss_first:.4f} -> {tr.loss_last:.4f}; "
            f"transformers accuracy now {r.hf_accuracy_after:.3f}"
        )
        return _Trained(params, mode, eval_chosen + eval_rejected, n, hf_before, hf_after)

    def wait_for_server(self) -> None:
        waited = self.server.wait_healthy(
            timeout_s=self.cfg.server.startup_timeout_s, progress=self.progress
        )
        self.result.server_ready_seconds = self.progress.elapsed
        self.progress(f"reward server healthy (waited {waited:.1f}s more)")

    async def score_sync_score(self, t: _Trained) -> None:
        from weightsync.demo.data import pairwise_accuracy

        r, progress, n = self.result, self.progress, t.num_pairs
        async with _reward_client(self.cfg, self.server) as client:
            r.version_before = int(await client.get_model_version())
            before = _floats(await client.score_batch(t.eval_texts, normalize=False))
            r.accuracy_before = pairwise_accuracy(before[:n], before[n:])
            r.max_abs_err_before = _max_abs_diff(before, t.hf_before)
            progress(
                f"served scores, version {r.version_before}: accuracy {r.accuracy_before:.3f}, "
                f"max |served - transformers| {r.max_abs_err_before:.2e}"
            )

            progress(
                f"publishing {len(t.params)} tensor(s), {r.expected_bytes:,} bytes, mode "
                f"{t.mode.value}, strategy {r.strategy}"
            )
            t0 = time.perf_counter()
            await client.sync_weights_async(t.params, training_mode=t.mode, timeout_s=120)
            stats = client.last_sync_stats
            r.sync_seconds = time.perf_counter() - t0
            r.bytes_synced, r.num_tensors_synced = int(stats.total_bytes), int(stats.num_tensors)
            r.version_after = int(await client.get_model_version())
            progress(
                f"synced in {r.sync_seconds * 1e3:.1f} ms; server version "
                f"{r.version_before} -> {r.version_after}"
            )

            after = _floats(await client.score_batch(t.eval_texts, normalize=False))
            r.accuracy_after = pairwise_accuracy(after[:n], after[n:])
            r.max_abs_err_vs_hf = _max_abs_diff(after, t.hf_after)
            progress(
                f"served scores, version {r.version_after}: accuracy {r.accuracy_after:.3f}, "
                f"max |served - transformers| {r.max_abs_err_vs_hf:.2e}"
            )


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _floats(scores: list[Any]) -> list[float]:
    """``score_batch`` output -> one float per text (the demo model has one label)."""
    out = []
    for s in scores:
        if isinstance(s, (list, tuple)):
            if len(s) != 1:
                raise ValueError(f"the demo expects one label per text, the server gave {len(s)}")
            s = s[0]
        out.append(float(s))
    return out


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _reward_client(cfg: DemoConfig, server: Any) -> Any:
    """A ``VLLMRewardClient`` for the demo's reward server (``server``: its ``ServerProcess``)
    that syncs with the configured strategy; a broadcast group is hosted by this process on the
    server's host, on a free port."""
    from weightsync.reward.client import VLLMRewardClient
    from weightsync.testing.servers import free_port

    strategy = dict(cfg.strategy)
    if strategy.get("type") == "broadcast":
        strategy.setdefault("master_addr", server.host)
        strategy.setdefault("master_port", free_port(server.host))
    return VLLMRewardClient(
        server.host, server.port, group_port=strategy.get("master_port"),
        connection_timeout_s=cfg.server.startup_timeout_s, enable_weight_updates=True,
        device=cfg.train.device, strategy=strategy,
    )


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers / the hub between the demo's own lines."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[str]:
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as d:
            yield d
