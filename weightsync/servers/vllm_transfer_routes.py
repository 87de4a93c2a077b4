"""vLLM's own weight-transfer HTTP routes on the policy server, driven through our update gate.

Callers: ``weightsync.servers.policy`` (``install``), in the server process. vLLM 0.32 mounts
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/shutdown_weight_transfer_engine`` and ``/server_info`` only with
``VLLM_SERVER_DEV_MODE=1``, and then raw: they call the engine beside the requests it serves and
move no version. Here, when vLLM's own ``--weight-transfer-config`` names a backend (``nccl``,
as TRL's ``VLLMClient`` uses, or weightsync's own ``weightsync``), they are served without dev
mode, behind ``--api-key``, and each update runs inside one update of ``UpdateControl``: the
start drains the requests in flight (``--in-flight-requests finish``) or freezes them in the
engine to continue on the new weights (``continue``), new requests wait, the engine's scheduler
is paused, and the version (``x-weight-version``, ``/runtime_version``) moves only when
``/finish_weight_update`` lands: to the finish's ``weight_version`` when that is an integer
newer than the served version (any integer with ``--allow-version-reset``), else to the served
version + 1. vLLM's engines load what they receive in place, so an update that ends without its
finish after vLLM accepted a part of it (or whose failing call was not a refusal made before any
byte moved) leaves the weights torn: model requests answer 503 until a complete update lands;
one that ends before leaves the last version served (an update the control's watchdog ends is
marked torn here within ``WATCH_S``). ``--serve-during-updates`` without
``continue`` cannot serve the last version while vLLM loads in place: its start is refused. An
update with no call for ``--update-timeout-s`` is aborted by the control's watchdog. vLLM's
calls are not sliced as ours are: a trainer that dies inside a collective holds the engine until
the backend's own timeout. Whatever the config, vLLM's raw dev-mode versions of these routes,
and the dev routes that would change weights or resume a paused scheduler beside the gate
(``RAW_PATHS``), are removed.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' ``Request``
# annotations at definition time, and ``Request`` is imported inside ``router``.

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from weightsync.servers.control import ServiceError, UpdateControl

log = logging.getLogger(__name__)

#: the routes served here (the policy server keeps them out of its request gate)
TRANSFER_PATHS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                  "/finish_weight_update", "/shutdown_weight_transfer_engine")
#: vLLM's dev-mode routes removed whatever the config: the raw versions of ours, and those that
#: would change weights (a draft model's update, the weight checker's reset, any worker call)
#: or resume a scheduler an update paused, beside the gate
RAW_PATHS = TRANSFER_PATHS + ("/server_info", "/start_draft_weight_update",
                              "/update_weight_version", "/weight_checker", "/collective_rpc",
                              "/pause", "/resume")
#: how often an open update checks that the control still runs it (a watchdog may end it)
WATCH_S = 0.5


def backend_of(args: Any) -> str | None:
    """The backend vLLM's ``--weight-transfer-config`` names.

    Args:
        args: vLLM's parsed serve arguments (its ``weight_transfer_config``: vLLM's config
            object, a dict, or None).

    Returns:
        The backend's name, or None when no weight-transfer config was given.
    """
    config = getattr(args, "weight_transfer_config", None)
    if config is None:
        return None
    backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend",
                                                                             None)
    return str(backend) if backend else None


def install(app: Any, control: UpdateControl, engine: Any, args: Any, *,
            api_key: str | None, max_body_bytes: int, timeout_s: float) -> bool:
    """Remove vLLM's raw dev-mode routes (``RAW_PATHS``) from ``app``; mount ours ahead of the
    app's when ``args`` (vLLM's parsed serve arguments) names a weight-transfer backend.

    Args:
        app: vLLM's FastAPI app.
        control: the server's update control.
        engine: vLLM's ``AsyncLLM``.
        args: vLLM's parsed serve arguments.
        api_key: the token our weight routes need (None: open).
        max_body_bytes: the largest body a route reads.
        timeout_s: how long ``/init_weight_transfer_engine`` waits for the trainer's group.

    Returns:
        Whether the routes were mounted.
    """
    from weightsync.servers.control_routes import mount

    app.router.routes[:] = [r for r in app.router.routes
                            if getattr(r, "path", None) not in RAW_PATHS]
    backend = backend_of(args)
    if backend is None:
        return False
    transfer = VLLMTransfer(control, engine, timeout_s=timeout_s)
    mount(app, router(transfer, api_key=api_key, max_body_bytes=max_body_bytes))
    log.info("%s: vLLM's weight-transfer routes served (backend %s), through the update gate",
             control.name, backend)
    return True


@dataclass
class _Open:
    """The update a trainer opened with ``/start_weight_update``."""

    update_id: str
    accepted: int = 0  # /update_weights calls vLLM accepted
    kept: bool = False  # the scheduler was paused here keeping the requests (continue)
    closing: bool = False  # its finish or its abort runs
    watcher: asyncio.Task | None = None


class VLLMTransfer:
    """vLLM's weight-transfer calls on ``engine``, each update inside one of ``control``'s
    (see the module docstring). ``timeout_s``: the longest ``init`` waits. Every call raises
    ``ServiceError`` (the answer's status and reason) when it is refused (409: an update is open
    or none is; 503: requests did not drain) or vLLM's call failed (``service_error``)."""

    def __init__(self, control: UpdateControl, engine: Any, *, timeout_s: float) -> None:
        self.control = control
        self.engine = engine
        self.timeout_s = timeout_s
        self._open: _Open | None = None
        self._lock = asyncio.Lock()  # vLLM's calls one at a time, in the trainer's order

    async def init(self, init_info: dict) -> None:
        """vLLM's ``init_weight_transfer_engine``: the workers join the trainer's group."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        async with self._lock:
            if self._open is not None and not await self._ended(self._open):
                raise ServiceError(409, f"update {self._open.update_id} is open: POST "
                                        f"/finish_weight_update first")
            busy = self.control.active_update
            if busy is not None:
                raise ServiceError(409, f"update {busy} is in progress; initialise the weight "
                                        f"transfer before /start_weight_update or after its finish")
            what = "vLLM's init_weight_transfer_engine"
            try:
                async with self.control._guard(what):
                    await asyncio.wait_for(self.engine.init_weight_transfer_engine(
                        WeightTransferInitRequest(init_info=init_info)), self.timeout_s)
            except TimeoutError:
                raise ServiceError(504, f"{what}: the workers did not join the trainer's group "
                                        f"within {self.timeout_s:g}s") from None
            except ServiceError:
                raise
            except Exception as e:  # noqa: BLE001 - answered with the workers' reason
                raise service_error(e, what) from None

    async def start(self, is_checkpoint_format: bool | None = None) -> dict:
        """Open an update: our start (drain or freeze, pause), then vLLM's
        (``is_checkpoint_format``: for a vLLM whose start takes it; its route's default, True,
        when not given)."""
        from weightsync.types import WeightUpdateStart

        c = self.control
        if c.serve_during_updates and c.in_flight != "continue":
            raise ServiceError(409, "this server serves the last version during updates "
                                    "(--serve-during-updates), but vLLM's weight-transfer "
                                    "engines load in place: start it without that flag, or "
                                    "with --in-flight-requests continue")
        async with self._lock:
            if self._open is not None and not await self._ended(self._open):
                raise ServiceError(409, f"update {self._open.update_id} is open: POST "
                                        f"/finish_weight_update first")
            opened = _Open(f"vllm-{uuid.uuid4().hex[:12]}")
            await c.start(WeightUpdateStart(update_id=opened.update_id).to_dict(), None, None)
            self._open = opened
            try:
                if c.in_flight == "continue":  # no step runs on half-loaded weights
                    opened.kept = True
                    await self.engine.pause_generation(mode="keep", clear_cache=False)
                async with c._guard("vLLM's start_weight_update"):
                    await self.engine.start_weight_update(
                        **start_kwargs(self.engine.start_weight_update, is_checkpoint_format))
            except BaseException as e:
                err = service_error(e, "vLLM's start_weight_update")
                await self._close(opened, err.message, torn=False)
                raise err from None
            opened.watcher = asyncio.ensure_future(self._watch(opened))
            return {"message": "Weight update started", "update_id": opened.update_id,
                    "version": c.version}

    async def update(self, update_info: Any) -> dict:
        """vLLM's ``update_weights`` inside the open update."""
        async with self._lock:
            opened = await self._require_open("/update_weights")
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            what = f"vLLM's update_weights (call {opened.accepted + 1} of update " \
                   f"{opened.update_id})"
            try:
                async with self.control._guard(what):
                    await self.engine.update_weights(
                        WeightTransferUpdateRequest(update_info=update_info))
            except BaseException as e:
                err = service_error(e, what)
                refused = err.error_type is not None and err.status < 500
                await self._close(opened, err.message, torn=opened.accepted > 0 or not refused)
                raise err from None
            opened.accepted += 1
            _touch(self.control, opened.update_id)
            return {"message": "Weights updated", "calls": opened.accepted}

    async def finish(self, weight_version: Any) -> dict:
        """vLLM's finish, then ours: the version is published (see the module docstring)."""
        from weightsync.types import WeightUpdateFinish

        async with self._lock:
            opened = await self._require_open("/finish_weight_update")
            opened.closing = True
            try:
                async with self.control._guard("vLLM's finish_weight_update"):
                    await self.engine.finish_weight_update()
            except BaseException as e:
                err = service_error(e, "vLLM's finish_weight_update")
                await self._close(opened, err.message, torn=opened.accepted > 0)
                raise err from None
            version = published_version(weight_version, self.control)
            finish = WeightUpdateFinish(update_id=opened.update_id, num_chunks=0, ok=True)
            try:
                out = await self.control.finish(finish.to_dict(), version)
            except BaseException as e:
                err = service_error(e, "the finish")
                await self._close(opened, err.message, torn=opened.accepted > 0)
                raise err from None
            await self._release(opened)
            with contextlib.suppress(Exception):  # vLLM's own label (its /weight_info)
                await self.engine.update_weight_version(str(out["version"]))
            return {"message": "Weight update finished", "version": out["version"]}

    async def shutdown(self) -> None:
        """vLLM's ``shutdown_weight_transfer_engine`` (refused while an update is open)."""
        async with self._lock:
            if self._open is not None and not await self._ended(self._open):
                raise ServiceError(409, f"update {self._open.update_id} is open: POST "
                                        f"/finish_weight_update first")
            try:
                async with self.control._guard("vLLM's shutdown_weight_transfer_engine"):
                    await self.engine.shutdown_weight_transfer_engine()
            except ServiceError:
                raise
            except Exception as e:  # noqa: BLE001 - answered with the workers' reason
                raise service_error(e, "vLLM's shutdown_weight_transfer_engine") from None

    # -- the open update ------------------------------------------------------------------------
    async def _require_open(self, route: str) -> _Open:
        opened = self._open
        if opened is None:
            raise ServiceError(409, f"{route} without an open update: POST /start_weight_update "
                                    f"first")
        if await self._ended(opened):
            raise ServiceError(409, f"{route}: update {opened.update_id} was ended by the "
                                    f"server (no call for its idle limit, or superseded by "
                                    f"another update); start a new one")
        return opened

    async def _ended(self, opened: _Open) -> bool:
        """Whether the control no longer runs ``opened`` (its watchdog, or another update,
        ended it); if so, close it here too."""
        if self.control.active_update == opened.update_id:
            return False
        await self._close(opened, f"update {opened.update_id} was ended by the server",
                          torn=opened.accepted > 0)
        return True

    async def _watch(self, opened: _Open) -> None:
        while self._open is opened:
            await asyncio.sleep(WATCH_S)
            if self._open is opened and not opened.closing:
                await self._ended(opened)

    async def _close(self, opened: _Open, why: str, *, torn: bool) -> None:
        """End ``opened`` without publishing: vLLM's update state reset, ours aborted, the
        weights marked torn when they may hold part of it, the scheduler resumed."""
        opened.closing = True
        with contextlib.suppress(Exception):  # vLLM resets its state itself after a failed call
            await self.engine.finish_weight_update()
        await self.control.abort(opened.update_id, why)
        if torn:  # before anything awaits: no request is seated on the weights unmarked
            mark_torn(self.control, f"vLLM's weight update {opened.update_id} did not land "
                                    f"after part of it was loaded: {why}")
        log.warning("%s: vLLM's weight update %s ended without its finish: %s%s",
                    self.control.name, opened.update_id, why,
                    "; the weights are torn" if torn else "")
        await self._release(opened)

    async def _release(self, opened: _Open) -> None:
        if self._open is opened:
            self._open = None
        task, opened.watcher = opened.watcher, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if opened.kept:
            opened.kept = False
            from weightsync._runtime.vllm_compat import resume_generation

            with contextlib.suppress(Exception):  # a dead engine: /health says so
                await resume_generation(self.engine)


