"""The RLHF loop of ``weightsync demo`` (mode ``rlhf``, the default): cold-start RLHF on CPU with
two vLLM servers and tiny models built in code.

Caller: ``weightsync.demo.cli.main`` (or library code: ``run_rlhf(cfg)``), in the trainer
process. Both servers are subprocesses this module starts at once (they boot concurrently while
the trainer works) and always stops (``finally``; SIGTERM / SIGHUP become ``SystemExit`` while it
runs, so the ``finally`` runs for them too).

1. Build a tiny reward model (``*ForSequenceClassification``) and a tiny policy (causal LM),
   random weights, one shared offline tokenizer; start the reward server and the policy server
   (``weightsync serve-policy``) on them.
2. Reward model: preference pairs labelled by the task's hidden judge (``weightsync.demo.task``),
   a Bradley-Terry full fine-tune in this process, then ``VLLMRewardClient.sync_weights`` into
   the reward server (its version rises); served scores must equal transformers'.
3. Every step is a Ludic-style trainer step: ``batch = await source.next_batch()`` (a
   ``RolloutBatchSource`` over a ``RolloutEngine`` on ``VLLMChatClient``: the policy server
   samples ``group_size`` completions for each of ``prompts_per_step`` prompts, the preset's
   ``RewardModelScorer`` scores them on the reward server, ``make_grpo_with_rm`` assigns credit:
   GRPO advantages over reward-model scores) -> a few epochs of the preset's clipped
   policy-gradient loss on the trainer's transformers copy, over the batch's ``SAWItem``s ->
   ``BroadcastPolicyPublisher(VllmControlPlane(policy), VllmTensorCommunicator(policy))
   .publish(model.state_dict())`` (the policy server's version rises every step). Before each
   update the trainer's log-probabilities of the sampled tokens must equal the server's: the
   server samples with exactly the weights last pushed.

The run passes when the mean reward of the last two steps exceeds that of the first two by
``check.min_reward_rise``, both servers' versions advanced as expected, the served reward
scores equal transformers' (``check.max_abs_err``) and the log-probability gap stays under
``check.max_logprob_gap``. ``RLHFResult.to_dict()`` is the ``--json`` record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.demo.config import DemoConfig
from weightsync.demo.report import Progress, nan_to_none, progress_bar
from weightsync.testing.servers import signals_raise_system_exit, stop_together

POLICY_NAME = "tiny-policy"  # the policy server's served model name


@dataclass(kw_only=True)
class StepRecord:
    """One RL step. ``policy_version``: what the policy server serves after this step's push;
    ``sampled_version``: the version that sampled this step's completions; ``rm_version``: the
    reward-model version behind its scores; ``judge_score``: the hidden rule's mean score."""

    step: int
    mean_reward: float
    sync_seconds: float
    policy_version: int | None
    rm_version: int | None
    sampled_version: int | None = None
    reward_std: float = float("nan")
    judge_score: float = float("nan")
    loss_first: float = float("nan")
    loss_last: float = float("nan")
    logprob_gap: float = float("nan")
    sync_bytes: int = 0
    sample_seconds: float = float("nan")  # the batch: sampling, scoring, credit
    train_seconds: float = float("nan")
    step_seconds: float = float("nan")


