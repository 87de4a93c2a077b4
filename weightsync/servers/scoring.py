"""``POST /score`` on the reward server: texts -> scores from one complete weight version.

Callers: ``weightsync.servers.reward`` (mounts ``score_router``), in the server process. A
score request holds the read side of the update gate (``UpdateControl.serving``) while its
texts run, so every score in one response comes from one version, which the body
(``"version"``) and the ``x-weight-version`` header report.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' ``Request``
# annotations at definition time, and ``Request`` is imported inside the router factories.

import asyncio
import uuid
from typing import Any

from weightsync.reward.types import ScoringRequest, ScoringResponse
from weightsync.servers._http import (
    DEFAULT_MAX_BODY_BYTES,
    json_body,
    service_route_class,
)
from weightsync.servers.control import ServiceError, UpdateControl

VERSION_HEADER = "x-weight-version"


class RewardScorer:
    """Scores texts with an ``AsyncLLM`` pooling engine (``classify`` task)."""

    def __init__(self, engine: Any, control: UpdateControl, *, model_name: str,
                 num_labels: int) -> None:
        self.engine = engine
        self.control = control
        self.model_name = model_name
        self.num_labels = num_labels

    async def score(self, req: ScoringRequest) -> ScoringResponse:
        if req.model is not None and req.model != self.model_name:
            raise ServiceError(404, f"model: {req.model!r} is not served here; this server "
                                    f"serves {self.model_name!r}")
        empty = [i for i, t in enumerate(req.texts) if not t]
        if empty:
            raise ServiceError(400, f"input: items {empty[:10]} are empty strings; nothing to score")
        async with self.control.serving("score") as version:
            outputs = await asyncio.gather(
                *(self._encode(i, t, req.use_activation) for i, t in enumerate(req.texts))
            )
        scores = [s for s, _ in outputs]
        tokens = sum(n for _, n in outputs)
        return ScoringResponse(scores, version=version, prompt_tokens=tokens, model=self.model_name)

    async def _encode(self, index: int, text: str, use_activation: bool) -> tuple[Any, int]:
        from vllm import PoolingParams

        from weightsync._runtime.vllm_compat import request_error_types

        params = PoolingParams(task="classify", use_activation=use_activation)
        final = None
        try:
            async for out in self.engine.encode(text, params, f"score-{uuid.uuid4().hex}"):
                final = out
        except request_error_types() as e:  # vLLM's input validation (e.g. too long)
            raise ServiceError(400, f"input[{index}]: {e}") from None
        if final is None:  # pragma: no cover
            raise ServiceError(500, f"input[{index}]: the engine returned no output")
        data = final.outputs.data
        values = [float(x) for x in data.reshape(-1).tolist()]
        score: Any = values[0] if self.num_labels == 1 else values
        return score, len(final.prompt_token_ids or [])


def score_router(scorer: RewardScorer, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    """``POST /score {input, model?, use_activation?}`` -> ``{model, data, usage, version}``;
    open (no token), like vLLM's own scoring routes."""
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
