"""Reward-model types shared by the server, the client, the publisher and the scorer.

Plain data with validation and ``to_dict()`` / ``from_dict()`` in the reward server's wire
format, so the same classes check a request on the client before it is sent and on the server
when it arrives. Bad input raises ``ValueError`` naming the field. No torch, no vLLM here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
    """How token states become scores, spelled as the reward plan spells them (``"last"``).

    Sequence-level (one score per text): LAST (decoder reward models, the HF default for
    ``*ForSequenceClassification``), MEAN, CLS (encoder models). Token-level (a list per text):
    ALL (every token), STEP (the tokens equal to a step tag: process reward models scoring
    each step). vLLM's pooler config spells the same names in upper case (``vllm_name``).
    """

    LAST = "last"
    MEAN = "mean"
    CLS = "cls"
    ALL = "all"
    STEP = "step"

    @property
    def is_sequence_level(self) -> bool:
        return self in (PoolingType.LAST, PoolingType.MEAN, PoolingType.CLS)

    @property
    def vllm_name(self) -> str:
        """vLLM's ``PoolerConfig`` spelling: ``"LAST"``, ``"STEP"``, ..."""
        return self.value.upper()

    @classmethod
    def parse(cls, value: Any) -> PoolingType:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().lower() in cls._value2member_map_:
            return cls(value.strip().lower())
        raise ValueError(
            f"pooling_type must be one of {[m.value for m in cls]} (any case), got {value!r}"
        )


def compile_head_patterns(patterns: Iterable[str] | None = None) -> list[Any]:
    return compile_patterns(DEFAULT_HEAD_NAME_PATTERNS if patterns is None else patterns)


# --------------------------------------------------------------------------------------------
# Scoring request / response (POST /score)
# --------------------------------------------------------------------------------------------


#: The model name the reward design's client sends by default; the reward server answers to it
#: as well as to its served name.
DEFAULT_MODEL_NAME = "reward-model"

_REQUEST_FIELDS = ("input", "model", "normalize", "use_activation", "pooling_type",
                   "return_hidden_states", "n_labels", "step_tag", "step_tag_id")


