"""A synthetic preference set whose preference is learnable from the text alone.

Used by ``weightsync demo``, its test and the examples; runs anywhere, downloads nothing.

Each pair shares a prompt; both responses are built from the same filler vocabulary and differ
only in the verdict word that closes them: the chosen one ends on a *positive* word (``great``,
``helpful`` ...), the rejected one on a *negative* word (``wrong``, ``sloppy`` ...). The two word
sets end on disjoint final letters, so whatever the byte-level tokenizer does, the last token,
which is the one a last-token-pooled reward head reads, tells them apart. A linear head on a
frozen random backbone can therefore learn the preference, while a freshly initialised head
scores the held-out pairs at about chance.

Everything is a pure function of the seed: the same seed gives the same pairs on any machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

POSITIVE_WORDS = ("great", "correct", "helpful", "clear", "honest", "excellent", "useful")
NEGATIVE_WORDS = ("bad", "wrong", "sloppy", "toxic", "lazy", "rude", "misleading")

_TOPICS = (
    "the weather", "a sorting algorithm", "the french revolution", "photosynthesis", "a tax form",
    "a broken bicycle", "prime numbers", "a recipe for bread", "the moon landing", "a job offer",
    "a python error", "the stock market", "a lost passport", "learning piano", "a noisy neighbour",
    "climate data", "a chess opening", "a wedding speech", "the tides", "a used car",
)
_ASKS = (
    "Can you explain {t}?", "What should I know about {t}?", "Help me with {t}.",
    "Give me a short note on {t}.", "Why does {t} matter?", "Summarise {t} for me.",
)
_FILLER = (
    "here is", "the answer", "about", "in short", "first", "then", "so", "it depends on",
    "the main point", "is that", "you can", "try to", "look at", "and", "because", "which",
    "means", "overall", "the key", "step", "result", "note that", "also", "finally",
)

# the answer ends with "Verdict: <word>"; disjoint final letters keep the last token distinct
_VERDICT = "Verdict:"


def _check_disjoint_endings() -> None:
    pos = {w[-1] for w in POSITIVE_WORDS}
    neg = {w[-1] for w in NEGATIVE_WORDS}
    if pos & neg:  # pragma: no cover - a guard for whoever edits the word lists
        raise AssertionError(f"positive and negative words share final letters {pos & neg}")


_check_disjoint_endings()


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """One comparison: ``chosen`` should score higher than ``rejected`` for ``prompt``."""

    prompt: str
    chosen: str
    rejected: str

    def chosen_text(self) -> str:
        return format_text(self.prompt, self.chosen)

    def rejected_text(self) -> str:
        return format_text(self.prompt, self.rejected)


def format_text(prompt: str, response: str) -> str:
    """The exact string the reward model scores (same on the trainer and the server)."""
    return f"Question: {prompt}\nAnswer: {response}"


def _response(rng: random.Random, topic: str, verdict: str) -> str:
    words = rng.sample(_FILLER, k=rng.randint(3, 6))
    return f"{' '.join(words)} {topic}. {_VERDICT} {verdict}"


def make_pairs(n: int, *, seed: int = 0) -> list[PreferencePair]:
    """``n`` pairs drawn from ``seed``; chosen and rejected share prompt and filler style."""
    if n < 1:
        raise ValueError(f"make_pairs: n must be >= 1, got {n}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        topic = rng.choice(_TOPICS)
        prompt = rng.choice(_ASKS).format(t=topic)
        chosen = _response(rng, topic, rng.choice(POSITIVE_WORDS))
        rejected = _response(rng, topic, rng.choice(NEGATIVE_WORDS))
        pairs.append(PreferencePair(prompt, chosen, rejected))
    return pairs


@dataclass(frozen=True, slots=True)
class PreferenceSplit:
    train: list[PreferencePair]
    eval: list[PreferencePair]


def make_preference_split(
    *, num_train: int = 256, num_eval: int = 64, seed: int = 0
) -> PreferenceSplit:
    """Train and held-out pairs from independent streams (no eval pair appears in train)."""
    train = make_pairs(num_train, seed=seed)
    seen = set(train)
    eval_pairs: list[PreferencePair] = []
    stream = 1
    while len(eval_pairs) < num_eval:
        for p in make_pairs(num_eval, seed=seed * 1_000_003 + stream):
            if p not in seen and len(eval_pairs) < num_eval:
                eval_pairs.append(p)
                seen.add(p)
        stream += 1
    return PreferenceSplit(train=train, eval=eval_pairs)


def pair_texts(pairs: list[PreferencePair]) -> tuple[list[str], list[str]]:
    """-> (chosen texts, rejected texts), aligned with ``pairs``."""
    return [p.chosen_text() for p in pairs], [p.rejected_text() for p in pairs]


def pairwise_accuracy(chosen_scores: list[float], rejected_scores: list[float]) -> float:
    """Fraction of pairs with chosen > rejected; a tie counts one half."""
    if len(chosen_scores) != len(rejected_scores) or not chosen_scores:
        raise ValueError(
            "pairwise_accuracy: need equally long, non-empty score lists, got "
            f"{len(chosen_scores)} and {len(rejected_scores)}"
        )
    total = 0.0
    for c, r in zip(chosen_scores, rejected_scores, strict=True):
        total += 1.0 if c > r else 0.5 if c == r else 0.0
    return total / len(chosen_scores)