@dataclass(kw_only=True)
class RLHFResult:
    """What one RLHF run measured; ``to_dict()`` is the ``--json`` record (NaN -> null)."""

    strategy: str
    strategy_config: dict[str, Any]
    mode: str = "rlhf"
    servers_device: str = "cpu"  # where vLLM's servers ran: cpu or cuda
    placement: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    num_steps: int = 0
    group_size: int = 0
    prompts_per_step: int = 0
    letter: str = ""
    rm_train_pairs: int = 0
    rm_train_seconds: float = float("nan")
    rm_loss_first: float = float("nan")
    rm_loss_last: float = float("nan")
    rm_accuracy: float = float("nan")  # transformers, held-out judge-labelled pairs
    rm_served_accuracy: float = float("nan")  # the same pairs scored by the reward server
    rm_max_abs_err_vs_hf: float = float("nan")
    rm_sync_seconds: float = float("nan")
    rm_version_before: int | None = None
    rm_version_after: int | None = None
    policy_version_before: int | None = None
    policy_version_after: int | None = None
    reward_first: float = float("nan")
    reward_last: float = float("nan")
    judge_first: float = float("nan")
    judge_last: float = float("nan")
    servers_ready_seconds: float = float("nan")
    total_seconds: float = float("nan")
    plot_path: str | None = None
    plot_note: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        d = nan_to_none(dataclasses.asdict(self))
        d["passed"] = self.passed
        return d


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def check(cfg: DemoConfig, r: RLHFResult) -> None:
    """Append to ``r.failures`` every acceptance condition that does not hold."""
    c = cfg.check
    if len(r.steps) != cfg.rlhf.steps:
        r.failures.append(f"ran {len(r.steps)} of {cfg.rlhf.steps} steps")
    if len(r.steps) >= 2:
        k = min(2, len(r.steps) // 2)
        first = _mean([s.mean_reward for s in r.steps[:k]])
        last = _mean([s.mean_reward for s in r.steps[-k:]])
        r.reward_first, r.reward_last = first, last
        r.judge_first = _mean([s.judge_score for s in r.steps[:k]])
        r.judge_last = _mean([s.judge_score for s in r.steps[-k:]])
        if not last > first + c.min_reward_rise:
            r.failures.append(f"mean reward did not rise by {c.min_reward_rise}: first {k} steps "
                              f"{first:.3f}, last {k} steps {last:.3f}")
    if r.rm_version_before is None or r.rm_version_after != r.rm_version_before + 1:
        r.failures.append(f"reward model version went {r.rm_version_before} -> "
                          f"{r.rm_version_after}, expected +1")
    expected = [None if r.policy_version_before is None else r.policy_version_before + i + 1
                for i in range(len(r.steps))]
    got = [s.policy_version for s in r.steps]
    if got != expected or r.policy_version_after != (expected[-1] if expected else None):
        r.failures.append(f"policy versions {got}, expected {expected}")
    sampled = [s.sampled_version for s in r.steps]
    if sampled and sampled != [r.policy_version_before, *got[:-1]]:
        r.failures.append(f"completions sampled by policy versions {sampled}, expected "
                          f"{[r.policy_version_before, *got[:-1]]}")
    max_abs_err, max_gap = c.tolerances(r.servers_device)
    if not r.rm_max_abs_err_vs_hf <= max_abs_err:
        r.failures.append(f"served reward scores differ from transformers by "
                          f"{r.rm_max_abs_err_vs_hf:.3e} > {max_abs_err:g}")
    gaps = [s.logprob_gap for s in r.steps]
    if any(not g <= max_gap for g in gaps):
        r.failures.append(f"policy server and trainer log-probabilities differ by up to "
                          f"{max(gaps):.3e} > {max_gap:g} (the server does not sample "
                          f"with the pushed weights)")
    if any(s.rm_version != r.rm_version_after for s in r.steps):
        r.failures.append(f"steps scored by reward-model versions {[s.rm_version for s in r.steps]}"
                          f", expected {r.rm_version_after}")


def run_rlhf(
    cfg: DemoConfig,
    *,
    progress: Progress | None = None,
    workdir: str | None = None,
    result: RLHFResult | None = None,
    plot_path: str | None = None,
) -> RLHFResult:
    """Run the loop; both servers are down again when this returns or raises.

    Raises on a broken run (a server did not start, a sync failed); ``result``, when given,
    keeps what was measured until then. A run that completes but fails a check returns a result
    with ``failures``. ``plot_path``: write the PNG there (skipped, with a note, without
    matplotlib)."""
    from weightsync.demo.run import _workdir, strategy_label

    r = result or RLHFResult(strategy=strategy_label(cfg.strategy),
                             strategy_config=dict(cfg.strategy))
    run = RLHFRun(cfg, progress or Progress(), r)
    with _workdir(workdir) as wd, signals_raise_system_exit():
        try:
            run.run(wd)
        finally:
            run.stop_servers()
    if plot_path and r.steps:
        from weightsync.demo.plot import matplotlib_missing, plot_steps

        note = matplotlib_missing()
        if note is None:
            r.plot_path = plot_steps([dataclasses.asdict(s) for s in r.steps], plot_path,
                                     title=f"RLHF demo: reward for the letter {cfg.rlhf.letter!r}")
            run.progress(f"plot written to {r.plot_path}")
        else:
            r.plot_note = f"no plot: {note}"
            run.progress(r.plot_note)
    r.total_seconds = run.progress.elapsed
    return r


@dataclass
class _RewardModel:
    """The trained reward model and what the checks need of it."""

    params: dict[str, Any]
    eval_texts: list[str]  # chosen texts, then rejected ones
    hf_scores: list[float]


class RLHFRun:
    """The steps of one run; ``result`` fills in as they go."""

    def __init__(self, cfg: DemoConfig, progress: Progress, result: RLHFResult) -> None:
        self.cfg, self.progress, self.result = cfg, progress, result
        self.reward_server: Any = None
        self.policy_server: Any = None
        r, c = result, cfg.rlhf
        r.num_steps, r.group_size, r.prompts_per_step = c.steps, c.group_size, c.prompts_per_step
        r.letter, r.rm_train_pairs = c.letter, c.rm_train_pairs

    def run(self, wd: str) -> None:
        import torch

        from weightsync.demo.run import _quiet_transformers

        torch.set_num_threads(max(1, self.cfg.train.threads))  # the servers need the cores
        _quiet_transformers()
        rm_dir, policy_dir = self.build_models(wd)
        self.start_servers(rm_dir, policy_dir, wd)
        try:
            from weightsync.demo.task import LetterTask
            from weightsync.testing.tiny_models import build_tokenizer

            task = LetterTask(build_tokenizer(), letter=self.cfg.rlhf.letter,
                              completion_tokens=self.cfg.rlhf.completion_tokens)
            rm = self.train_reward_model(rm_dir, task)
            from weightsync.demo.policy import PolicyTrainer

            trainer = PolicyTrainer(policy_dir, lr=self.cfg.rlhf.lr, device=self.cfg.train.device)
            self.wait_for_servers()
            asyncio.run(self.loop(rm, trainer, task))
        except BaseException:
            for server in (self.reward_server, self.policy_server):
                if server is not None and server.health() is None:
                    self.progress(f"{server.label} log tail:\n{server.log_tail(2000)}")
            raise
        check(self.cfg, self.result)

    def stop_servers(self) -> None:
        servers = [s for s in (self.policy_server, self.reward_server) if s is not None]
        if servers:
            self.progress(f"stopping {' and '.join(s.label for s in servers)}")
        stop_together(servers)
        self.policy_server = self.reward_server = None

    # -- set-up --------------------------------------------------------------------------------
    def build_models(self, wd: str) -> tuple[str, str]:
        from weightsync.testing.tiny_models import build_tiny_causal_lm, build_tiny_reward_model

        m, p = self.cfg.model, self.cfg.policy
        rm_dir = build_tiny_reward_model(
            os.path.join(wd, "tiny-reward-model"), family=m.family, hidden_size=m.hidden_size,
            num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            seed=m.seed)
        policy_dir = build_tiny_causal_lm(
            os.path.join(wd, "tiny-policy"), family=p.family, hidden_size=p.hidden_size,
            num_layers=p.num_layers, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
            tie_word_embeddings=p.tie_word_embeddings, seed=p.seed)
        self.progress(f"built a tiny {m.family} reward model and a tiny {p.family} policy "
                      f"(hidden {p.hidden_size}, {p.num_layers} layers, random weights) in {wd}")
        return rm_dir, policy_dir

    def start_servers(self, rm_dir: str, policy_dir: str, wd: str) -> None:
        from weightsync.demo.placement import plan_placement
        from weightsync.testing.servers import (
            PolicyServerProcess,
            RewardServerProcess,
            cpu_core_slots,
        )

        s = self.cfg.server
        place = plan_placement(self.cfg.train.device, self.cfg.strategy)
        self.progress(f"placement: {place.describe}")
        self.result.placement = place.describe
        self.result.servers_device = "cuda" if place.servers_on_gpu else "cpu"
        common = ["--max-model-len", str(s.max_model_len), "--log-level", "warning",
                  *place.server_args]
        policy_cores, reward_cores = cpu_core_slots(2) if not place.servers_on_gpu else (None,
                                                                                       None)
        self.reward_server = RewardServerProcess(
            rm_dir, scratch_dir=wd, host=s.host, extra_args=[*common, *s.extra_args],
            cpu_cores=reward_cores, env=place.server_env)
        self.policy_server = PolicyServerProcess(
            policy_dir, scratch_dir=wd, host=s.host, cpu_cores=policy_cores, env=place.server_env,
            extra_args=[*common, "--served-model-name", POLICY_NAME, "--seed",
                        str(self.cfg.rlhf.seed), *s.policy_extra_args])
        for server in (self.reward_server, self.policy_server):
            server.start()
            cores = f", worker cores {server.cpu_cores}" if server.cpu_cores else ""
            self.progress(f"{server.label} starting (pid {server.pid}, {server.url}, "
                          f"log {server.log_path}{cores})")
            if place.start_one_by_one and server is self.reward_server:
                waited = server.wait_healthy(timeout_s=s.startup_timeout_s, progress=self.progress)
                self.progress(f"{server.label} healthy after {waited:.1f}s; the next server "
                              "starts now (each measures the GPU's free memory as it starts)")

    def wait_for_servers(self) -> None:
        for server in (self.reward_server, self.policy_server):
            waited = server.wait_healthy(timeout_s=self.cfg.server.startup_timeout_s,
                                         progress=self.progress)
            self.progress(f"{server.label} healthy (waited {waited:.1f}s more)")
        self.result.servers_ready_seconds = self.progress.elapsed

    def train_reward_model(self, rm_dir: str, task: Any) -> _RewardModel:
        from weightsync.demo import train as demo_train
        from weightsync.demo.data import pairwise_accuracy

        c, r = self.cfg.rlhf, self.result
        train_pairs = task.pairs(c.rm_train_pairs, seed=c.seed)
        eval_pairs = task.pairs(c.rm_eval_pairs, seed=c.seed + 1)
        self.progress(f"reward model: {len(train_pairs)} preference pairs labelled by the "
                      f"hidden judge (more {c.letter!r} is better; {task.token_fraction:.0%} of "
                      f"the vocabulary contains it), Bradley-Terry, {c.rm_steps} Adam steps")
        model, tok = demo_train.load_reward_model(rm_dir, device=self.cfg.train.device)
        tr = demo_train.train_full(
            model, tok, [p.chosen for p in train_pairs], [p.rejected for p in train_pairs],
            steps=c.rm_steps, lr=c.rm_lr, batch_size=c.rm_batch_size, seed=c.seed)
        r.rm_train_seconds, r.rm_loss_first, r.rm_loss_last = tr.seconds, tr.loss_first, tr.loss_last
        texts = [p.chosen for p in eval_pairs] + [p.rejected for p in eval_pairs]
        scores = demo_train.hf_scores(model, tok, texts)
        n = len(eval_pairs)
        r.rm_accuracy = pairwise_accuracy(scores[:n], scores[n:])
        self.progress(f"reward model trained in {tr.seconds:.1f}s: loss {tr.loss_first:.3f} -> "
                      f"{tr.loss_last:.3f}; held-out pairwise accuracy {r.rm_accuracy:.3f}")
        return _RewardModel(demo_train.all_params(model), texts, scores)

    # -- the loop ------------------------------------------------------------------------------
    async def push_reward_model(self, client: Any, rm: _RewardModel) -> None:
        from weightsync.demo.data import pairwise_accuracy
        from weightsync.reward.types import RewardModelTrainingMode

        r = self.result
        r.rm_version_before = int(await client.get_model_version())
        t0 = time.perf_counter()
        await client.sync_weights_async(rm.params, training_mode=RewardModelTrainingMode.FULL,
                                        timeout_s=120)
        r.rm_sync_seconds = time.perf_counter() - t0
        r.rm_version_after = int(await client.get_model_version())
        served = [float(s) for s in await client.score_batch(rm.eval_texts, normalize=False)]
        n = len(served) // 2
        r.rm_served_accuracy = pairwise_accuracy(served[:n], served[n:])
        r.rm_max_abs_err_vs_hf = max(abs(a - b) for a, b in zip(served, rm.hf_scores, strict=True))
        stats = client.last_sync_stats
        self.progress(
            f"reward model pushed ({stats.num_tensors} tensors, {stats.total_bytes:,} bytes) in "
            f"{r.rm_sync_seconds * 1e3:.0f} ms: reward server version {r.rm_version_before} -> "
            f"{r.rm_version_after}; served accuracy {r.rm_served_accuracy:.3f}, max |served - "
            f"transformers| {r.rm_max_abs_err_vs_hf:.1e}")

    async def loop(self, rm: _RewardModel, trainer: Any, task: Any) -> None:
        import httpx

        from weightsync.demo.run import _reward_client
        from weightsync.distributed import (
            BroadcastPolicyPublisher,
            VllmControlPlane,
            VllmTensorCommunicator,
        )
        from weightsync.policy import VLLMChatClient
        from weightsync.reward.presets import make_grpo_with_rm
        from weightsync.reward.rollout_engine import RolloutBatchSource, RolloutEngine

        c, r = self.cfg.rlhf, self.result
        policy_url = self.policy_server.url
        policy = VLLMChatClient(self.policy_server.host, self.policy_server.port,
                                enable_weight_updates=True, device=self.cfg.train.device,
                                model=POLICY_NAME, strategy=dict(self.cfg.strategy))
        try:
            async with _reward_client(self.cfg, self.reward_server) as rm_client, \
                    httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
                await self.push_reward_model(rm_client, rm)
                # the Ludic-style pieces: preset (with its scorer), rollout engine, batch source,
                # policy publisher over the two planes
                algo = make_grpo_with_rm(group_size=c.group_size, mode="replace",
                                         reward_client=rm_client)
                engine = RolloutEngine(policy, max_concurrency=c.prompts_per_step * c.group_size)
                step_of = iter(range(c.steps))
                source = RolloutBatchSource(engine, lambda: self.requests(next(step_of), task),
                                            algo.credit_assigner, reward_scorer=algo.reward_scorer)
                publisher = BroadcastPolicyPublisher(VllmControlPlane(policy),
                                                     VllmTensorCommunicator(policy))
                r.policy_version_before = int(
                    (await http.get(policy_url + "/runtime_version")).json()["version"])
                self.progress(f"RL: {c.steps} steps of {c.prompts_per_step} prompts x "
                              f"{c.group_size} completions ({c.completion_tokens} tokens), "
                              f"{algo.name}, {c.epochs} epochs at lr {c.lr:g}")
                for step in range(c.steps):
                    record = await self.rl_step(step, source, algo, trainer, task, publisher)
                    r.steps.append(record)
                    self.progress(
                        f"step {progress_bar(step + 1, c.steps)}  mean reward "
                        f"{record.mean_reward:+7.3f}  judge {record.judge_score:5.2f}  "
                        f"sync {record.sync_seconds * 1e3:6.1f} ms  policy v"
                        f"{record.policy_version}  rm v{record.rm_version}")
        finally:
            await policy.aclose()
        r.policy_version_after = r.steps[-1].policy_version if r.steps else None

    def requests(self, step: int, task: Any) -> list[Any]:
        """The step's rollout requests: ``prompts_per_step`` prompts, ``group_size`` episodes
        each, a seed per prompt (``VLLMChatClient`` samples a group in one call)."""
        from weightsync.reward.rollout_engine import RolloutRequest

        c = self.cfg.rlhf
        prompts = [task.prompts[(step * c.prompts_per_step + i) % len(task.prompts)]
                   for i in range(c.prompts_per_step)]
        return [RolloutRequest(
            prompt=p, num_episodes=c.group_size,
            sampling={"max_tokens": c.completion_tokens, "temperature": c.temperature,
                      "top_p": 1.0, "seed": c.seed * 100_003 + step * 1_009 + i},
            extra_body={"ignore_eos": True}) for i, p in enumerate(prompts)]

    async def rl_step(self, step: int, source: Any, algo: Any, trainer: Any, task: Any,
                      publisher: Any) -> StepRecord:
        """One Ludic-style trainer step: ``batch = await source.next_batch()`` (sample, score,
        assign credit), train on the batch's samples, ``publisher.publish(state_dict)``."""
        from weightsync.demo.policy import Sample

        t0 = time.perf_counter()
        batch = await source.next_batch()
        t1 = time.perf_counter()
        rollouts = batch.meta["rollouts"]
        samples = []
        for item, ro in zip(batch.items, rollouts, strict=True):
            cut = item.action_mask.index(1)
            samples.append(Sample(ro.steps[0].prev_obs, item.input_ids[:cut], ro.steps[0].action,
                                  item.input_ids[cut:], list(item.actor_logps or []),
                                  item.meta["policy_version"]))
        gap = trainer.max_logprob_gap(samples)  # the server sampled with the trainer's weights
        loss_first, loss_last = trainer.update(samples, [i.weight for i in batch.items],
                                               algo.loss, epochs=self.cfg.rlhf.epochs)
        t2 = time.perf_counter()
        stats = await asyncio.to_thread(publisher.publish, trainer.model.state_dict())
        t3 = time.perf_counter()
        rewards = [ro.meta["rm_score"] for ro in rollouts]
        mean = _mean(rewards)
        rm_versions = {ro.meta.get("rm_score_version") for ro in rollouts}
        sampled = set(batch.meta["policy_versions"])
        return StepRecord(
            step=step, mean_reward=mean, sync_seconds=t3 - t2,
            policy_version=stats.versions[0] if stats.versions else None,
            rm_version=rm_versions.pop() if len(rm_versions) == 1 else None,
            sampled_version=sampled.pop() if len(sampled) == 1 else None,
            reward_std=math.sqrt(_mean([(x - mean) ** 2 for x in rewards])),
            judge_score=_mean([task.judge(s.completion) for s in samples]),
            loss_first=loss_first, loss_last=loss_last, logprob_gap=gap,
            sync_bytes=int(stats.total_bytes), sample_seconds=t1 - t0,
            train_seconds=t2 - t1, step_seconds=t3 - t0)
