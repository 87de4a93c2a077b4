"""The toy task of the RLHF demo: a hidden judge that likes one letter, and preference pairs
labelled by it.

Used by ``weightsync demo`` (``weightsync.demo.rlhf``), ``examples/reward_model/`` and their
tests, in the trainer process; pure Python plus a tokenizer, no torch.

The "human" of this cold-start RLHF run is ``LetterTask.judge``: a completion is better the more
often it contains ``letter`` (default ``"e"``). The reward model never sees the rule, only
preference pairs the judge labelled. A freshly initialised tiny policy emits near-uniform random
tokens; about a fifth of its 512-token vocabulary contains an ``e``, so the completions of one
prompt differ in their counts and GRPO has a signal from the first step, and a few
policy-gradient steps shift probability toward those tokens, which the reward model (and the
judge) see as a rising mean reward.

Pairs are made like the policy's own samples (random token ids of the shared vocabulary,
decoded): each completion draws its tokens from the letter-containing ids with a probability
``q`` picked per completion from [0, 1], so the pairs span every count the policy can reach and
the reward model does not have to extrapolate as the policy improves. Ties are skipped.
Everything is a pure function of the seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Prompts the policy completes; each RL step takes ``prompts_per_step`` of them in turn.
PROMPTS = (
    "Say something nice.",
    "Write one line about the sea.",
    "Describe a tree.",
    "Tell me a secret.",
    "Name three colours.",
    "What did you eat today?",
    "Give me a motto.",
    "Finish this sentence:",
)


def scoring_text(prompt: str, completion: str) -> str:
    """The text the reward model scores: what ``weightsync.reward.rollout_text`` makes of a
    one-step rollout (``prev_obs`` = prompt, ``action`` = completion)."""
    return "\n".join(x for x in (prompt, completion) if x)


@dataclass(frozen=True, slots=True)
class LabelledPair:
    """One comparison for the reward model: ``chosen`` (a full scoring text) beats
    ``rejected`` for the judge."""

    prompt: str
    chosen: str
    rejected: str


@dataclass
class LetterTask:
    """The judge and the pair generator. ``tokenizer``: the policy's (the reward model shares
    the vocabulary; any HF tokenizer works). ``completion_tokens``: the length of a policy
    completion (and of the pairs' completions)."""

    tokenizer: Any
    letter: str = "e"
    completion_tokens: int = 16
    prompts: Sequence[str] = PROMPTS
    _with: list[int] = field(init=False, repr=False)
    _without: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.letter) != 1:
            raise ValueError(f"letter: must be one character, got {self.letter!r}")
        if self.completion_tokens < 1:
            raise ValueError(f"completion_tokens: must be >= 1, got {self.completion_tokens}")
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        ids = [i for i in range(len(self.tokenizer)) if i not in special]
        pieces = {i: self.tokenizer.decode([i]) for i in ids}
        self._with = [i for i in ids if self.letter in pieces[i]]
        self._without = [i for i in ids if self.letter not in pieces[i]]
        if not self._with or not self._without:
            raise ValueError(f"letter {self.letter!r}: the vocabulary has no tokens with (or "
                             "none without) it; pick another letter")

    @property
    def token_fraction(self) -> float:
        """The share of (non-special) vocabulary tokens that contain the letter: what a
        uniformly random policy emits."""
        return len(self._with) / (len(self._with) + len(self._without))

    def judge(self, completion: str) -> int:
        """The hidden preference: how often the letter occurs in the completion."""
        return completion.count(self.letter)

    def completion(self, rng: random.Random, density: float) -> str:
        """A completion of random tokens, each containing the letter with prob. ``density``."""
        ids = [rng.choice(self._with) if rng.random() < density else rng.choice(self._without)
               for _ in range(self.completion_tokens)]
        return self.tokenizer.decode(ids)

    def pairs(self, n: int, *, seed: int = 0) -> list[LabelledPair]:
        """``n`` judge-labelled pairs (two completions of one prompt, counts differ)."""
        rng = random.Random(seed)
        out: list[LabelledPair] = []
        while len(out) < n:
            prompt = rng.choice(list(self.prompts))
            a, b = self.completion(rng, rng.random()), self.completion(rng, rng.random())
            if self.judge(a) == self.judge(b):
                continue
            chosen, rejected = (a, b) if self.judge(a) > self.judge(b) else (b, a)
            out.append(LabelledPair(prompt, scoring_text(prompt, chosen),
                                    scoring_text(prompt, rejected)))
        return out

