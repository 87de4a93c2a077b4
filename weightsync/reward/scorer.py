"""``RewardModelScorer``: batched, concurrent reward-model scoring of RL rollouts.

Who calls: the RL loop (trainer or rollout controller process), after generation and before the
advantage computation. It turns each rollout into one text, scores the texts in batches of
``batch_size`` with at most ``max_concurrency`` batches in flight, and writes each score (and the
reward-model weight version that produced it) into the rollout's ``metadata`` dict.

A rollout is a dict or an object (dataclass) with ``prompt`` and ``response`` strings and a
``metadata`` dict; ``text_fn(rollout) -> str`` replaces the default ``prompt + response`` (e.g.
to apply a chat template). The client is anything with

    async score_batch(texts: list[str]) -> list[float | list[float]]

``score_batch`` may instead return the scores together with the weight version (a
``ScoringResponse``, an object or dict with ``scores`` and ``version``, or a
``(scores, version)`` pair). A full ``RewardModelClient`` (``score``, ``score_batch``,
``get_model_version``, ``sync_weights``; e.g. ``weightsync.reward.VLLMRewardClient``) is called
through ``score(ScoringRequest)`` instead (``use_score_api``, auto by default), so every batch
carries the version that produced it. When the version does not come with the scores and the
client has ``async get_model_version()``, the scorer reads it before and after the run and
records it only if it did not change (a reward model updated mid-run gives ``None`` and
``ScoringStats.version_changed``): scores are never silently attributed to the wrong weights.

All-or-nothing: the texts are all built (and checked) before the first request, and metadata is
written only after every batch succeeded; on failure the error names the batch and nothing is
written. Transient errors (e.g. a 503 while the reward model swaps weights) can be retried with
``max_retries``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Score = float | list[float]

log = logging.getLogger(__name__)

class ScoringError(RuntimeError):
    """A scoring batch failed or returned unusable scores; no rollout metadata was written."""


@dataclass
class ScoringStats:
    """What one ``score_rollouts`` call did."""

    num_rollouts: int = 0
    num_batches: int = 0
    seconds: float = 0.0
    retries: int = 0
    versions: list[int] = field(default_factory=list)  # distinct weight versions seen, sorted
    version_changed: bool = False  # the reward model's version moved during the run

    @property
    def mixed_versions(self) -> bool:
        return self.version_changed or len(self.versions) > 1


class RewardModelScorer:
    """Score rollouts with a reward-model client and write the scores into their metadata.

    ``metadata_key`` receives the score (a float, or a list for n_labels > 1) and
    ``f"{metadata_key}_version"`` the weight version (an int, or None when unknown).
    ``use_activation`` (score API only) asks the server for activated scores instead of raw
    logits. ``max_retries`` / ``retry_backoff_s`` (doubling) retry a failed batch;
    ``timeout_s`` bounds each request.
    """

    def __init__(
        self,
        client: Any,
        *,
        batch_size: int = 32,
        max_concurrency: int = 4,
        metadata_key: str = "rm_score",
        text_fn: Callable[[Any], str] | None = None,
        max_retries: int = 0,
        retry_backoff_s: float = 0.5,
        timeout_s: float | None = None,
        use_score_api: bool | None = None,
        use_activation: bool = False,
    ) -> None:
        if not callable(getattr(client, "score_batch", None)):
            raise TypeError(
                f"client must have an async score_batch(texts) method; {type(client).__name__} "
                f"has none"
            )
        for name, value, low in (("batch_size", batch_size, 1), ("max_concurrency", max_concurrency, 1),
                                 ("max_retries", max_retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(metadata_key, str) or not metadata_key:
            raise ValueError(f"metadata_key must be a non-empty string, got {metadata_key!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        self.client = client
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.metadata_key = metadata_key
        self.version_key = f"{metadata_key}_version"
        self.text_fn = text_fn
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.timeout_s = timeout_s
        if use_score_api is None:
            use_score_api = all(
                callable(getattr(client, m, None))
                for m in ("score", "get_model_version", "sync_weights")
            )
        self.use_score_api = bool(use_score_api)
        self.use_activation = bool(use_activation)
        if self.use_activation and not self.use_score_api:
            raise ValueError(
                "use_activation=True needs a client with score(ScoringRequest) (use_score_api); "
                "score_batch returns what the client returns"
            )
        self.last_stats = ScoringStats()

    # -- public API ----------------------------------------------------------------------------
    async def score_rollouts(self, rollouts: Sequence[Any]) -> list[Score]:
        """Score every rollout and write ``metadata[metadata_key]``; returns the scores in order."""
        rollouts = list(rollouts)
        texts = [self._text(i, r) for i, r in enumerate(rollouts)]
        metas = [_metadata(i, r) for i, r in enumerate(rollouts)]
        scores, versions = await self.score_texts(texts)
        for meta, s, v in zip(metas, scores, versions, strict=True):
            meta[self.metadata_key] = s
            meta[self.version_key] = v
        return scores

    def score_rollouts_sync(self, rollouts: Sequence[Any]) -> list[Score]:
        """Blocking form of ``score_rollouts`` for code without an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score_rollouts(rollouts))
        raise RuntimeError(
            "score_rollouts_sync called inside a running event loop; await score_rollouts instead"
        )

    async def score_texts(self, texts: Sequence[str]) -> tuple[list[Score], list[int | None]]:
        """Score texts in batches; returns the scores and, per text, the weight version."""
        texts = list(texts)
        stats = ScoringStats(num_rollouts=len(texts))
        self.last_stats = stats
        if not texts:
            return [], []
        t0 = time.perf_counter()
        before = await self._client_version()
        batches = [texts[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        stats.num_batches = len(batches)
        sem = asyncio.Semaphore(self.max_concurrency)

        async def run(index: int, batch: list[str]) -> tuple[list[Score], int | None]:
            async with sem:
                return await self._score_batch(index, batch, stats)

        tasks = [asyncio.ensure_future(run(i, b)) for i, b in enumerate(batches)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        after = await self._client_version() if before is not None else None
        if before is not None and after != before:
            stats.version_changed = True
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

    # -- internals -------------------------------------------------------------------------------
    def _text(self, index: int, rollout: Any) -> str:
        if self.text_fn is not None:
            text = self.text_fn(rollout)
            if not isinstance(text, str):
                raise ValueError(
                    f"rollout {index}: text_fn returned {type(text).__name__}, expected str"
                )
            return text
        parts = []
        for key in ("prompt", "response"):
            value = _field(rollout, key)
            if value is _MISSING:
                raise ValueError(
                    f"rollout {index}: no {key!r} field; give rollouts with prompt and response "
                    f"strings or pass text_fn"
                )
            if not isinstance(value, str):
                raise ValueError(
                    f"rollout {index}: {key!r} must be a string, got {type(value).__name__} "
                    f"(pass text_fn to build the text yourself)"
                )
            parts.append(value)
        return parts[0] + parts[1]

    async def _score_batch(
        self, index: int, batch: list[str], stats: ScoringStats
    ) -> tuple[list[Score], int | None]:
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
                        f"scoring batch {index} ({len(batch)} texts) failed after "
                        f"{attempt + 1} attempt(s): {what}; no rollout metadata was written"
                    ) from e
                attempt += 1
                stats.retries += 1
                await asyncio.sleep(self.retry_backoff_s * (2 ** (attempt - 1)))
        scores, version = _unpack(raw)
        if len(scores) != len(batch):
            raise ScoringError(
                f"scoring batch {index}: the client returned {len(scores)} scores for "
                f"{len(batch)} texts"
            )
        return [_check_score(index * self.batch_size + i, s) for i, s in enumerate(scores)], version

    async def _request(self, batch: list[str]) -> Any:
        if not self.use_score_api:
            return await self.client.score_batch(batch)
        from weightsync.reward.types import ScoringRequest

        result = await self.client.score(ScoringRequest(batch, self.use_activation))
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
            log.warning("get_model_version failed (%s: %s); recording no version", type(e).__name__, e)
            return None
        return _as_version(v)


# -- helpers ------------------------------------------------------------------------------------

_MISSING = object()


def _field(rollout: Any, key: str) -> Any:
    if isinstance(rollout, Mapping):
        return rollout.get(key, _MISSING)
    return getattr(rollout, key, _MISSING)


def _metadata(index: int, rollout: Any) -> dict:
    """The rollout's metadata dict, created when the rollout has none yet (None or absent)."""
    meta = _field(rollout, "metadata")
    if meta is _MISSING or meta is None:
        meta = {}
        try:
            if isinstance(rollout, Mapping):
                rollout["metadata"] = meta  # type: ignore[index]
            else:
                rollout.metadata = meta
        except (TypeError, AttributeError, dataclasses.FrozenInstanceError) as e:
            raise ValueError(
                f"rollout {index}: has no metadata dict and none can be set on a "
                f"{type(rollout).__name__}; give it a metadata dict"
            ) from e
    if not isinstance(meta, dict):
        raise ValueError(f"rollout {index}: metadata must be a dict, got {type(meta).__name__}")
    return meta


def _as_version(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, Mapping):
        v = v.get("version")
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def _unpack(raw: Any) -> tuple[list[Any], int | None]:
    """Scores (+ version) from what ``score_batch`` returned (see module docstring)."""
    if isinstance(raw, Mapping):
        if "scores" not in raw:
            raise ScoringError(f"score_batch returned a dict without 'scores': keys {sorted(raw)}")
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
    raise ScoringError(f"score_batch returned {type(raw).__name__}; expected a list of scores")


def _check_score(i: int, s: Any) -> Score:
    if isinstance(s, (list, tuple)):
        if not s:
            raise ScoringError(f"text {i}: empty score list")
        return [_check_number(i, x) for x in s]
    return _check_number(i, s)


def _check_number(i: int, s: Any) -> float:
    if hasattr(s, "item") and not isinstance(s, (int, float)):
        s = s.item()
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise ScoringError(f"text {i}: score is a {type(s).__name__}, expected a number")
    f = float(s)
    if not math.isfinite(f):
        raise ScoringError(f"text {i}: non-finite score {f}")
    return f
