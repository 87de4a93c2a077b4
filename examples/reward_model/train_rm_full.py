"""FULL: fine-tune every parameter of a reward model, sync the whole state dict.

    python examples/reward_model/train_rm_full.py [--rounds 2] [--short]
        [--reward-url URL --reward-model DIR] [--api-key K]

When to use it: the preference needs features the backbone does not have yet (new
computational paths, a distribution shift). Here the hidden judge of ``weightsync demo`` prefers
completions with more of the letter "e": counting it over a whole text is not a linear read-out
of a random backbone, so every weight trains (Bradley-Terry). Synchronous code throughout: the
reward design's blocking ``VLLMRewardClient.sync_weights(params, training_mode=FULL)`` returns
once the server serves the new weights (``last_sync_stats.versions``: the version it serves),
``score_batch_sync(..., normalize=False)`` scores (raw logits). Without ``--reward-url`` a reward
server is started (and stopped) here. The last line is ``REPORT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from urllib.parse import urlparse


def run(args: argparse.Namespace, url: str, model_dir: str) -> dict:
    from weightsync.demo.data import pairwise_accuracy
    from weightsync.demo.task import LetterTask
    from weightsync.demo.train import all_params, hf_scores, load_reward_model, train_full
    from weightsync.reward import VLLMRewardClient

    model, tok = load_reward_model(model_dir)
    task = LetterTask(tok, letter="e", completion_tokens=16)
    train = task.pairs(128 if args.short else 512, seed=0)
    held_out = task.pairs(64, seed=1)
    eval_texts = [p.chosen for p in held_out] + [p.rejected for p in held_out]

    host = urlparse(url)
    client = VLLMRewardClient(host.hostname, host.port, enable_weight_updates=True,
                              api_key=args.api_key)

    def served_accuracy() -> tuple[float, list[float]]:
        scores = client.score_batch_sync(eval_texts, normalize=False)
        n = len(held_out)
        return pairwise_accuracy(scores[:n], scores[n:]), scores

    report: dict = {"mode": "full", "rounds": []}
    try:
        report["accuracy_before"] = served_accuracy()[0]
        for i in range(args.rounds):
            fit = train_full(model, tok, [p.chosen for p in train], [p.rejected for p in train],
                             steps=25 if args.short else 75, lr=3e-3, batch_size=32, seed=i)
            client.sync_weights(all_params(model), training_mode="full")
            stats = client.last_sync_stats
            served_version = stats.versions[0]
            accuracy, served = served_accuracy()
            err = max(abs(a - b) for a, b in zip(served, hf_scores(model, tok, eval_texts),
                                                   strict=True))
            report["rounds"].append({"version": int(served_version), "bytes": stats.total_bytes,
                                     "tensors": stats.num_tensors, "loss": fit.loss_last,
                                     "served_accuracy": accuracy, "max_abs_err_vs_hf": err})
            print(f"synced {stats.num_tensors} tensors ({stats.total_bytes:,} bytes) in "
                  f"{stats.seconds * 1e3:.1f} ms -> version {served_version}: served accuracy "
                  f"{accuracy:.3f}, max |served - transformers| {err:.1e}")
    finally:
        client.close_sync()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short", action="store_true", help="a quick run (CI)")
    ap.add_argument("--reward-url"), ap.add_argument("--reward-model")
    ap.add_argument("--api-key", default=os.environ.get("WEIGHTSYNC_API_KEY"))
    args = ap.parse_args()
    if args.reward_url and not args.reward_model:
        ap.error("--reward-url needs --reward-model (the checkpoint that server runs)")

    import torch

    from weightsync.testing.servers import RewardServerProcess, started_or_attached
    from weightsync.testing.tiny_models import build_tiny_reward_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.reward_model or build_tiny_reward_model(f"{tmp}/rm")
        with started_or_attached([(RewardServerProcess, model_dir, args.reward_url)],
                                 scratch_dir=tmp, extra_args=["--max-model-len", "256"],
                                 progress=print) as (url,):
            report = run(args, url, model_dir)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
