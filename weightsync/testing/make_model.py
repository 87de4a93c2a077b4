"""``weightsync make-model``: write a tiny policy or reward model to serve, offline.

    weightsync make-model --kind policy ./tiny-policy    # a *ForCausalLM: weightsync serve-policy
    weightsync make-model --kind reward ./tiny-reward    # a *ForSequenceClassification: serve-reward

Called by the ``weightsync`` dispatcher (``main(argv)``), in the user's process. Builds the
model with ``weightsync.testing.tiny_models`` (random fp32 weights, a 512-token byte-level BPE
tokenizer trained in code, a chat template so ``/v1/chat/completions`` works), saves it with
``save_pretrained`` and prints what it wrote and the command that serves it. Nothing is
downloaded. Exit 0 on success, 2 for bad arguments or a directory that already holds a model
(``--force`` replaces it).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

KINDS = ("policy", "reward")


@dataclass(frozen=True)
class Kind:
    """What each ``--kind`` writes and which server serves it."""

    summary: str
    serve: str  # the command line that serves it, {dir} and {max_len} filled in


_KINDS = {
    "policy": Kind("a causal LM (*ForCausalLM)",
                   "weightsync serve-policy --model {dir} --max-model-len {max_len}"),
    "reward": Kind("a reward model (*ForSequenceClassification, {num_labels} label(s))",
                   "weightsync serve-reward --model {dir} --max-model-len {max_len}"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightsync make-model",
        description="Write a tiny model with random weights, a tokenizer and a chat template "
        "to DIR, offline (nothing is downloaded), ready for weightsync serve-policy (--kind "
        "policy) or weightsync serve-reward (--kind reward).",
    )
    p.add_argument("dir", metavar="DIR", help="directory to write (created if missing)")
    p.add_argument("--kind", choices=KINDS, required=True,
                   help="policy: a causal LM for serve-policy; reward: a sequence classifier "
                        "for serve-reward (required)")
    p.add_argument("--family", choices=("qwen2", "llama"), default="qwen2",
                   help="model architecture (default qwen2)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights (default 0; the tokenizer is the same for "
                        "every seed)")
    p.add_argument("--hidden-size", type=int, default=64,
                   help="hidden size; with 2 attention heads, head size = hidden/2 must be >= "
                        "32 (default 64)")
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--max-position-embeddings", type=int, default=512,
                   help="longest sequence the model takes, in tokens; serve it with "
                        "--max-model-len at most this (default 512)")
    p.add_argument("--num-labels", type=int, default=1,
                   help="--kind reward: scores per sequence (default 1)")
    p.add_argument("--force", action="store_true",
                   help="replace a model already in DIR (default: refuse)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``weightsync make-model ARGS`` -> exit code (0 written, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if os.path.exists(os.path.join(args.dir, "config.json")) and not args.force:
        parser.error(f"{args.dir} already holds a model (config.json); choose another DIR or "
                     f"pass --force to replace it")
    if args.kind == "policy" and args.num_labels != 1:
        parser.error("--num-labels: only for --kind reward")
    from weightsync.testing import tiny_models

    tiny_models.quiet_deepspeed_probe()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for a 200 KB file
    shape = dict(family=args.family, seed=args.seed, hidden_size=args.hidden_size,
                 num_layers=args.num_layers, max_position_embeddings=args.max_position_embeddings)
    try:
        if args.kind == "policy":
            # untied: with tied embeddings a random model's greedy answer repeats the prompt's
            # last token whatever its weights, so a push would change nothing one can see
            path = tiny_models.build_tiny_causal_lm(args.dir, **shape)
        else:
            path = tiny_models.build_tiny_reward_model(args.dir, num_labels=args.num_labels,
                                                       **shape)
    except ValueError as e:  # a shape vLLM's CPU backend cannot serve, named by the builder
        parser.error(str(e))
    kind = _KINDS[args.kind]
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    print(f"wrote {kind.summary.format(num_labels=args.num_labels)} to {path}: {args.family}, "
          f"hidden {args.hidden_size}, {args.num_layers} layers, {size / 1e3:.0f} KB of fp32 "
          f"weights (seed {args.seed}), a {args.max_position_embeddings}-token context, "
          f"a byte-level BPE tokenizer with a chat template")
    print("serve it: " + kind.serve.format(dir=path, max_len=args.max_position_embeddings))
    return 0
