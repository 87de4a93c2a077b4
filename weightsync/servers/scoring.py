"""``POST /score`` on the reward server: texts -> scores from one complete weight version.

Callers: ``weightsync.servers.reward`` (mounts ``score_router``), in the server process. A
score request holds the read side of the update gate (``UpdateControl.serving``) while its
texts run, so every score in one response comes from one version, which the body
(``"version"``) and the ``x-weight-version`` header report.

The request is the reward design's (``weightsync.reward.types.ScoringRequest``). What each field
does on vLLM:

- ``model``: the served name or the design's default ``"reward-model"``; another is a 404.
- ``normalize`` (default True, the design's): vLLM's ``use_activation``, the model's
  activation (sigmoid for one label, softmax for several, none for a ``regression`` head);
  False gives the raw logits. ``use_activation`` is accepted as its other name.
- ``pooling_type`` (per request, as the reference's client sends it): the engine's own
  sequence pooling (``--pooling-type``, fixed by vLLM when the engine starts) runs vLLM's
  ``classify``; another of ``last`` / ``mean`` / ``cls`` runs vLLM's token pooler
  (``token_classify``, the head's raw output at every token) and pools those rows here (the
  last, the mean, the first), then applies the model's activation when ``normalize`` is on:
  the head is linear, so this is the score that engine pooling gives (tested against
  transformers). Omitted: the engine's pooling. ``step`` and ``all`` run the token pooler too:
  ``all`` returns a score per token, ``step`` one per occurrence of the step tag
  (``step_tag`` text, resolved with the server's tokenizer, or ``step_tag_id``, or the
  server's configured tag). On a server started with token pooling STEP vLLM selects the tag
  positions itself (``PoolingParams.step_tag_id``) and only ``step`` and the engine's own
  sequence pooling are available; with the default ALL this module picks them from the
  per-token output. Either way the score at a tag is the score of the text up to and
  including the tag (causal attention), i.e. what a separate request per step prefix gives.
- ``return_hidden_states``: accepted, as the reference server does; the answer has no hidden
  states (vLLM's classification pooler returns only the head's outputs).
- ``n_labels``: 1 (the default) accepts any model; more is checked against the model's (400
  on a difference).
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' ``Request``
# annotations at definition time, and ``Request`` is imported inside the router factories.

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from weightsync.reward.types import (
    DEFAULT_MODEL_NAME,
    PoolingType,
    ScoringRequest,
    ScoringResponse,
)
from weightsync.servers._http import (
    DEFAULT_MAX_BODY_BYTES,
    json_body,
    service_route_class,
)
from weightsync.servers.control import ServiceError, UpdateControl

VERSION_HEADER = "x-weight-version"


@dataclass(frozen=True)
class PoolingSetup:
    """How the engine pools, read once from its ``PoolerConfig`` at start-up."""

    sequence: PoolingType = PoolingType.LAST  # what classify uses
    token: PoolingType = PoolingType.ALL  # what token_classify uses (ALL or STEP)
    step_tag_id: int | None = None  # the configured step tag, if any

    @classmethod
    def from_engine(cls, engine: Any) -> "PoolingSetup":
        cfg = getattr(engine.model_config, "pooler_config", None)
        seq = getattr(cfg, "seq_pooling_type", None) or getattr(cfg, "pooling_type", None)
        tok = getattr(cfg, "tok_pooling_type", None)
        return cls(
            sequence=PoolingType.parse(seq) if seq else PoolingType.LAST,
            token=PoolingType.parse(tok) if tok else PoolingType.ALL,
            step_tag_id=getattr(cfg, "step_tag_id", None),
        )

    @property
    def every_token(self) -> bool:
        """The token pooler returns every position (not only a configured step tag's)."""
        return self.token is PoolingType.ALL or self.step_tag_id is None


@dataclass(frozen=True)
class _Plan:
    """What one request runs: vLLM's task, the pooling reported back, the step tag, and
    whether the rows of the token pooler are pooled here (a sequence pooling per request)."""

    task: str  # "classify" | "token_classify"
    pooling: PoolingType
    tag_id: int | None = None
    pool_here: bool = False


class RewardScorer:
    """Scores texts with an ``AsyncLLM`` pooling engine (``classify`` / ``token_classify``).
    ``activation``: the model's activation, applied to scores pooled here when the request
    asks for it (default: vLLM's, from the engine's model config)."""

    def __init__(self, engine: Any, control: UpdateControl, *, model_name: str,
                 num_labels: int, pooling: PoolingSetup | None = None,
                 tokenizer: Any = None, activation: Any = None) -> None:
        self.engine = engine
        self.control = control
        self.model_name = model_name
        self.num_labels = num_labels
        self.pooling = pooling or PoolingSetup()
        self.tokenizer = tokenizer
        self._activation = activation

    @property
    def activation(self) -> Any:
        if self._activation is None:
            from weightsync._runtime.vllm_compat import classifier_activation

            self._activation = classifier_activation(self.engine.model_config)
        return self._activation

    async def score(self, req: ScoringRequest) -> ScoringResponse:
        plan = self._plan(req)
        empty = [i for i, t in enumerate(req.texts) if not t]
        if empty:
            raise ServiceError(400, f"input: items {empty[:10]} are empty strings; nothing to score")
        async with self.control.serving("score") as version:
            outputs = await asyncio.gather(
                *(self._encode(i, t, req.normalize, plan) for i, t in enumerate(req.texts))
            )
        scores = [s for s, _ in outputs]
        tokens = sum(n for _, n in outputs)
        return ScoringResponse(
            scores, metadata={"model": self.model_name, "usage": {"prompt_tokens": tokens}},
            version=version, pooling_type=plan.pooling)

    # -- checks: every refusal names the field -------------------------------------------------
    def _plan(self, req: ScoringRequest) -> _Plan:
        if req.model is not None and req.model not in (self.model_name, DEFAULT_MODEL_NAME):
            raise ServiceError(404, f"model: {req.model!r} is not served here; this server "
                                    f"serves {self.model_name!r} (also answering to "
                                    f"{DEFAULT_MODEL_NAME!r})")
        labels = req.checked_labels()
        if labels is not None and labels != self.num_labels:
            raise ServiceError(400, f"n_labels: the request expects {labels}, the served "
                                    f"model has {self.num_labels}")
        pooling = PoolingType.parse(req.pooling_type or self.pooling.sequence)
        if pooling is self.pooling.sequence:
            return _Plan("classify", pooling)
        if pooling is PoolingType.STEP:
            return _Plan("token_classify", pooling, self._tag_id(req))
        if not self.pooling.every_token:
            raise ServiceError(
                400, f"pooling_type: {pooling.value!r} is not available: this server's token "
                     f"pooler is STEP with step_tag_id {self.pooling.step_tag_id} and keeps only "
                     f"those positions; send {self.pooling.sequence.value!r} (its sequence "
                     "pooling) or 'step', or use a server with --tok-pooling-type ALL")
        return _Plan("token_classify", pooling, pool_here=pooling.is_sequence_level)

    def _tag_id(self, req: ScoringRequest) -> int:
        from_text = self._resolve_tag(req.step_tag) if req.step_tag is not None else None
        if from_text is not None and req.step_tag_id is not None and from_text != req.step_tag_id:
            raise ServiceError(400, f"step_tag {req.step_tag!r} is token {from_text} but "
                                    f"step_tag_id is {req.step_tag_id}; send one of them")
        tag = req.step_tag_id if req.step_tag_id is not None else from_text
        if tag is None:
            tag = self.pooling.step_tag_id
        if tag is None:
            raise ServiceError(400, "step_tag: pooling_type 'step' needs a step tag: send "
                                    "step_tag (its text) or step_tag_id (its token id), or start "
                                    "the server with --step-tag-id")
        return tag

    def _resolve_tag(self, text: str) -> int:
        if self.tokenizer is None:
            raise ServiceError(400, "step_tag: this server has no tokenizer to resolve it; send "
                                    "step_tag_id instead")
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) != 1:
            raise ServiceError(400, f"step_tag: {text!r} is {len(ids)} tokens {ids[:8]} for this "
                                    "model's tokenizer; a step tag must be exactly one token "
                                    "(e.g. a special token)")
        return int(ids[0])

    # -- the engine ----------------------------------------------------------------------------
    async def _encode(self, index: int, text: str, normalize: bool, plan: _Plan) -> tuple[Any, int]:
        from vllm import PoolingParams

        from weightsync._runtime.vllm_compat import request_error_types

        kwargs: dict[str, Any] = {}
        native_step = plan.tag_id is not None and self.pooling.token is PoolingType.STEP
        if native_step:
            kwargs["step_tag_id"] = plan.tag_id  # vLLM's StepPool keeps only those positions
        # rows pooled here get the activation after pooling, so the engine returns raw rows
        params = PoolingParams(task=plan.task, use_activation=normalize and not plan.pool_here,
                               **kwargs)
        final = None
        try:
            async for out in self.engine.encode(text, params, f"score-{uuid.uuid4().hex}"):
                final = out
        except request_error_types() as e:  # vLLM's input validation (e.g. too long)
            raise ServiceError(400, f"input[{index}]: {e}") from None
        if final is None:  # pragma: no cover
            raise ServiceError(500, f"input[{index}]: the engine returned no output")
        data = final.outputs.data
        token_ids = list(final.prompt_token_ids or [])
        if plan.task == "classify":
            return self._row(data.reshape(-1)), len(token_ids)
        rows = data if data.dim() == 2 else data.reshape(-1, self.num_labels)
        every_row = plan.pool_here or (plan.tag_id is not None and not native_step)
        if every_row and rows.shape[0] != len(token_ids):  # pragma: no cover - vLLM's contract
            raise ServiceError(500, f"input[{index}]: the token pooler returned "
                                        f"{rows.shape[0]} rows for {len(token_ids)} tokens")
        if plan.pool_here:
            pooled = _POOL[plan.pooling](rows.float())
            return self._row(self.activation(pooled) if normalize else pooled), len(token_ids)
        if plan.tag_id is not None and not native_step:
            rows = rows[[i for i, t in enumerate(token_ids) if t == plan.tag_id]]
        return [self._row(r) for r in rows], len(token_ids)

    @staticmethod
    def _row(row: Any) -> Any:
        """One position's head outputs: a float for one column, else the list."""
        values = [float(x) for x in row.tolist()]
        return values[0] if len(values) == 1 else values


#: a sequence pooling over the head's per-token rows ([tokens, labels] -> [labels])
_POOL = {
    PoolingType.LAST: lambda rows: rows[-1],
    PoolingType.MEAN: lambda rows: rows.mean(dim=0),
    PoolingType.CLS: lambda rows: rows[0],
}


def score_router(scorer: RewardScorer, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    """``POST /score {input, model?, normalize?, pooling_type?, ...}`` -> ``{model, data,
    usage, version, pooling_type}``; open (no token), like vLLM's own scoring routes."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    router = APIRouter(route_class=service_route_class())

    @router.post("/score")
    async def score(request: Request) -> Any:
        body = await json_body(request, max_body_bytes)
        try:
            req = ScoringRequest.from_dict(body)
        except ValueError as e:
            raise ServiceError(400, str(e)) from None
        resp = await scorer.score(req)
        return JSONResponse(resp.to_dict(), headers={VERSION_HEADER: str(resp.version)})

    return router
