"""HTTP routes of the reward server (FastAPI), over a ``RewardService``.

Callers: ``weightsync.reward.server`` builds the app in the server process. Bodies are parsed
here by hand so that every bad input gets a 4xx whose reason names the field; nothing received
is unpickled. Errors answer ``{"detail": reason, "offenders": [...]}``.

Routes (issue 3): GET /health, POST /score, GET /runtime_version, GET /get_world_size,
POST /init_communicator {strategy, sync_info, rank_offset?} -> {communicator_id},
POST /update_param_batch {metadata, training_mode, version?, communicator_id?} where
``metadata`` is a start / chunk request / finish dict (its "type" says which),
POST /close_communicator {communicator_id?}, POST /get_num_background_tasks,
POST /reset_prefix_cache. A ``communicator_id`` that is not the current one (another sender
initialised the receivers since) gets 409, so a stale sender never drives the new data plane. With an API key, every
weight/communicator route needs ``Authorization: Bearer <key>`` (or ``X-API-Key``); /health,
/score and /runtime_version stay open.
"""


import hmac
import json
from typing import Any

from weightsync.reward._service import RewardService, ServiceError
from weightsync.reward.types import RewardModelTrainingMode, ScoringRequest


def _error(status: int, message: str, offenders: list[str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body: dict[str, Any] = {"detail": message}
    if offenders:
        body["offenders"] = offenders
    return JSONResponse(body, status_code=status)


async def _json_body(request: Any) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ServiceError(400, f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ServiceError(400, f"body must be a JSON object, got {type(body).__name__}")
    return body


def _field(body: dict, name: str, kind: type | tuple[type, ...], *, required: bool = True,
           default: Any = None) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise ServiceError(400, f"{name}: missing")
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ServiceError(400, f"{name}: expected {_kind_name(kind)}, got bool")
    if not isinstance(value, kind):
        raise ServiceError(400, f"{name}: expected {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {dict: "an object", int: "an integer", str: "a string", bool: "a boolean", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def create_app(service: RewardService, *, api_key: str | None = None) -> Any:
    from fastapi import FastAPI, Request

    app = FastAPI(title="weightsync reward server", docs_url=None, redoc_url=None)

    def check_key(request: Request) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise ServiceError(401, "missing or wrong API token (Authorization: Bearer <key>)")

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, e: ServiceError) -> Any:
        return _error(e.status, e.message, e.offenders)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "type": "reward_model"}

    @app.post("/score")
    async def score(request: Request) -> dict:
        body = await _json_body(request)
        try:
            req = ScoringRequest.from_dict(body)
        except ValueError as e:
            raise ServiceError(400, str(e)) from None
        return (await service.score(req)).to_dict()

    @app.get("/runtime_version")
    async def runtime_version() -> dict:
        return service.runtime_version()

    @app.get("/get_world_size")
    async def get_world_size(request: Request) -> dict:
        check_key(request)
        return {"world_size": await service.world_size()}

    @app.post("/init_communicator")
    async def init_communicator(request: Request) -> dict:
        check_key(request)
        body = await _json_body(request)
        strategy = _field(body, "strategy", dict)
        sync_info = _field(body, "sync_info", dict)
        rank_offset = _field(body, "rank_offset", int, required=False, default=1)
        if rank_offset < 1:
            raise ServiceError(400, f"rank_offset: must be >= 1 (rank 0 is the sender), got {rank_offset}")
        cid = await service.init_communicator(strategy, sync_info, rank_offset)
        return {"ok": True, "world_size": await service.world_size(), "communicator_id": cid}

    @app.post("/update_param_batch")
    async def update_param_batch(request: Request) -> dict:
        check_key(request)
        body = await _json_body(request)
        unknown = sorted(set(body) - {"metadata", "training_mode", "version", "communicator_id"})
        if unknown:
            raise ServiceError(400, f"unknown field(s) {unknown}; expected metadata, "
                                    "training_mode, version (and optionally communicator_id)")
        metadata = _field(body, "metadata", dict)
        if not isinstance(metadata.get("type"), str):
            raise ServiceError(400, "metadata.type: missing; 'start', 'finish' or a strategy's "
                                    "request type")
        raw_mode = _field(body, "training_mode", str, required=False,
                          default=RewardModelTrainingMode.FULL.value)
        try:
            mode = RewardModelTrainingMode.parse(raw_mode)
        except ValueError as e:
            raise ServiceError(400, str(e)) from None
        version = _field(body, "version", int, required=False)
        if version is not None and version < 0:
            raise ServiceError(400, f"version: must be >= 0, got {version}")
        cid = _field(body, "communicator_id", int, required=False)
        return await service.update_param_batch(metadata, mode, version, cid)

    @app.post("/close_communicator")
    async def close_communicator(request: Request) -> dict:
        check_key(request)
        body = await _json_body(request)
        cid = _field(body, "communicator_id", int, required=False)
        if cid is not None and cid != service.communicator_id:
            return {"ok": True, "closed": False,
                    "reason": f"communicator {cid} was already replaced or closed"}
        await service.close_communicator()
        return {"ok": True, "closed": True}

    @app.post("/get_num_background_tasks")
    async def get_num_background_tasks(request: Request) -> dict:
        check_key(request)
        return {"num_background_tasks": service.num_background_tasks()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        check_key(request)
        return {"ok": await service.reset_prefix_cache()}

    return app
