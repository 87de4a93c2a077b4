"""Train a reward model's head in the trainer, publish it to a vLLM reward server, score again.

    python examples/train_reward_head_only.py [--strategy broadcast|packed_cuda_ipc] [--rounds 2]

The shape of a head-only reward-model loop in RL post-training, on CPU with a tiny model:
the trainer owns a transformers copy of the reward model; the reward server (vLLM) scores
rollouts; after each training round only ``score.weight`` travels to the server, through a
weightsync strategy, and the server's version goes up by one.
(`weightsync demo` is the same loop with checks and a report.)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile


async def main(strategy: str, rounds: int) -> None:
    import torch

    from weightsync.demo.data import make_preference_split, pair_texts, pairwise_accuracy
    from weightsync.demo.server import RewardServerProcess, free_port, signals_raise_system_exit
    from weightsync.demo.train import head_params, load_reward_model, pooled_features, train_head
    from weightsync.reward.client import VLLMRewardClient
    from weightsync.reward.types import RewardModelTrainingMode
    from weightsync.testing.tiny_models import build_tiny_reward_model

    torch.set_num_threads(1)  # leave the other core to the server
    with tempfile.TemporaryDirectory() as tmp:
        # 1. a reward model (random weights, offline tokenizer) and a server for it
        model_dir = build_tiny_reward_model(f"{tmp}/rm")
        with signals_raise_system_exit(), RewardServerProcess(  # stopped on any exit, SIGTERM too
            model_dir, scratch_dir=tmp, extra_args=["--max-model-len", "256"]
        ) as server:
            # 2. trainer side: the same model in transformers, preference data
            model, tok = load_reward_model(model_dir)
            data = make_preference_split(num_train=256, num_eval=64)
            train_c, train_r = pair_texts(data.train)
            eval_c, eval_r = pair_texts(data.eval)
            feats_c = pooled_features(model, tok, train_c)  # frozen backbone: compute once
            feats_r = pooled_features(model, tok, train_r)

            server.wait_healthy(progress=print)
            client = VLLMRewardClient(
                server.host, server.port, group_port=free_port(), enable_weight_updates=True,
                strategy=None if strategy == "broadcast" else {"type": strategy},
            )

            async def served_accuracy() -> float:
                scores = await client.score_batch(eval_c + eval_r)  # one float per text
                return pairwise_accuracy(scores[: len(eval_c)], scores[len(eval_c) :])

            async with client:  # closes the weight-sync group and HTTP connections
                version = await client.get_model_version()
                print(f"version {version}: served accuracy {await served_accuracy():.3f}")
                for _ in range(rounds):
                    # 3. train the head (Bradley-Terry), 4. publish it, 5. score with it
                    train_head(model, feats_c, feats_r, steps=100, lr=1e-2)
                    await client.sync_weights_async(
                        head_params(model), training_mode=RewardModelTrainingMode.HEAD_ONLY
                    )
                    stats = client.last_sync_stats
                    print(
                        f"synced {stats.total_bytes} bytes in {stats.seconds * 1e3:.1f} ms -> "
                        f"version {await client.get_model_version()}: "
                        f"served accuracy {await served_accuracy():.3f}"
                    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="broadcast", choices=("broadcast", "packed_cuda_ipc"))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    asyncio.run(main(args.strategy, args.rounds))
