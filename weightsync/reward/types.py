"""Reward-model types shared by the server, the client, the publisher and the scorer.

Plain data with validation and ``to_dict()`` / ``from_dict()`` in the reward server's wire
format, so the same classes check a request on the client before it is sent and on the server
when it arrives. Bad input raises ``ValueError`` naming the field. No torch, no vLLM here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

DEFAULT_HEAD_NAME_PATTERNS: tuple[str, ...] = ("score.", "classifier.", "v_head.")
"""Names of reward-head parameters (substring match; ``re:...`` for a regular expression).
Same defaults as ``HeadExtractorConfig.head_name_patterns``."""


class RewardModelTrainingMode(StrEnum):
    """What the trainer updates, and hence what one weight sync carries.

    HEAD_ONLY: only the reward head (``score.*``); backbone names are refused.
    LORA: merged backbone weights plus the head (adapters are merged before sending).
    FULL: every parameter may change; a sync must carry backbone weights.
    """

    HEAD_ONLY = "head_only"
    LORA = "lora"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any) -> RewardModelTrainingMode:
        """Accept a member or its value (case-insensitive); anything else names the choices."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for m in cls:
                if key in (m.value, m.name.lower()):
                    return m
        raise ValueError(
            f"training_mode must be one of {[m.value for m in cls]}, got {value!r}"
        )


class PoolingType(StrEnum):
    """How token states become one score, as vLLM's pooler names them.

    Sequence-level (usable for reward scores): LAST (decoder reward models, the HF default for
    ``*ForSequenceClassification``), MEAN, CLS (encoder models). Token-level: ALL, STEP
    (process reward models scoring each step).
    """

    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"
    ALL = "ALL"
    STEP = "STEP"

    @property
    def is_sequence_level(self) -> bool:
        return self in (PoolingType.LAST, PoolingType.MEAN, PoolingType.CLS)

    @classmethod
    def parse(cls, value: Any) -> PoolingType:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        raise ValueError(f"pooling_type must be one of {[m.value for m in cls]}, got {value!r}")


def compile_head_patterns(patterns: Iterable[str] | None = None) -> list[Any]:
    from weightsync.interfaces import compile_patterns

    return compile_patterns(DEFAULT_HEAD_NAME_PATTERNS if patterns is None else patterns)


def is_head_param(name: str, patterns: Iterable[str] | None = None) -> bool:
    """True when ``name`` matches one of the head patterns (default: score./classifier./v_head.)."""
    return any(p.search(name) for p in compile_head_patterns(patterns))


def non_head_params(names: Iterable[str], patterns: Iterable[str] | None = None) -> list[str]:
    """The names that are not head parameters (what a HEAD_ONLY update must not carry)."""
    compiled = compile_head_patterns(patterns)
    return [n for n in names if not any(p.search(n) for p in compiled)]


# --------------------------------------------------------------------------------------------
# Scoring request / response (POST /score)
# --------------------------------------------------------------------------------------------


