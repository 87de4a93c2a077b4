"""The weight-sync control plane as one FastAPI router, mounted by the reward and the policy
server.

Callers: ``weightsync.servers.reward`` and ``weightsync.servers.policy`` (``mount``), in the
server process. Two dialects share the routes; the body's shape says which:

====================================  =================================================  ==========================================
route                                 our dialect (weightsync senders)                   Ludic / TRL trainers (``servers.ludic``)
====================================  =================================================  ==========================================
GET  /runtime_version (open)          ``{version, state, update_in_progress}``           same (``version`` is what Ludic reads)
GET  /get_world_size                  ``{world_size}`` (workers: TP x PP)                same
POST /init_communicator               ``{strategy, sync_info, rank_offset?}``            ``{host, port, world_size, backend?}``
                                      -> ``{ok, world_size, communicator_id}``           -> ``{status: ok}`` (group joins after)
POST /update_param_batch              ``{metadata: start|chunk|finish|apply dict,``      ``{metadata: [{name, dtype, shape}],``
                                      ``training_mode?, version?, communicator_id?}``    ``version?, training_mode?}`` -> ``batch_id``
POST /close_communicator              ``{communicator_id?}``                             ``{}``
POST /get_num_background_tasks        ``{num_background_tasks}``                         same (poll until 0 after a batch)
POST /reset_prefix_cache              ``{ok, status}``                                   same
GET  /batch_ready/{batch_id}          --                                                 ``{ready}`` (Ludic's ready signal)
====================================  =================================================  ==========================================

``apply`` (``{type: apply, start | null, requests, finish}``) is a whole update, or a started
update's requests and finish, in one call (``UpdateControl.apply``). A ``communicator_id`` that
is not the current one gets 409 (another sender took the
receivers), so a stale sender never drives the new data plane.

Every route answers within a bound, whatever the body (``docs/reliability.md``, section 7):
``/runtime_version``, ``/get_world_size``, ``/get_num_background_tasks`` and ``/batch_ready``
call no worker; ``/reset_prefix_cache`` waits at most ``ENGINE_CALL_TIMEOUT_S`` (5 s, then 504
naming the worker calls in progress); ``/init_communicator`` and ``/close_communicator`` abandon
a worker call still in progress (a join nobody completes) instead of waiting for it; a control
call waits at most the server's wait timeout for the one in progress (503 naming it). Errors: 400 (bad field; with
``offenders`` when the engine refused tensors), 401 (token), 404, 409 (wrong state), 413 (body
too large), 503 (torn, or requests did not drain), 504 (timeout). With an API key every route
but ``/runtime_version`` (and each server's ``/health``) needs ``Authorization: Bearer <key>``
(or ``X-API-Key``).
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' ``Request``
# annotations at definition time, and ``Request`` is imported inside the router factories.

from typing import Any

from weightsync.servers._http import (
    DEFAULT_MAX_BODY_BYTES,
    field,
    json_body,
    service_route_class,
    token_checker,
)
from weightsync.servers.control import ServiceError, UpdateControl
from weightsync.servers.ludic import LudicDialect
from weightsync.types import TrainingMode

#: the paths of the control plane (the policy server keeps them out of its request gate)
CONTROL_PATHS = (
    "/runtime_version", "/get_world_size", "/init_communicator", "/update_param_batch",
    "/close_communicator", "/get_num_background_tasks", "/reset_prefix_cache", "/batch_ready",
)


def _training_mode(body: dict) -> TrainingMode | None:
    raw = field(body, "training_mode", str, required=False)
    if raw is None:
        return None
    try:
        return TrainingMode.parse(raw)
    except ValueError as e:
        raise ServiceError(400, str(e)) from None


def _version(body: dict) -> int | None:
    value = body.get("version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServiceError(400, f"version: expected an integer, got {type(value).__name__}")
    if value < 0:
        raise ServiceError(400, f"version: must be >= 0, got {value}")
    return value


def control_router(
    control: UpdateControl,
    ludic: LudicDialect,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Any:
    from fastapi import APIRouter, Request

    router = APIRouter(route_class=service_route_class())
    check_key = token_checker(api_key)

    async def body_of(request: Request) -> dict:
        check_key(request)
        return await json_body(request, max_body_bytes)

    @router.get("/runtime_version")
    async def runtime_version() -> dict:
        return control.runtime_version()

    @router.get("/get_world_size")
    async def get_world_size(request: Request) -> dict:
        check_key(request)
        return {"world_size": await control.world_size()}

    @router.post("/init_communicator")
    async def init_communicator(request: Request) -> dict:
        body = await body_of(request)
        ours, theirs = {"strategy", "sync_info"} & set(body), {"host", "port", "world_size"} & set(body)
        if theirs and not ours:
            return await ludic.init_communicator(body)
        if not ours or theirs:
            raise ServiceError(400, "body: give either {strategy, sync_info, rank_offset?} "
                                    "(weightsync senders) or {host, port, world_size} (a "
                                    f"Ludic/TRL trainer group); got fields {sorted(body)}")
        unknown = sorted(set(body) - {"strategy", "sync_info", "rank_offset"})
        if unknown:
            raise ServiceError(400, f"unknown field(s) {unknown}; expected strategy, sync_info, "
                                    "rank_offset")
        strategy = field(body, "strategy", dict)
        sync_info = field(body, "sync_info", dict)
        rank_offset = field(body, "rank_offset", int, required=False, default=1)
        if rank_offset < 1:
            raise ServiceError(400, f"rank_offset: must be >= 1 (rank 0 is the sender), got {rank_offset}")
        cid = await control.init_communicator(strategy, sync_info, rank_offset)
        return {"ok": True, "world_size": await control.world_size(), "communicator_id": cid}

    @router.post("/update_param_batch")
    async def update_param_batch(request: Request) -> dict:
        body = await body_of(request)
        unknown = sorted(set(body) - {"metadata", "training_mode", "version", "communicator_id"})
        if unknown:
            raise ServiceError(400, f"unknown field(s) {unknown}; expected metadata, "
                                    "training_mode, version (and optionally communicator_id)")
        metadata = field(body, "metadata", (dict, list))
        mode = _training_mode(body)
        version = _version(body)
        if isinstance(metadata, list):  # the Ludic form: the whole manifest, bytes follow
            if body.get("communicator_id") is not None:
                raise ServiceError(400, "communicator_id: not part of the list form of metadata")
            return await ludic.update_param_batch(metadata, version, mode)
        if not isinstance(metadata.get("type"), str):
            raise ServiceError(400, "metadata.type: missing; 'start', 'finish' or a strategy's "
                                    "request type")
        cid = field(body, "communicator_id", int, required=False)
        return await control.update_param_batch(metadata, mode, version, cid)

    @router.post("/close_communicator")
    async def close_communicator(request: Request) -> dict:
        body = await body_of(request)
        cid = field(body, "communicator_id", int, required=False)
        if cid is not None and cid != control.communicator_id:
            return {"ok": True, "status": "ok", "closed": False,
                    "reason": f"communicator {cid} was already replaced or closed"}
        await control.close_communicator()
        return {"ok": True, "status": "ok", "closed": True}

    @router.post("/get_num_background_tasks")
    async def get_num_background_tasks(request: Request) -> dict:
        check_key(request)
        return {"num_background_tasks": control.num_background_tasks()}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        check_key(request)
        ok = await control.reset_prefix_cache()
        return {"ok": ok, "status": "ok" if ok else "failed"}

    @router.get("/batch_ready/{batch_id}")
    async def batch_ready(batch_id: str, request: Request) -> dict:
        check_key(request)
        return ludic.batch_ready(batch_id)

    return router


def mount(app: Any, router: Any) -> None:
    """Add ``router``'s routes to ``app`` ahead of the app's own, so ours win where paths clash
    (vLLM's dev-mode ``/reset_prefix_cache``, its ``/health``)."""
    routes = app.router.routes
    before = len(routes)
    app.include_router(router)
    ours = routes[before:]
    del routes[before:]
    routes[:0] = ours
