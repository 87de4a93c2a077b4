"""LORA: train LoRA adapters and the head of a reward model, publish the merged weights.

    python examples/reward_model/train_rm_lora.py [--rounds 2] [--short]
        [--reward-url URL --reward-model DIR] [--api-key K]

When to use it: the feature the preference needs is in the backbone but not linearly readable
from its last hidden state; low-rank adapters correct the geometry at a fraction of a full
fine-tune's optimizer memory. PEFT wraps the model (adapters on the attention projections, the
``score`` head fully trainable via ``modules_to_save``); after each round
``RewardModelPublisher.publish(peft_model, training_mode=LORA)`` merges ``W + scale * B @ A`` on
the way (the trainer's adapters stay as they are, training goes on) and sends the merged
backbone and the head under the base model's names. The served scores equal the PEFT model's
forward. Without ``--reward-url`` a reward server is started (and stopped) here. The last line
is ``REPORT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from urllib.parse import urlparse


def bradley_terry_round(model, tok, chosen, rejected, *, steps: int, lr: float, opt=None):
    """A few Adam steps of -log sigmoid(r_chosen - r_rejected) on the trainable parameters."""
    import torch

    from weightsync.demo.train import bradley_terry_loss

    params = [p for p in model.parameters() if p.requires_grad]
    opt = opt or torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(chosen), (16,), generator=gen).tolist()
        enc = tok([chosen[i] for i in idx] + [rejected[i] for i in idx], return_tensors="pt",
                  padding=True)
        r = model(**enc).logits[:, 0]
        loss = bradley_terry_loss(r[:16], r[16:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return opt, float(loss)


def run(args: argparse.Namespace, url: str, model_dir: str) -> dict:
    from peft import LoraConfig, get_peft_model

    from weightsync.demo.data import make_preference_split, pair_texts, pairwise_accuracy
    from weightsync.demo.train import hf_scores, load_reward_model
    from weightsync.reward import VLLMRewardClient, create_reward_publisher

    base, tok = load_reward_model(model_dir)
    model = get_peft_model(base, LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        modules_to_save=["score"], task_type="SEQ_CLS"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"PEFT model: {trainable:,} of {total:,} parameters trainable (adapters + head)")
    data = make_preference_split(num_train=128 if args.short else 256, num_eval=64)
    train_c, train_r = pair_texts(data.train)
    eval_c, eval_r = pair_texts(data.eval)

    host = urlparse(url)
    client = VLLMRewardClient(host.hostname, host.port, enable_weight_updates=True,
                              api_key=args.api_key)
    publisher = create_reward_publisher(client)

    def served_accuracy() -> tuple[float, list[float]]:
        scores = client.score_batch_sync(eval_c + eval_r, normalize=False)
        return pairwise_accuracy(scores[: len(eval_c)], scores[len(eval_c):]), scores

    report: dict = {"mode": "lora", "trainable": trainable, "rounds": []}
    opt = None
    try:
        report["accuracy_before"] = served_accuracy()[0]
        for _ in range(args.rounds):
            opt, loss = bradley_terry_round(model, tok, train_c, train_r, lr=3e-3, opt=opt,
                                            steps=15 if args.short else 40)
            stats = publisher.publish(model, training_mode="lora")  # merged on the way
            accuracy, served = served_accuracy()
            err = max(abs(a - b) for a, b in zip(served, hf_scores(model, tok, eval_c + eval_r),
                                                   strict=True))
            report["rounds"].append({"version": stats.versions[0], "bytes": stats.total_bytes,
                                     "tensors": stats.num_tensors, "loss": loss,
                                     "served_accuracy": accuracy, "max_abs_err_vs_hf": err})
            print(f"published {stats.num_tensors} merged tensors ({stats.total_bytes:,} bytes) "
                  f"-> version {stats.versions[0]}: served accuracy {accuracy:.3f}, "
                  f"max |served - PEFT forward| {err:.1e}")
        report["lora_tensors_still_in_model"] = sum(
            "lora_" in n for n, _ in model.named_parameters())
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
