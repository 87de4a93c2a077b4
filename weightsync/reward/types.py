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

from weightsync.naming import (  # noqa: F401 - re-exported: the reward package's names
    DEFAULT_HEAD_NAME_PATTERNS,
    compile_patterns,
    is_head_param,
    non_head_params,
)
from weightsync.types import TrainingMode
from weightsync.validation import training_mode_offenders  # noqa: F401 - re-exported

#: The reward spec's name for the core ``weightsync.types.TrainingMode`` (``head_only``,
#: ``lora``, ``full``): what the trainer updates, hence which names one weight sync may carry.
RewardModelTrainingMode = TrainingMode


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
    return compile_patterns(DEFAULT_HEAD_NAME_PATTERNS if patterns is None else patterns)


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
