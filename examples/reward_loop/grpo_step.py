"""One GRPO step with verl's reward loop: a rule reward plus a reward model's score.

    python examples/reward_loop/grpo_step.py [--steps 1]
        [--reward-url URL --reward-model DIR] [--policy-url URL --policy-model DIR] [--api-key K]

On CPU with tiny models built in code (or the servers you give):

0. a right answer to each question is scored first, to show what the rule adds;
1. the policy server (``weightsync serve-policy``) samples a group of answers to each of a few
   GSM8K-style questions;
2. each answer is scored the moment its group comes back (standalone mode) by a
   ``RewardLoopManager`` with two ``RewardLoopWorker`` Ray actors, configured by
   ``gsm8k_hybrid.yaml`` beside this file: verl's GSM8K rule (1.0 for the right number after
   ``####``) weighted 1.0 plus the reward server's score weighted 0.5, the reward model asked
   through the router;
3. GRPO advantages per question (``GRPOAssigner``), a clipped policy-gradient step on the
   trainer's copy of the policy, and the front door pushes the new weights to the policy server.

Without URLs it starts both servers itself (about a minute on 2 cores, mostly their start-up).
The last line is ``REPORT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

GROUP_SIZE, ANSWER_TOKENS = 4, 16
QUESTIONS = [(a, b) for a, b in ((2, 3), (7, 5), (12, 9), (4, 4))]


def prompt(a: int, b: int) -> str:
    return f"Question: what is {a} + {b}? Think, then answer after '####'.\nAnswer:"


async def rollout_and_score(http, policy_url: str, model: str, tokenizer, manager, a: int,
                            b: int, *, seed: int) -> list[tuple]:
    """A group of answers to ``a + b``, each scored by the reward loop as soon as the group is
    back (standalone mode: the other groups are still being sampled)."""
    from weightsync.demo.policy import sample_group
    from weightsync.reward_loop import RewardBatch

    group = await sample_group(http, policy_url, model, prompt(a, b), n=GROUP_SIZE,
                               max_tokens=ANSWER_TOKENS, seed=seed)
    batch = RewardBatch.from_texts(
        tokenizer, [s.prompt for s in group], [s.completion for s in group],
        data_sources="openai/gsm8k", ground_truths=[str(a + b)] * len(group))
    scores = await asyncio.gather(*(manager.score_sample(batch[j:j + 1])
                                    for j in range(len(group))))
    return list(zip(group, scores, strict=True))


async def grpo(args: argparse.Namespace, manager, policy_url: str, policy_dir: str) -> dict:
    import httpx
    from transformers import AutoTokenizer

    import weightsync as ws
    from weightsync.demo.policy import PolicyTrainer, served_model_name
    from weightsync.reward import GRPOAssigner, PolicyLoss, Rollout, Step
    from weightsync.reward_loop import RewardBatch

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    trainer = PolicyTrainer(policy_dir, lr=1e-2)
    report: dict = {"steps": []}
    # what the rule adds: a right answer to each question, through the same reward loop
    right = RewardBatch.from_texts(
        tokenizer, [prompt(a, b) for a, b in QUESTIONS],
        [f" {a} + {b} = {a + b}.\n#### {a + b}" for a, b in QUESTIONS],
        data_sources="openai/gsm8k", ground_truths=[str(a + b) for a, b in QUESTIONS])
    report["right_answers"] = await asyncio.gather(*(manager.score_sample(right[j:j + 1])
                                                     for j in range(len(right))))
    for out in report["right_answers"]:
        info = out["reward_extra_info"]
        print(f"a right answer: rule {info['function_score']:.0f}, rm {info['rm_score']:+.4f} "
              f"-> reward {out['reward_score']:+.4f}")
    async with httpx.AsyncClient(timeout=120) as http, ws.connect(
            [policy_url], strategy="broadcast", api_key=args.api_key, device="cpu") as sync:
        model = await served_model_name(http, policy_url)
        for step in range(args.steps):
            scored = [x for g in await asyncio.gather(*(
                rollout_and_score(http, policy_url, model, tokenizer, manager, a, b,
                                  seed=100 * step + i)
                for i, (a, b) in enumerate(QUESTIONS))) for x in g]
            rollouts = [Rollout(f"{step}-{k}", [Step(0, s.prompt, s.completion,
                                                     reward=out["reward_score"])],
                                {"initial_obs": s.prompt}) for k, (s, out) in enumerate(scored)]
            credit = GRPOAssigner(group_size=GROUP_SIZE).compute(rollouts)
            advantages = [credit[(r.id, 0)] for r in rollouts]
            samples = [s for s, _ in scored]
            first, last = trainer.update(samples, advantages, PolicyLoss("clipped_surrogate"),
                                         epochs=2)
            stats = await sync.push(trainer.model)
            rows = [{"answer": s.completion, "rule": out["reward_extra_info"]["function_score"],
                     "rm": out["reward_extra_info"]["rm_score"], "reward": out["reward_score"],
                     "advantage": adv}
                    for (s, out), adv in zip(scored, advantages, strict=True)]
            for r in rows[:GROUP_SIZE]:
                print(f"  {r['answer'][:40]!r:44} rule {r['rule']:.0f}  rm {r['rm']:+.4f}  "
                      f"reward {r['reward']:+.4f}  advantage {r['advantage']:+.3f}")
            print(f"step {step}: {len(rows)} answers, mean reward "
                  f"{sum(r['reward'] for r in rows) / len(rows):+.4f}, loss {first:+.4f} -> "
                  f"{last:+.4f}, policy server now at version {stats.versions[0]}")
            report["steps"].append({"rows": rows, "loss": [first, last],
                                    "sampled_version": samples[0].version,
                                    "policy_version": stats.versions[0]})
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1, help="GRPO steps (default 1)")
    ap.add_argument("--reward-url"), ap.add_argument("--reward-model")
    ap.add_argument("--policy-url"), ap.add_argument("--policy-model")
    ap.add_argument("--api-key", default=os.environ.get("WEIGHTSYNC_API_KEY"))
    args = ap.parse_args()
    for kind in ("reward", "policy"):
        if getattr(args, f"{kind}_url") and not getattr(args, f"{kind}_model"):
            ap.error(f"--{kind}-url needs --{kind}-model (the checkpoint that server runs)")

    import ray
    import torch

    from weightsync.reward_loop import RewardLoopManager, reward_loop_config
    from weightsync.testing.servers import (
        PolicyServerProcess,
        RewardServerProcess,
        started_or_attached,
    )
    from weightsync.testing.tiny_models import build_tiny_causal_lm, build_tiny_reward_model

    torch.set_num_threads(1)  # the servers need the other cores
    with tempfile.TemporaryDirectory() as tmp:
        rm_dir = args.reward_model or build_tiny_reward_model(f"{tmp}/rm")
        policy_dir = args.policy_model or build_tiny_causal_lm(f"{tmp}/policy", family="llama")
        with started_or_attached(
            [(RewardServerProcess, rm_dir, args.reward_url),
             (PolicyServerProcess, policy_dir, args.policy_url)],
            scratch_dir=tmp, extra_args=["--max-model-len", "256"], progress=print,
        ) as (reward_url, policy_url):
            config = reward_loop_config(str(Path(__file__).with_name("gsm8k_hybrid.yaml")))
            config.actor_rollout_ref.model.path = policy_dir
            config.reward_model.model.path = rm_dir
            config.reward_model.server_urls = [reward_url]
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            manager = RewardLoopManager(config)
            try:
                report = asyncio.run(grpo(args, manager, policy_url, policy_dir))
            finally:
                manager.shutdown()
                ray.shutdown()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
