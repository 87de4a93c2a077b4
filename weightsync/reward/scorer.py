"""``RewardModelScorer``: score rollouts with a reward model, in batches, several in flight, and
write the scores into rollout (or step) metadata in place.

Who calls: the RL loop (trainer or rollout controller process), after sampling and before
credit assignment: ``await scorer.score(rollouts)``, then ``assigner.compute(rollouts)``.

Score levels:

- ``"sequence"`` (outcome reward): one text per rollout, ``text_fn(rollout, rollout.steps)``;
  the score goes to ``rollout.meta[score_key]``.
- ``"step"`` (process reward): the score goes to ``step.meta[score_key]``. Two ways:

  - ``step_tag=None`` (default): one text per step, ``text_fn(rollout, steps[: i + 1])`` for
    the i-th step, scored by any sequence-level reward model. The default ``text_fn`` there is
    ``step_text``: the step's own ``f"{prev_obs}\n{action}"``, as the reward spec scores each
    (state, action) pair; ``text_fn=rollout_text`` scores the whole prefix instead.
  - ``step_tag="<tag>"``: server-side step pooling, one text per rollout with the tag after
    every step (``text_fn(rollout, rollout.steps)``, default ``tagged_rollout_text``), sent with
    ``pooling_type="step"``; the server returns the score at each tag, i.e. the score of the
    text up to that step, in one forward pass instead of one per prefix. The tag must be one
    token for the server's tokenizer and appear in the text exactly once per step (checked on
    both sides). Needs a client with ``score(ScoringRequest)`` (``VLLMRewardClient``).

The default ``text_fn`` of sequence scoring is ``rollout_text``: the non-empty ``prev_obs`` and
``action`` strings of the steps joined by newlines (with ``step_tag``: ``tagged_rollout_text``,
the same with the tag after each step). Train the reward model on the same format, or pass your own ``text_fn``
(e.g. a chat template).

Batches of ``batch_size`` texts go to the client with at most ``max_concurrency`` in flight;
results are put back in input order. Fail-fast and all-or-nothing: every text is built and
checked before the first request, nothing is written until every batch succeeded, and a failed
batch raises ``ScoringError`` naming the batch (its text range and rollouts) and the server.
``max_retries`` (backoff ``retry_backoff_s``, doubling) retries a failed batch first, e.g. a 503
while the reward model swaps weights; ``timeout_s`` bounds each request.

Multi-label models (``n_labels > 1``): each score vector is reduced to one number with
``aggregate`` (``weightsync.reward.aggregate``; default ``"first"``) before it is written under
``score_key``; ``vector_key`` also keeps the whole vector under that key.

Drift: after a run, the rollouts' ``meta["policy_version"]`` (set by the rollout engine) and
the reward model versions are compared (``weightsync.reward.staleness``); more than
``max_version_gap`` apart warns ``VersionDriftWarning``, once until they come back within it
(``last_stats.version_gap``).

Versions: ``meta[f"{score_key}_version"]`` gets the reward model weight version that produced
the score. A client with ``score(ScoringRequest)`` and ``get_model_version()`` (a
``RewardModelClient`` such as ``VLLMRewardClient``) is called through ``score``, so every batch
carries its version. Otherwise ``score_batch(texts)`` is used and, when the client has
``get_model_version``, the version is read before and after the run and recorded only if it did
not change (else None and ``last_stats.version_changed``): scores are never attributed to the
wrong weights. ``normalize`` (False, the default: raw scores, what transformers computes; True:
the model's activation, what the reference's client returns by default) is passed to the
client; requests through ``score`` leave the pooling to the server (its configured one).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from weightsync._runtime.threads import LoopThread
from weightsync.reward.aggregate import (
    DEFAULT_AGGREGATE,
    Aggregate,
    reduce_score,
    resolve_aggregate,
)
from weightsync.reward.staleness import DEFAULT_MAX_VERSION_GAP, DriftCheck

Score = float | list[float]
TextFn = Callable[[Any, Sequence[Any]], str]
SCORE_LEVELS = ("sequence", "step")

log = logging.getLogger(__name__)


@runtime_checkable
class RewardScoringClient(Protocol):
    """What the scorer needs from a reward model service (the plan's ``client`` type):
    ``score_batch``. ``VLLMRewardClient`` (any ``RewardModelClient``) is one; a client that also
    has ``score(ScoringRequest)`` and ``get_model_version()`` is scored through ``score``."""

    async def score_batch(
        self, inputs: list[str], *, normalize: bool = True
    ) -> list[float] | list[list[float]]: ...


class ScoringError(RuntimeError):
    """A scoring batch failed or returned unusable scores; no metadata was written."""


@dataclass
class ScoringStats:
    """What one ``score`` call did."""

    num_texts: int = 0
    num_batches: int = 0
    seconds: float = 0.0
    retries: int = 0
    versions: list[int] = field(default_factory=list)  # distinct weight versions seen, sorted
    version_changed: bool = False  # the reward model's version moved during the run
    version_gap: int | None = None  # widest policy / reward model version distance, if known

    @property
    def mixed_versions(self) -> bool:
        return self.version_changed or len(self.versions) > 1


def rollout_text(rollout: Any, steps: Sequence[Any]) -> str:
    """The default scoring text: non-empty ``prev_obs`` / ``action`` of ``steps``, newline-joined."""
    parts = []
    for s in steps:
        for value in (s.prev_obs, s.action):
            if value:
                parts.append(str(value))
    return "\n".join(parts)


def step_text(rollout: Any, steps: Sequence[Any]) -> str:
    """The default text of step scoring: the last given step as the reward spec writes a
    (state, action) pair, ``f"{step.prev_obs}\n{step.action}"``."""
    step = steps[-1]
    return f"{step.prev_obs}\n{step.action}"


def tagged_rollout_text(step_tag: str) -> TextFn:
    """The default text of server-side step pooling: each step as ``rollout_text`` writes it,
    followed by ``step_tag``, steps newline-joined (so the text up to step i's tag is the
    scored prefix of step i)."""

    def text(rollout: Any, steps: Sequence[Any]) -> str:
        return "\n".join(rollout_text(rollout, [s]) + step_tag for s in steps)

    return text


class RewardModelScorer:
    """See the module docstring."""

    def __init__(
        self,
        client: RewardScoringClient | Any,
        score_key: str = "rm_score",
        score_level: str = "sequence",
        batch_size: int = 64,
        *,
        max_concurrency: int = 4,
        text_fn: TextFn | None = None,
        aggregate: Aggregate = DEFAULT_AGGREGATE,
        vector_key: str | None = None,
        normalize: bool = False,
        max_retries: int = 0,
        retry_backoff_s: float = 0.5,
        timeout_s: float | None = None,
        step_tag: str | None = None,
        max_version_gap: int | None = DEFAULT_MAX_VERSION_GAP,
    ) -> None:
        self._drift = DriftCheck(max_version_gap)  # warns once per drift
        if not callable(getattr(client, "score_batch", None)) and not callable(
            getattr(client, "score", None)
        ):
            raise TypeError(
                f"client must have async score_batch(texts) or score(ScoringRequest); a "
                f"{type(client).__name__} has neither"
            )
        if score_level not in SCORE_LEVELS:
            raise ValueError(f"score_level must be one of {SCORE_LEVELS}, got {score_level!r}")
        for name, value, low in (("batch_size", batch_size, 1),
                                 ("max_concurrency", max_concurrency, 1),
                                 ("max_retries", max_retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(score_key, str) or not score_key:
            raise ValueError(f"score_key must be a non-empty string, got {score_key!r}")
        if vector_key is not None and (not isinstance(vector_key, str) or not vector_key):
            raise ValueError(f"vector_key must be a non-empty string or None, got {vector_key!r}")
        if vector_key == score_key:
            raise ValueError(f"vector_key must differ from score_key ({score_key!r})")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be a bool, got {normalize!r}")
        if step_tag is not None:
            if not isinstance(step_tag, str) or not step_tag:
                raise ValueError(f"step_tag must be a non-empty string or None, got {step_tag!r}")
            if score_level != "step":
                raise ValueError(f"step_tag is for score_level='step', got {score_level!r}")
            if not callable(getattr(client, "score", None)):
                raise TypeError(
                    f"step_tag needs a client with score(ScoringRequest) (server-side step "
                    f"pooling); a {type(client).__name__} has none"
                )
        self.client = client
        self.step_tag = step_tag
        self.score_key = score_key
        self.score_level = score_level
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        if text_fn is None:
            text_fn = (tagged_rollout_text(step_tag) if step_tag is not None
                       else step_text if score_level == "step" else rollout_text)
        self.text_fn: TextFn = text_fn
        self.aggregate = aggregate
        self._reduce = resolve_aggregate(aggregate)
        self.vector_key = vector_key
        self.version_key = f"{score_key}_version"
        self.normalize = normalize
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.timeout_s = timeout_s
        self.use_score_api = step_tag is not None or all(
            callable(getattr(client, m, None)) for m in ("score", "get_model_version")
        )
        self.last_stats = ScoringStats()
        self._twin = LoopThread("weightsync-scorer")

    # -- public API ----------------------------------------------------------------------------
    async def score(self, rollouts: Sequence[Any]) -> None:
        """Score every rollout (or step) and write the scores into its ``meta`` in place."""
        rollouts = list(rollouts)
        targets, texts, labels = self._texts(rollouts)
        scores, versions = await self.score_texts(texts, labels)
        writes = []  # (meta, raw score, scalar, version), all computed before any write
        for metas, label, s, v in zip(targets, labels, scores, versions, strict=True):
            per_target = s if self.step_tag is not None else [s]
            if len(per_target) != len(metas):
                raise ScoringError(
                    f"{label}: {self._server()} returned {len(per_target)} step scores for "
                    f"{len(metas)} steps; the step tag {self.step_tag!r} must be one token for "
                    f"the server's tokenizer and occur once per step; no scores were written"
                )
            for i, (meta, one) in enumerate(zip(metas, per_target, strict=True)):
                try:
                    writes.append((meta, one, reduce_score(one, self._reduce), v))
                except ValueError as e:
                    where = f"{label} step {i}" if self.step_tag is not None else label
                    raise ScoringError(f"{where}: {e}; no scores were written") from e
        for meta, s, x, v in writes:
            meta[self.score_key] = x
            meta[self.version_key] = v
            if self.vector_key is not None:
                meta[self.vector_key] = list(s) if isinstance(s, list) else [s]
        self.last_stats.version_gap = self._drift(
            (getattr(r, "meta", {}).get("policy_version") for r in rollouts), versions)

    def score_sync(self, rollouts: Sequence[Any]) -> None:
        """Blocking twin of ``score`` (runs it on the scorer's private loop thread)."""
        return self._twin.run(self.score(rollouts))

    async def score_texts(
        self, texts: Sequence[str], labels: Sequence[str] | None = None
    ) -> tuple[list[Score], list[int | None]]:
        """Score texts in batches (order kept); returns the raw scores (floats, or lists for
        n_labels > 1) and, per text, the weight version. ``labels`` name the texts in errors."""
        texts = list(texts)
        labels = list(labels) if labels is not None else [f"text {i}" for i in range(len(texts))]
        stats = ScoringStats(num_texts=len(texts))
        self.last_stats = stats
        if not texts:
            return [], []
        t0 = time.perf_counter()
        before = await self._client_version()
        starts = list(range(0, len(texts), self.batch_size))
        stats.num_batches = len(starts)
        sem = asyncio.Semaphore(self.max_concurrency)

        async def run(index: int, start: int) -> tuple[list[Score], int | None]:
            async with sem:
                return await self._score_batch(index, start, texts, labels, stats)

        tasks = [asyncio.ensure_future(run(i, s)) for i, s in enumerate(starts)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        after = await self._client_version() if before is not None else None
        stats.version_changed = before is not None and after != before
        scores: list[Score] = []
        versions: list[int | None] = []
        for batch_scores, batch_version in results:
            v = batch_version
            if v is None and before is not None and after == before:
                v = before
            scores.extend(batch_scores)
            versions.extend([v] * len(batch_scores))
        stats.versions = sorted({v for v in versions if v is not None})
        stats.seconds = time.perf_counter() - t0
        return scores, versions

    # -- texts ---------------------------------------------------------------------------------
    def _texts(self, rollouts: list[Any]) -> tuple[list[list[dict]], list[str], list[str]]:
        """(meta dicts to write into, text, label) per scored text, all checked up front: one
        dict per text, except with server-side step pooling (one per step of the rollout)."""
        targets: list[list[dict]] = []
        texts: list[str] = []
        labels: list[str] = []
        for pos, r in enumerate(rollouts):
            steps = getattr(r, "steps", None)
            if steps is None or not hasattr(r, "meta"):
                raise ValueError(
                    f"rollouts[{pos}]: a {type(r).__name__} is not a Rollout (id, steps, meta)"
                )
            rid = getattr(r, "id", pos)
            if not steps:
                raise ValueError(f"rollout {rid!r}: has no steps; nothing to score")
            if self.step_tag is not None:
                label = f"rollout {rid!r}"
                text = self.text_fn(r, steps)
                if not isinstance(text, str):
                    raise ValueError(
                        f"{label}: text_fn returned {type(text).__name__}, expected str")
                if text.count(self.step_tag) != len(steps):
                    raise ValueError(
                        f"{label}: the step tag {self.step_tag!r} occurs "
                        f"{text.count(self.step_tag)} times in its text, expected once per "
                        f"step ({len(steps)}); keep the tag out of the step texts"
                    )
                targets.append([_meta_of(s, f"{label} step {s.index}") for s in steps])
                texts.append(text)
                labels.append(label)
                continue
            if self.score_level == "sequence":
                units = [(r, f"rollout {rid!r}", steps)]
            else:
                units = [(s, f"rollout {rid!r} step {s.index}", steps[: i + 1])
                         for i, s in enumerate(steps)]
            for holder, label, prefix in units:
                text = self.text_fn(r, prefix)
                if not isinstance(text, str):
                    raise ValueError(
                        f"{label}: text_fn returned {type(text).__name__}, expected str"
                    )
                targets.append([_meta_of(holder, label)])
                texts.append(text)
                labels.append(label)
        return targets, texts, labels

    # -- requests ------------------------------------------------------------------------------
    async def _score_batch(
        self, index: int, start: int, texts: list[str], labels: list[str], stats: ScoringStats
    ) -> tuple[list[Score], int | None]:
        batch = texts[start:start + self.batch_size]
        attempt = 0
        while True:
            try:
                call = self._request(batch)
                raw = await (asyncio.wait_for(call, self.timeout_s) if self.timeout_s else call)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if attempt >= self.max_retries:
                    what = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                    raise ScoringError(
                        f"{self._batch_name(index, start, len(batch), len(texts), labels)} failed "
                        f"against {self._server()} after {attempt + 1} attempt(s): {what}; no "
                        f"scores were written"
                    ) from e
                attempt += 1
                stats.retries += 1
                await asyncio.sleep(self.retry_backoff_s * (2 ** (attempt - 1)))
        scores, version = _unpack(raw)
        if len(scores) != len(batch):
            raise ScoringError(
                f"{self._batch_name(index, start, len(batch), len(texts), labels)}: "
                f"{self._server()} returned {len(scores)} scores for {len(batch)} texts"
            )
        if self.step_tag is not None:
            return [_check_step_scores(labels[start + i], s) for i, s in enumerate(scores)], version
        return [_check_score(labels[start + i], s) for i, s in enumerate(scores)], version

    def _batch_name(self, index: int, start: int, n: int, total: int, labels: list[str]) -> str:
        first, last = labels[start], labels[start + n - 1]
        span = first if n == 1 else f"{first} .. {last}"
        return f"scoring batch {index} (texts {start}..{start + n - 1} of {total}: {span})"

    def _server(self) -> str:
        url = getattr(self.client, "base_url", None)
        return f"reward server {url}" if url else f"client {type(self.client).__name__}"

    async def _request(self, batch: list[str]) -> Any:
        if not self.use_score_api:
            return await self.client.score_batch(batch, normalize=self.normalize)
        from weightsync.reward.types import PoolingType, ScoringRequest

        kwargs: dict[str, Any] = {"normalize": self.normalize, "pooling_type": None}
        if self.step_tag is not None:
            kwargs.update(pooling_type=PoolingType.STEP, step_tag=self.step_tag)
        result = await self.client.score(ScoringRequest(inputs=batch, **kwargs))
        return result[0] if isinstance(result, tuple) else result  # (response, info)

    async def _client_version(self) -> int | None:
        getter = getattr(self.client, "get_model_version", None)
        if not callable(getter):
            return None
        try:
            v = getter()
            if asyncio.iscoroutine(v) or isinstance(v, asyncio.Future):
                v = await v
        except Exception as e:  # the version is bookkeeping: unknown, not a failed scoring run
            log.warning("get_model_version failed (%s: %s); recording no version",
                        type(e).__name__, e)
            return None
        return _as_version(v)


# -- helpers ------------------------------------------------------------------------------------


def _meta_of(holder: Any, label: str) -> dict:
    """The ``meta`` dict of a rollout or step, created when it is None."""
    meta = getattr(holder, "meta", None)
    if meta is None:
        meta = {}
        try:
            holder.meta = meta
        except (AttributeError, TypeError) as e:
            raise ValueError(f"{label}: has no meta dict and none can be set") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{label}: meta must be a dict, got {type(meta).__name__}")
    return meta


def _as_version(v: Any) -> int | None:
    if isinstance(v, Mapping):
        v = v.get("version")
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def _unpack(raw: Any) -> tuple[list[Any], int | None]:
    """Scores (+ version) from what the client returned: a ``ScoringResponse`` (or anything
    with ``scores`` / ``version``), a dict with ``scores``, a ``(scores, version)`` pair, a list
    or a tensor."""
    if isinstance(raw, Mapping):
        if "scores" not in raw:
            raise ScoringError(f"the client returned a dict without 'scores': keys {sorted(raw)}")
        return list(raw["scores"]), _as_version(raw.get("version"))
    if hasattr(raw, "scores") and not isinstance(raw, (list, tuple)):
        return list(raw.scores), _as_version(getattr(raw, "version", None))
    if isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[0], (list, tuple)) and (
        raw[1] is None or isinstance(raw[1], int)
    ):
        return list(raw[0]), _as_version(raw[1])
    if isinstance(raw, (list, tuple)):
        return list(raw), None
    if hasattr(raw, "tolist"):  # a tensor or an array
        return list(raw.tolist()), None
    raise ScoringError(f"the client returned {type(raw).__name__}; expected a list of scores")


def _check_score(label: str, s: Any) -> Score:
    if isinstance(s, (list, tuple)):
        if not s:
            raise ScoringError(f"{label}: empty score list")
        return [_check_number(label, x) for x in s]
    return _check_number(label, s)


def _check_step_scores(label: str, s: Any) -> list[Score]:
    if not isinstance(s, (list, tuple)):
        raise ScoringError(f"{label}: step pooling returned a {type(s).__name__}, expected a "
                           "list with one score per step")
    return [_check_score(f"{label} step {i}", x) for i, x in enumerate(s)]


def _check_number(label: str, s: Any) -> float:
    if hasattr(s, "item") and not isinstance(s, (int, float)):
        s = s.item()
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise ScoringError(f"{label}: score is a {type(s).__name__}, expected a number")
    f = float(s)
    if not math.isfinite(f):
        raise ScoringError(f"{label}: non-finite score {f}")
    return f
