"""Cold-start RLHF: train a reward model on preferences, then train a policy against it.

    python examples/reward_model/cold_start_rlhf.py [--steps 10] [--short]
        [--reward-url URL --reward-model DIR] [--policy-url URL --policy-model DIR] [--api-key K]

The loop of ``weightsync demo`` as one readable script, on CPU with tiny models built in code:

1. a reward model learns, from pairs a hidden judge labelled, that more of the letter "e" is
   better (Bradley-Terry, full fine-tune), and is pushed to a vLLM reward server;
2. every step, a vLLM policy server (``weightsync serve-policy``) samples a group of
   completions per prompt, the reward server scores them, ``make_grpo_with_rm`` turns the scores
   into GRPO advantages, the trainer's copy of the policy takes a few clipped policy-gradient
   steps, and the front door (``ws.connect(...).push``) sends the new policy back.

Without URLs it starts both servers itself (a few minutes on 2 cores, mostly their start-up);
``--reward-url`` / ``--policy-url`` use servers already running on the checkpoints given with
``--reward-model`` / ``--policy-model``. The last line is ``REPORT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from urllib.parse import urlparse

PROMPTS_PER_STEP, GROUP_SIZE, COMPLETION_TOKENS = 4, 8, 16


async def rlhf(args: argparse.Namespace, reward_url: str, policy_url: str, rm_dir: str,
               policy_dir: str) -> dict:
    import httpx

    import weightsync as ws
    from weightsync.demo.policy import PolicyTrainer, sample_group, served_model_name
    from weightsync.demo.task import LetterTask
    from weightsync.demo.train import all_params, load_reward_model, train_full
    from weightsync.reward import Rollout, Step, VLLMRewardClient, make_grpo_with_rm
    from weightsync.testing.tiny_models import build_tokenizer

    report: dict = {"steps": []}
    task = LetterTask(build_tokenizer(), letter="e", completion_tokens=COMPLETION_TOKENS)

    # 1. the reward model: judge-labelled pairs -> Bradley-Terry -> push to the reward server
    pairs = task.pairs(128 if args.short else 512, seed=0)
    rm, tok = load_reward_model(rm_dir)
    fit = train_full(rm, tok, [p.chosen for p in pairs], [p.rejected for p in pairs],
                     steps=40 if args.short else 150, lr=3e-3, batch_size=32)
    print(f"reward model: loss {fit.loss_first:.3f} -> {fit.loss_last:.3f} in {fit.seconds:.1f}s")
    reward = urlparse(reward_url)
    rm_client = VLLMRewardClient(reward.hostname, reward.port, enable_weight_updates=True,
                                 api_key=args.api_key)
    async with rm_client, httpx.AsyncClient(timeout=120) as http:
        report["rm_version_before"] = await rm_client.get_model_version()
        await rm_client.sync_weights_async(all_params(rm), training_mode="full")
        served = rm_client.last_sync_stats.versions[0]
        report["rm_version_after"] = int(served)
        print(f"reward server now serves version {served}")

        # 2. the RL loop
        algo = make_grpo_with_rm(group_size=GROUP_SIZE, mode="replace")
        scorer = algo.make_scorer(rm_client)
        trainer = PolicyTrainer(policy_dir, lr=2e-2)
        model_name = await served_model_name(http, policy_url)
        async with ws.connect([policy_url], strategy="broadcast", api_key=args.api_key,
                              device="cpu") as policy_sync:
            for step in range(args.steps):
                prompts = [task.prompts[(step * PROMPTS_PER_STEP + i) % len(task.prompts)]
                           for i in range(PROMPTS_PER_STEP)]
                groups = await asyncio.gather(*(
                    sample_group(http, policy_url, model_name, p, n=GROUP_SIZE,
                                 max_tokens=COMPLETION_TOKENS, seed=1000 * step + i)
                    for i, p in enumerate(prompts)))
                samples = [s for g in groups for s in g]
                rollouts = [Rollout(f"{step}-{i}", [Step(0, s.prompt, s.completion)],
                                    {"initial_obs": s.prompt}) for i, s in enumerate(samples)]
                await scorer.score(rollouts)                       # rollout.meta["rm_score"]
                credit = algo.credit_assigner.compute(rollouts)    # GRPO advantages
                gap = trainer.max_logprob_gap(samples)  # the server sampled with our weights
                trainer.update(samples, [credit[(r.id, 0)] for r in rollouts], algo.loss,
                               epochs=4)
                stats = await policy_sync.push(trainer.model)      # the policy server: v + 1
                mean = sum(r.meta["rm_score"] for r in rollouts) / len(rollouts)
                judge = sum(task.judge(s.completion) for s in samples) / len(samples)
                report["steps"].append({
                    "step": step, "mean_reward": mean, "judge_score": judge,
                    "sync_seconds": stats.seconds, "policy_version": stats.versions[0],
                    "sampled_version": samples[0].version, "logprob_gap": gap,
                    "rm_version": rollouts[0].meta["rm_score_version"]})
                print(f"step {step}: mean reward {mean:+.3f}, judge {judge:.2f}, policy "
                      f"v{stats.versions[0]} (sync {stats.seconds * 1e3:.1f} ms)")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="RL steps (10; --short: 3)")
    ap.add_argument("--short", action="store_true", help="a quick run (CI)")
    ap.add_argument("--reward-url"), ap.add_argument("--reward-model")
    ap.add_argument("--policy-url"), ap.add_argument("--policy-model")
    ap.add_argument("--api-key", default=os.environ.get("WEIGHTSYNC_API_KEY"))
    args = ap.parse_args()
    args.steps = args.steps or (3 if args.short else 10)
    for kind in ("reward", "policy"):
        if getattr(args, f"{kind}_url") and not getattr(args, f"{kind}_model"):
            ap.error(f"--{kind}-url needs --{kind}-model (the checkpoint that server runs)")

    import torch

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
        with started_or_attached(  # both start at once; stopped on any exit
            [(RewardServerProcess, rm_dir, args.reward_url),
             (PolicyServerProcess, policy_dir, args.policy_url)],
            scratch_dir=tmp, extra_args=["--max-model-len", "256"], progress=print,
        ) as (reward_url, policy_url):
            report = asyncio.run(rlhf(args, reward_url, policy_url, rm_dir, policy_dir))
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
