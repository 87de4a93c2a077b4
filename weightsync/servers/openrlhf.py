"""``POST /get_reward`` on the reward server: OpenRLHF's remote reward model, answered exactly.

OpenRLHF's trainer (``--remote_rm_url http://host:port/get_reward``) posts ``{"query": [texts],
"prompts": [texts], "labels": [...]}`` (``query`` is the prompt and the response, as the reward
model reads them; ``prompts`` and ``labels`` are optional and must match ``query`` in length)
and reads ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``: one float per query.
Here ``rewards`` and ``scores`` are the reward model's raw score of each query (vLLM's
``classify`` without activation, what transformers computes; OpenRLHF's own server returns its
value head's raw output too), ``extra_logs`` carries ``weight_version`` per query (logged by
OpenRLHF beside its metrics), and ``version`` / ``x-weight-version`` say which weights scored
them. A query is scored as sent, as OpenRLHF's own server scores it (no special token added or
stripped): send the text your reward model was trained on.

Callers: ``weightsync.servers.reward`` mounts ``get_reward_router`` (open, like ``/score``), in
the server process; the scoring itself is ``RewardScorer.score`` (one weight version for the
whole request, behind the update gate). A malformed body is a 400 naming the field.
"""

# no ``from __future__ import annotations``: FastAPI reads the handler's ``Request`` annotation

from typing import Any

from weightsync.reward.types import ScoringRequest
from weightsync.servers._http import DEFAULT_MAX_BODY_BYTES, json_body, service_route_class
from weightsync.servers.control import ServiceError
from weightsync.servers.scoring import VERSION_HEADER, RewardScorer

FIELDS = ("query", "prompts", "labels")


def parse_get_reward(body: dict) -> list[str]:
    """The queries of a ``/get_reward`` body; ``ServiceError(400)`` naming what is wrong."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ServiceError(400, f"unknown field(s) {unknown}; /get_reward takes query (required), "
                                "prompts and labels (OpenRLHF's remote reward model request)")
    if "query" not in body:
        raise ServiceError(400, "query: missing; give the texts to score (prompt + response), a "
                                "list of strings")
    queries = body["query"]
    if not isinstance(queries, list) or not queries:
        raise ServiceError(400, f"query: must be a non-empty list of strings, got "
                                f"{type(queries).__name__ if not isinstance(queries, list) else 'an empty list'}")
    bad = [i for i, q in enumerate(queries) if not isinstance(q, str) or not q]
    if bad:
        raise ServiceError(400, f"query: items {bad[:10]} are not non-empty strings")
    for name in ("prompts", "labels"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != len(queries):
            got = f"{len(value)} items" if isinstance(value, list) else type(value).__name__
            raise ServiceError(400, f"{name}: must be a list with one entry per query "
                                    f"({len(queries)}), got {got}")
    return queries


def get_reward_router(scorer: RewardScorer, *,
                      max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    """``POST /get_reward`` (see the module docstring)."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    router = APIRouter(route_class=service_route_class())

    @router.post("/get_reward")
    async def get_reward(request: Request) -> Any:
        queries = parse_get_reward(await json_body(request, max_body_bytes))
        if scorer.num_labels != 1:
            raise ServiceError(400, f"/get_reward returns one reward per query; this server's "
                                    f"model has {scorer.num_labels} labels: use /score or "
                                    "/classify for its label vectors")
        resp = await scorer.score(ScoringRequest(inputs=queries, pooling_type=None,
                                                 normalize=False))
        rewards = [float(s) for s in resp.scores]
        return JSONResponse({"rewards": rewards, "scores": rewards,
                             "extra_logs": {"weight_version": [resp.version] * len(rewards)},
                             "version": resp.version},
                            headers={VERSION_HEADER: str(resp.version)})

    return router
