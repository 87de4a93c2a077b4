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
- ``pooling_type``: vLLM fixes the sequence pooling (LAST / MEAN / CLS) when the engine starts,
  so a request may name the configured one (or omit it) and is refused (400, naming the field)
  otherwise. ``step`` and ``all`` run vLLM's token pooler (``token_classify``, per-token head
  outputs) in the same engine: ``all`` returns a score per token, ``step`` one per occurrence of
  the step tag (``step_tag`` text, resolved with the server's tokenizer, or ``step_tag_id``, or
  the server's configured tag). On a server started with token pooling STEP vLLM selects the
  tag positions itself (``PoolingParams.step_tag_id``); with the default ALL this module picks
  them from the per-token output. Either way the score at a tag is the score of the text up to
  and including the tag (causal attention), i.e. what a separate request per step prefix gives.
- ``return_hidden_states``: False only; True is refused (400): vLLM's classification pooler
  returns the head's outputs, a ``*ForSequenceClassification`` engine has no hidden-state task.
- ``n_labels``: checked against the model's (400 on a difference).
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


@dataclass(frozen=True)
class _Plan:
    """What one request runs: vLLM's task, the pooling reported back, the step tag."""

    task: str  # "classify" | "token_classify"
    pooling: PoolingType
    tag_id: int | None = None


class RewardScorer:
    """Scores texts with an ``AsyncLLM`` pooling engine (``classify`` / ``token_classify``)."""

    def __init__(self, engine: Any, control: UpdateControl, *, model_name: str,
                 num_labels: int, pooling: PoolingSetup | None = None,
                 tokenizer: Any = None) -> None:
        self.engine = engine
        self.control = control
        self.model_name = model_name
        self.num_labels = num_labels
        self.pooling = pooling or PoolingSetup()
        self.tokenizer = tokenizer

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
        return ScoringResponse(scores, version=version, prompt_tokens=tokens,
                               model=self.model_name, pooling_type=plan.pooling)

    # -- checks: every refusal names the field -------------------------------------------------
    def _plan(self, req: ScoringRequest) -> _Plan:
        if req.model is not None and req.model not in (self.model_name, DEFAULT_MODEL_NAME):
            raise ServiceError(404, f"model: {req.model!r} is not served here; this server "
                                    f"serves {self.model_name!r} (also answering to "
                                    f"{DEFAULT_MODEL_NAME!r})")
        if req.return_hidden_states:
            raise ServiceError(400, "return_hidden_states: not available on this server: vLLM's "
                                    "classification pooler returns only the head's outputs; "
                                    "send false or leave it out")
        if req.n_labels is not None and req.n_labels != self.num_labels:
            raise ServiceError(400, f"n_labels: the request expects {req.n_labels}, the served "
                                    f"model has {self.num_labels}")
        pooling = PoolingType.parse(req.pooling_type or self.pooling.sequence)
        if pooling.is_sequence_level:
            if pooling is not self.pooling.sequence:
                raise ServiceError(
                    400, f"pooling_type: {pooling.wire!r} is not this server's sequence pooling "
                         f"({self.pooling.sequence.wire!r}); vLLM fixes it when the engine "
                         f"starts: omit pooling_type, send {self.pooling.sequence.wire!r}, or "
                         f"start a server with --pooling-type {pooling.value}")
            return _Plan("classify", pooling)
        if pooling is PoolingType.ALL:
            if self.pooling.token is PoolingType.STEP and self.pooling.step_tag_id is not None:
                raise ServiceError(
                    400, "pooling_type: 'all' is not available: this server's token pooler is "
                         f"STEP with step_tag_id {self.pooling.step_tag_id} and keeps only those "
                         "positions; use 'step', or a server with --tok-pooling-type ALL")
            return _Plan("token_classify", pooling)
        return _Plan("token_classify", pooling, self._tag_id(req))

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
        params = PoolingParams(task=plan.task, use_activation=normalize, **kwargs)
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
        if plan.tag_id is not None and not native_step:
            if rows.shape[0] != len(token_ids):  # pragma: no cover - vLLM's ALL contract
                raise ServiceError(500, f"input[{index}]: the token pooler returned "
                                        f"{rows.shape[0]} rows for {len(token_ids)} tokens")
            rows = rows[[i for i, t in enumerate(token_ids) if t == plan.tag_id]]
        return [self._row(r) for r in rows], len(token_ids)

    @staticmethod
    def _row(row: Any) -> Any:
        """One position's head outputs: a float for one column, else the list."""
        values = [float(x) for x in row.tolist()]
        return values[0] if len(values) == 1 else values


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