def _touch(control: UpdateControl, update_id: str) -> None:
    """A call of the open update came: the control's watchdog counts its idle time anew."""
    active = control._active
    if active is not None and active.update_id == update_id:
        active.last_activity = time.monotonic()


def mark_torn(control: UpdateControl, why: str) -> None:
    """Model requests answer 503 with ``why`` until a complete update lands: the control's
    mirror of the workers' state says torn (vLLM's engine loaded the bytes, not our endpoint,
    so the workers do not know; the next update's start mirrors their state again).

    Args:
        control: the server's update control.
        why: the reason requests and ``/runtime_version`` give.
    """
    states = control.worker_states or [{"version": control.version}]
    control.worker_states = [{**s, "state": "torn", "last_error": why} for s in states]


def start_kwargs(start: Any, is_checkpoint_format: bool | None) -> dict:
    """The arguments of vLLM's ``start_weight_update``.

    Args:
        start: the engine's ``start_weight_update``.
        is_checkpoint_format: what the trainer asked for (None: nothing).

    Returns:
        ``{"is_checkpoint_format": ...}`` for a vLLM whose start takes it (older ones; their
        route's default, True, when the trainer gave none), else ``{}``.
    """
    import inspect

    try:
        takes = "is_checkpoint_format" in inspect.signature(start).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return {}
    return {"is_checkpoint_format": True if is_checkpoint_format is None
            else is_checkpoint_format}