@dataclass(frozen=True)
class ScoringRequest:
    """Texts to score (``POST /score``). A single string gives a one-element response.

    The reward plan's fields, order and defaults (``model, inputs, pooling_type="last",
    normalize=True, n_labels=1``), plus the spec's ``return_hidden_states=False``:

    - ``model``: the served name (or the design's ``"reward-model"``, which every reward server
      answers to); None scores with whatever model the server serves. ``inputs`` (wire:
      ``input``): required.
    - ``pooling_type``: ``last`` / ``mean`` / ``cls`` per request (the server pools the head's
      per-token outputs itself when the engine was started with another sequence pooling);
      ``step`` / ``all`` for per-step / per-token scores; None: the server's own pooling (what
      a wire request without the field gets).
    - ``normalize``: apply the model's activation (sigmoid for one label, softmax otherwise);
      False returns the raw logits, what transformers computes.
    - ``n_labels``: how many labels the caller expects. 1 (the default) accepts any model, as
      the reference server does; a value > 1 is checked against the model's.
    - ``return_hidden_states``: accepted; the answer has no hidden states (``hidden_states`` is
      None, as the reference's: vLLM's classification pooler returns only the head's outputs).

    Ours, for ``pooling_type="step"`` (process rewards: one score per step, at every position
    of a step-tag token): ``step_tag`` (the tag text; the server resolves it with its tokenizer
    and refuses a tag that is not exactly one token) or ``step_tag_id`` (vLLM's name: the
    token id). Neither: the server's configured tag. The wire also takes ``use_activation``
    (vLLM's name for ``normalize``); given both, they must agree.
    """

    model: str | None = None
    inputs: str | list[str] | None = None
    pooling_type: PoolingType | str | None = PoolingType.LAST
    normalize: bool = True
    n_labels: int | None = 1
    return_hidden_states: bool = False
    step_tag: str | None = None
    step_tag_id: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _validate(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(
                f"model: must be a string, got {type(self.model).__name__} (the texts go in "
                f"inputs=: ScoringRequest(model, inputs) or ScoringRequest(inputs=[...]))"
            )
        if self.inputs is None:
            raise ValueError("input: missing; give a string or a list of strings (inputs=)")
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
            self._set("inputs", list(self.inputs))
        else:
            raise ValueError(
                f"input: must be a string or a list of strings, got {type(self.inputs).__name__}"
            )
        for name in ("normalize", "return_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name}: must be a boolean, got {type(getattr(self, name)).__name__}"
                )
        if self.pooling_type is not None:
            self._set("pooling_type", PoolingType.parse(self.pooling_type))
        if self.n_labels is not None and (
            isinstance(self.n_labels, bool) or not isinstance(self.n_labels, int)
            or self.n_labels < 1
        ):
            raise ValueError(f"n_labels: must be an int >= 1, got {self.n_labels!r}")
        if self.step_tag is not None and (not isinstance(self.step_tag, str) or not self.step_tag):
            raise ValueError(f"step_tag: must be a non-empty string, got {self.step_tag!r}")
        if self.step_tag_id is not None and (
            isinstance(self.step_tag_id, bool) or not isinstance(self.step_tag_id, int)
            or self.step_tag_id < 0
        ):
            raise ValueError(f"step_tag_id: must be a token id (int >= 0), got {self.step_tag_id!r}")
        if (self.step_tag is not None or self.step_tag_id is not None) and (
            self.pooling_type is not PoolingType.STEP
        ):
            given = "step_tag" if self.step_tag is not None else "step_tag_id"
            pooling = self.pooling_type.value if self.pooling_type else None
            raise ValueError(f"{given}: only with pooling_type='step', got pooling_type="
                             f"{pooling!r}")

    @property
    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs or [])

    def __len__(self) -> int:
        return len(self.texts)

    def checked_labels(self) -> int | None:
        """The label count the server must check: None for the default 1 (any model)."""
        return self.n_labels if self.n_labels is not None and self.n_labels > 1 else None

    def to_dict(self) -> dict[str, Any]:
        """The wire body: the reference client's ``{model, input, pooling_type, normalize}``
        plus the optional fields that differ from their defaults."""
        d: dict[str, Any] = {"input": self.inputs, "normalize": self.normalize}
        if self.model is not None:
            d["model"] = self.model
        if self.pooling_type is not None:
            d["pooling_type"] = PoolingType.parse(self.pooling_type).value
        if self.return_hidden_states:
            d["return_hidden_states"] = True
        if self.checked_labels() is not None:
            d["n_labels"] = self.n_labels
        for name in ("step_tag", "step_tag_id"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ScoringRequest:
        """A wire body; a field left out means the server's choice (``pooling_type``: its own
        pooling) or the design's default."""
        if not isinstance(d, dict):
            raise ValueError(f"request body must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_REQUEST_FIELDS) - {"inputs"})
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; expected {list(_REQUEST_FIELDS)}")
        if "input" not in d and "inputs" not in d:
            raise ValueError("input: missing; give a string or a list of strings")
        normalize = d.get("normalize", d.get("use_activation", True))
        if "normalize" in d and "use_activation" in d and d["normalize"] != d["use_activation"]:
            raise ValueError(
                f"normalize ({d['normalize']!r}) and use_activation ({d['use_activation']!r}) "
                "disagree; they are the same switch (use_activation is vLLM's name), send one"
            )
        if "use_activation" in d and "normalize" not in d and not isinstance(normalize, bool):
            raise ValueError(
                f"use_activation: must be a boolean, got {type(normalize).__name__}"
            )
        return cls(
            model=d.get("model"),
            inputs=d["input"] if "input" in d else d["inputs"],
            pooling_type=d.get("pooling_type"),
            normalize=normalize,
            n_labels=d.get("n_labels", 1),
            return_hidden_states=d.get("return_hidden_states", False),
            step_tag=d.get("step_tag"),
            step_tag_id=d.get("step_tag_id"),
        )


Score = float | list[float]


@dataclass(frozen=True)
class ScoringResult:
    """One text's score (the reward plan's result item; wire: ``{"score", "index"}``)."""

    score: Score
    index: int = 0


@dataclass(frozen=True, init=False)
class ScoringResponse:
    """Scores in input order: the reward spec's ``ScoringResponse(scores, hidden_states=None,
    metadata={})``, with the plan's views ``results`` (``ScoringResult`` items), ``model`` and
    ``usage`` (both kept in ``metadata``, as the reference client fills it).

    Sequence pooling (``last``/``mean``/``cls``): a float per text for one label, a list of
    ``n_labels`` floats otherwise. Token pooling (``step``/``all``): per text a list with one
    entry per step (or token), each a float or a list of ``n_labels`` floats; a text without a
    step tag gets an empty list.

    Ours: ``version``, the weight version that produced every score in this response (None when
    the server did not say), and ``pooling_type``, how they were pooled. Wire form (the
    reference server's, plus ``version``, ``pooling_type`` and ``hidden_states`` when asked):
    ``{"model", "data": [{"index", "score"}], "usage": {"prompt_tokens"}, "version",
    "pooling_type"}``.
    """

    scores: list[Any]
    hidden_states: list[Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int | None = None
    pooling_type: PoolingType | str = PoolingType.LAST

    def __init__(
        self,
        scores: list[Any] | None = None,
        hidden_states: list[Any] | None = None,
        metadata: dict[str, Any] | None = None,
        version: int | None = None,
        pooling_type: PoolingType | str = PoolingType.LAST,
        *,
        results: Sequence[ScoringResult] | None = None,
        model: str | None = None,
        usage: dict[str, int] | None = None,
    ) -> None:
        """Either form: the spec's ``ScoringResponse(scores, hidden_states, metadata)`` or the
        plan's ``ScoringResponse(results, model, usage)`` (positional too: a first argument of
        ``ScoringResult`` items, or a string second, is read as the plan's), the two equal
        when they say the same (``model`` / ``usage`` live in ``metadata``).

        Raises:
            ValueError: neither or both of ``scores`` / ``results``, results whose indices are
                not 0..n-1, or ``model`` / ``usage`` contradicting ``metadata``.
        """
        if _plan_positional(scores, hidden_states):
            if results is not None or model is not None or usage is not None:
                raise ValueError("results: given positionally and by keyword")
            results, model, usage = scores, hidden_states, metadata  # type: ignore[assignment]
            scores, hidden_states, metadata = None, None, None
        if (scores is None) == (results is None):
            raise ValueError("give scores (a list) or results (ScoringResult items), not both")
        if results is not None:
            scores = _scores_of(results)
        meta = dict(metadata) if isinstance(metadata, dict) else metadata
        for key, value in (("model", model), ("usage", usage)):
            if value is None:
                continue
            if not isinstance(meta, dict):
                meta = {}
            if meta.get(key) not in (None, value):
                raise ValueError(f"{key}: {value!r} but metadata[{key!r}] is {meta[key]!r}")
            meta[key] = value
        for name, value in (("scores", scores), ("hidden_states", hidden_states),
                            ("metadata", {} if meta is None else meta), ("version", version),
                            ("pooling_type", pooling_type)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        pooling = PoolingType.parse(self.pooling_type)
        object.__setattr__(self, "pooling_type", pooling)
        if not isinstance(self.scores, list):
            raise ValueError(f"scores: must be a list, got {type(self.scores).__name__}")
        if pooling.is_sequence_level:
            scores = _check_scores(self.scores, "scores")
        else:
            bad = [i for i, s in enumerate(self.scores) if not isinstance(s, (list, tuple))]
            if bad:
                raise ValueError(
                    f"scores: pooling_type {pooling.value!r} gives a list per text; "
                    f"texts {bad[:10]} are not lists"
                )
            scores = [_check_scores(list(s), f"scores[{i}]") for i, s in enumerate(self.scores)]
        object.__setattr__(self, "scores", scores)
        if self.version is not None and (
            isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0
        ):
            raise ValueError(f"version: must be an int >= 0 or None, got {self.version!r}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"metadata: must be a dict, got {type(self.metadata).__name__}")

    @property
    def results(self) -> list[ScoringResult]:
        return [ScoringResult(s, i) for i, s in enumerate(self.scores)]

    @property
    def model(self) -> str | None:
        return self.metadata.get("model")

    @property
    def usage(self) -> dict[str, int]:
        return dict(self.metadata.get("usage") or {})

    @property
    def n_labels(self) -> int:
        first = self.scores[0] if self.scores else None
        if not self.pooling_type.is_sequence_level:
            first = next((s[0] for s in self.scores if s), None)
        return len(first) if isinstance(first, list) else 1

    def __len__(self) -> int:
        return len(self.scores)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model": self.model,
            "data": [{"index": i, "score": s} for i, s in enumerate(self.scores)],
            "usage": self.usage,
            "version": self.version,
            "pooling_type": PoolingType.parse(self.pooling_type).value,
        }
        if self.hidden_states is not None:
            d["hidden_states"] = self.hidden_states
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ScoringResponse:
        """A ``/score`` answer: ours, or the reference server's (no ``version``, no
        ``pooling_type``)."""
        if not isinstance(d, dict):
            raise ValueError(f"response must be a JSON object, got {type(d).__name__}")
        if "data" not in d:
            raise ValueError("response: missing field 'data'")
        data = d["data"]
        if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
            raise ValueError("data: must be a list of {index, score} objects")
        items = sorted(data, key=lambda x: int(x.get("index", 0)))
        if [int(x.get("index", -1)) for x in items] != list(range(len(items))):
            raise ValueError("data: indices must be 0..n-1")
        return cls(
            scores=[x["score"] for x in items],
            hidden_states=d.get("hidden_states"),
            metadata={"model": d.get("model"), "usage": d.get("usage")},
            version=d.get("version"),
            pooling_type=d.get("pooling_type") or PoolingType.LAST,
        )


def _plan_positional(first: Any, second: Any) -> bool:
    """Whether positional arguments follow the plan's ``(results, model, usage)``."""
    if isinstance(second, str):
        return True
    return (isinstance(first, (list, tuple)) and bool(first)
            and all(isinstance(r, ScoringResult) for r in first))


def _scores_of(results: Any) -> list[Any]:
    """The scores of ``ScoringResult`` items, placed by their indices."""
    if not isinstance(results, (list, tuple)) or not all(
            isinstance(r, ScoringResult) for r in results):
        raise ValueError("results: must be a list of ScoringResult items")
    by_index = sorted(results, key=lambda r: r.index)
    if [r.index for r in by_index] != list(range(len(by_index))):
        raise ValueError(f"results: indices must be 0..n-1, got {[r.index for r in results]}")
    return [r.score for r in by_index]


def _check_scores(scores: list[Any], what: str) -> list[Any]:
    """Floats, or lists of one common non-zero width; -> the same as plain floats."""
    multi = [isinstance(s, (list, tuple)) for s in scores]
    if any(multi) and not all(multi):
        raise ValueError(f"{what}: mixes floats and lists; all must have the same n_labels")
    if any(multi):
        widths = {len(s) for s in scores}
        if len(widths) != 1 or 0 in widths:
            raise ValueError(f"{what}: lists of different or zero lengths {sorted(widths)}")
        return [[_as_float(x, what) for x in s] for s in scores]
    return [_as_float(s, what) for s in scores]


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
