"""HEAD_ONLY: train a reward model's linear head on a frozen backbone, publish only the head.

    python examples/reward_model/train_rm_head_only.py [--rounds 2] [--short]
        [--strategy broadcast|packed_cuda_ipc] [--reward-url URL --reward-model DIR] [--api-key K]

When to use it: the preference is a salient, linearly separable feature of the backbone's last
hidden state (here: the verdict word that ends each answer). The trainer caches the pooled
features once (the backbone does not change), trains ``score.weight`` with a Bradley-Terry
loss, and after each round ``RewardModelPublisher.publish(..., training_mode=HEAD_ONLY)`` sends
the 256-byte head; the reward server's version rises by one per round and its scores equal
transformers'. Without ``--reward-url`` a reward server is started (and stopped) here. The last
line is ``REPORT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from urllib.parse import urlparse


def run(args: argparse.Namespace, url: str, model_dir: str) -> dict:
    from weightsync.demo.data import make_preference_split, pair_texts, pairwise_accuracy
    from weightsync.demo.train import (
        head_params,
        hf_scores,
        load_reward_model,
        pooled_features,
        train_head,
    )
    from weightsync.reward import VLLMRewardClient, create_reward_publisher

    # trainer side: the same checkpoint in transformers, synthetic preferences
    model, tok = load_reward_model(model_dir)
    data = make_preference_split(num_train=128 if args.short else 256, num_eval=64)
    train_c, train_r = pair_texts(data.train)
    eval_c, eval_r = pair_texts(data.eval)
    feats_c = pooled_features(model, tok, train_c)  # frozen backbone: computed once
    feats_r = pooled_features(model, tok, train_r)

    host = urlparse(url)
    client = VLLMRewardClient(host.hostname, host.port, enable_weight_updates=True,
                              api_key=args.api_key,
                              strategy=None if args.strategy == "broadcast" else {"type": args.strategy})
    publisher = create_reward_publisher(client)  # the reward design's publisher API

    def served_accuracy() -> tuple[float, list[float]]:
        scores = client.score_batch_sync(eval_c + eval_r, normalize=False)  # raw logits
        return pairwise_accuracy(scores[: len(eval_c)], scores[len(eval_c):]), scores

    report: dict = {"mode": "head_only", "rounds": []}
    try:
        report["accuracy_before"] = served_accuracy()[0]
        for _ in range(args.rounds):
            fit = train_head(model, feats_c, feats_r, steps=50 if args.short else 100, lr=1e-2)
            stats = publisher.publish(head_params(model), training_mode="head_only")
            accuracy, served = served_accuracy()
            err = max(abs(a - b) for a, b in zip(served, hf_scores(model, tok, eval_c + eval_r),
                                                   strict=True))
            report["rounds"].append({"version": stats.versions[0], "bytes": stats.total_bytes,
                                     "tensors": stats.num_tensors, "loss": fit.loss_last,
                                     "served_accuracy": accuracy, "max_abs_err_vs_hf": err})
            print(f"published {stats.total_bytes} bytes in {stats.seconds * 1e3:.1f} ms -> "
                  f"version {stats.versions[0]}: served accuracy {accuracy:.3f}, "
                  f"max |served - transformers| {err:.1e}")
    finally:
        client.close_sync()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short", action="store_true", help="a quick run (CI)")
    ap.add_argument("--strategy", default="broadcast", choices=("broadcast", "packed_cuda_ipc"))
    ap.add_argument("--reward-url"), ap.add_argument("--reward-model")
    ap.add_argument("--api-key", default=os.environ.get("WEIGHTSYNC_API_KEY"))
    args = ap.parse_args()
    if args.reward_url and not args.reward_model:
        ap.error("--reward-url needs --reward-model (the checkpoint that server runs)")

    import torch

    from weightsync.testing.servers import RewardServerProcess, started_or_attached
    from weightsync.testing.tiny_models import build_tiny_reward_model

    torch.set_num_threads(1)  # leave the other core to the server
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.reward_model or build_tiny_reward_model(f"{tmp}/rm")
        with started_or_attached([(RewardServerProcess, model_dir, args.reward_url)],
                                 scratch_dir=tmp, extra_args=["--max-model-len", "256"],
                                 progress=print) as (url,):
            report = run(args, url, model_dir)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