@dataclass
class ScoringRequest:
    """Texts to score. A single string gives a one-element response.

    Wire form: ``{"model": str?, "input": str | [str], "use_activation": bool}``.
    ``use_activation=False`` (default) returns raw logits; True applies the model's activation
    (sigmoid for one label, softmax otherwise).
    """

    inputs: str | list[str]
    use_activation: bool = False
    model: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.inputs, str):
            pass
        elif isinstance(self.inputs, (list, tuple)):
            if len(self.inputs) == 0:
                raise ValueError("input: empty list; give at least one text to score")
            bad = [i for i, x in enumerate(self.inputs) if not isinstance(x, str)]
            if bad:
                kinds = sorted({type(self.inputs[i]).__name__ for i in bad})
                raise ValueError(
                    f"input: items must be strings; items {bad[:10]} are {', '.join(kinds)}"
                )
            self.inputs = list(self.inputs)
        else:
            raise ValueError(
                f"input: must be a string or a list of strings, got {type(self.inputs).__name__}"
            )
        if not isinstance(self.use_activation, bool):
            raise ValueError(
                f"use_activation: must be a boolean, got {type(self.use_activation).__name__}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model: must be a string, got {type(self.model).__name__}")

    @property
    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)

    def __len__(self) -> int:
        return len(self.texts)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"input": self.inputs, "use_activation": self.use_activation}
        if self.model is not None:
            d["model"] = self.model
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ScoringRequest:
        if not isinstance(d, dict):
            raise ValueError(f"request body must be a JSON object, got {type(d).__name__}")
        known = {"input", "inputs", "use_activation", "model"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; expected {sorted(known - {'inputs'})}")
        if "input" not in d and "inputs" not in d:
            raise ValueError("input: missing; give a string or a list of strings")
        return cls(
            inputs=d["input"] if "input" in d else d["inputs"],
            use_activation=d.get("use_activation", False),
            model=d.get("model"),
        )


Score = float | list[float]


@dataclass
class ScoringResponse:
    """Scores in input order: a float per text for one label, a list per text otherwise.

    ``version`` is the weight version that produced every score in this response;
    ``prompt_tokens`` is the real token count over all inputs.
    Wire form: ``{"model", "data": [{"index", "score"}], "usage": {"prompt_tokens"}, "version"}``.
    """

    scores: list[float] | list[list[float]]
    version: int
    prompt_tokens: int = 0
    model: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.scores, list):
            raise ValueError(f"scores: must be a list, got {type(self.scores).__name__}")
        multi = [isinstance(s, (list, tuple)) for s in self.scores]
        if any(multi) and not all(multi):
            raise ValueError("scores: mixes floats and lists; all must have the same n_labels")
        if any(multi):
            widths = {len(s) for s in self.scores}  # type: ignore[arg-type]
            if len(widths) != 1 or 0 in widths:
                raise ValueError(f"scores: lists of different or zero lengths {sorted(widths)}")
            self.scores = [[_as_float(x, "scores") for x in s] for s in self.scores]  # type: ignore[union-attr]
        else:
            self.scores = [_as_float(s, "scores") for s in self.scores]
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version: must be an int >= 0, got {self.version!r}")
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int):
            raise ValueError(f"prompt_tokens: must be an int, got {self.prompt_tokens!r}")

    @property
    def n_labels(self) -> int:
        if self.scores and isinstance(self.scores[0], list):
            return len(self.scores[0])
        return 1

    def __len__(self) -> int:
        return len(self.scores)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "data": [{"index": i, "score": s} for i, s in enumerate(self.scores)],
            "usage": {"prompt_tokens": self.prompt_tokens},
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ScoringResponse:
        if not isinstance(d, dict):
            raise ValueError(f"response must be a JSON object, got {type(d).__name__}")
        for key in ("data", "version"):
            if key not in d:
                raise ValueError(f"response: missing field {key!r}")
        data = d["data"]
        if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
            raise ValueError("data: must be a list of {index, score} objects")
        items = sorted(data, key=lambda x: int(x.get("index", 0)))
        if [int(x.get("index", -1)) for x in items] != list(range(len(items))):
            raise ValueError("data: indices must be 0..n-1")
        usage = d.get("usage") or {}
        return cls(
            scores=[x["score"] for x in items],
            version=d["version"],
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            model=str(d.get("model") or ""),
        )


def _as_float(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{what}: expected a number, got {type(x).__name__}")
    f = float(x)
    if math.isnan(f):
        raise ValueError(f"{what}: NaN score")
    return f


def flatten_scores(scores: Sequence[Score], label: int = 0) -> list[float]:
    """One float per text: the score itself for one label, column ``label`` otherwise."""
    return [s[label] if isinstance(s, list) else s for s in scores]


# --------------------------------------------------------------------------------------------
# Training-mode policy: which names one update may carry (checked before any byte moves)
# --------------------------------------------------------------------------------------------

_LORA_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude")


def _is_lora_name(name: str) -> bool:
    try:
        from weightsync.naming import is_lora_param
    except ImportError:  # pragma: no cover - naming ships with the package
        return any(f".{m}." in f".{name}." for m in _LORA_MARKERS)
    return bool(is_lora_param(name))


def training_mode_offenders(
    names: Sequence[str],
    mode: RewardModelTrainingMode | str,
    head_patterns: Iterable[str] | None = None,
    *,
    whole_update: bool = False,
) -> list[str]:
    """One line per name the training mode forbids (empty: allowed).

    HEAD_ONLY: only head parameters. LORA and FULL: no unmerged LoRA tensors. FULL with
    ``whole_update`` (the manifest of a whole update): at least one backbone parameter.
    Callers: engine-side loaders at ``validate`` / ``start_update``, the publisher, the client.
    """
    mode = RewardModelTrainingMode.parse(mode)
    patterns = DEFAULT_HEAD_NAME_PATTERNS if head_patterns is None else tuple(head_patterns)
    out = [
        f"{n}: an unmerged LoRA tensor; merge the adapters (lora_merge extractor) and send "
        f"engine weights"
        for n in names if _is_lora_name(n)
    ]
    if mode is RewardModelTrainingMode.HEAD_ONLY:
        out += [
            f"{n}: not a head parameter (head patterns {list(patterns)}); a head_only update "
            f"may carry only the reward head"
            for n in non_head_params(names, patterns) if not _is_lora_name(n)
        ]
    elif (
        mode is RewardModelTrainingMode.FULL and whole_update and names
        and not non_head_params(names, patterns)
    ):
        out.append(
            f"update carries only head parameters {sorted(names)[:5]}; full mode requires "
            f"backbone weights (use head_only when only the head is trained)"
        )
    return out