def published_version(weight_version: Any, control: UpdateControl) -> int | None:
    """The version a finish publishes.

    Args:
        weight_version: the finish's ``weight_version`` (a string, an int or None).
        control: the server's update control (its served version, its version policy).

    Returns:
        ``weight_version`` when it is an integer (with ``--monotonic-versions``: one newer
        than the served one); None (the served version + 1) otherwise.
    """
    text = str(weight_version).strip() if weight_version is not None else ""
    if not text.isdigit():
        return None
    version = int(text)
    taken_as_given = not control.policy.monotonic_versions
    return version if taken_as_given or version > control.version else None


def service_error(e: BaseException, what: str) -> ServiceError:
    """An exception of a vLLM call as an HTTP answer.

    Args:
        e: what the call raised.
        what: the call, for the message.

    Returns:
        ``e`` itself when it is a ``ServiceError``; weightsync's typed error when the workers'
        message carries one (its status, type and offenders: the trainer rebuilds it); else a
        500 (504 for a timeout) with the reason.
    """
    if isinstance(e, ServiceError):
        return e
    from weightsync.errors import error_from_text, http_status

    found = error_from_text(str(e))
    if found is None:
        status = 504 if isinstance(e, TimeoutError) else 500
        return ServiceError(status, f"{what}: {type(e).__name__}: {e}")
    return ServiceError(http_status(found), f"{what}: {e}", error_type=type(found).__name__,
                        offenders=list(getattr(found, "offenders", None) or []))


def router(transfer: VLLMTransfer, *, api_key: str | None, max_body_bytes: int) -> Any:
    """The routes (see the module docstring).

    Args:
        transfer: the calls the routes make.
        api_key: the token every route needs (None: open).
        max_body_bytes: the largest body a route reads (413 past it).

    Returns:
        A FastAPI ``APIRouter``.
    """
    from fastapi import APIRouter, Request

    from weightsync.servers._http import field, json_body, service_route_class, token_checker

    r = APIRouter(route_class=service_route_class())
    check_key = token_checker(api_key)

    async def body_of(request: Request, allowed: set[str]) -> dict:
        check_key(request)
        body = await json_body(request, max_body_bytes)
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ServiceError(400, f"unknown field(s) {unknown}; expected {sorted(allowed)}")
        return body

    @r.get("/server_info")
    async def server_info(request: Request) -> Any:
        check_key(request)
        fmt = request.query_params.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise ServiceError(400, f"config_format: 'text' or 'json', got {fmt!r}")
        try:
            from vllm.entrypoints.serve.dev.server_info.api_router import show_server_info
        except ImportError:  # a vLLM that keeps it elsewhere: its config, as text
            return {"vllm_config": str(transfer.engine.vllm_config)}
        return await show_server_info(request, fmt)

    @r.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict:
        body = await body_of(request, {"init_info"})
        await transfer.init(field(body, "init_info", dict))
        return {"message": "Weight transfer initialized"}

    @r.post("/start_weight_update")
    async def start_weight_update(request: Request) -> dict:
        body = await body_of(request, {"is_checkpoint_format"})
        return await transfer.start(field(body, "is_checkpoint_format", bool, required=False))

    @r.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        body = await body_of(request, {"update_info"})
        return await transfer.update(field(body, "update_info", (dict, list)))

    @r.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict:
        body = await body_of(request, {"weight_version"})
        version = body.get("weight_version")
        if version is not None and (isinstance(version, bool)
                                    or not isinstance(version, (str, int))):
            raise ServiceError(400, f"weight_version: a string or null, got "
                                    f"{type(version).__name__}")
        return await transfer.finish(version)

    @r.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine(request: Request) -> dict:
        await body_of(request, set())
        await transfer.shutdown()
        return {"message": "Weight transfer shut down"}

    return r
