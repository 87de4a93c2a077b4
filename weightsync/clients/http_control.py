"""``HttpChannel``: the channel to a server's HTTP weight-sync control plane (the reward server,
the policy server).

Lives in the sending process. The endpoint protocol maps onto the server's routes:

    world_size()              GET  /get_world_size                 -> {world_size}
    init_weight_transfer      POST /init_communicator   {strategy, sync_info, rank_offset}
                                                                  -> {communicator_id}
    start_weight_update       POST /update_param_batch  {metadata: start, training_mode?,
                                                         version?, communicator_id?}
    update_named_weights      POST /update_param_batch  {metadata: request, training_mode?, ...}
    finish_weight_update      POST /update_param_batch  {metadata: finish, training_mode?, ...}
                                                                  -> {version}
    apply_update              POST /update_param_batch  {metadata: {type: apply, start (or null:
                                                         started by its own call), requests,
                                                         finish}, training_mode?, ...} -> {version}
    close_weight_transfer     POST /close_communicator  {communicator_id?}
    status                    GET  /runtime_version                -> {version, state, ...}

``training_mode`` is the start's (omitted when the start has none: the server applies its
default) and is repeated on every call of that update, as the server requires. The
``communicator_id`` the server handed out travels with every update call, so a server whose
receivers another sender took answers 409 (``CommunicatorReplacedError``) instead of driving
the wrong data plane. Error answers are rebuilt by the codec (``error_from_http``); an
address where nothing answered yet refusing the connection is an ``EngineUnreachableError``
(no engine there: a wrong URL, a server not started), a connection that breaks once the server
had answered an ``EngineDiedError``, no answer in time a ``WeightSyncTimeout``. Not ordered: HTTP requests may overtake each other, so a sender keeps one
chunk in flight. With ``api_key`` every call sends ``Authorization: Bearer <key>``. Carries the
endpoint's ``apply_update`` (``one_call``): a one-chunk update, or a streamed broadcast's request
with its finish, is one POST.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from weightsync._runtime.http import LoopClients, error_from_response
from weightsync.errors import (
    EngineDiedError,
    EngineUnreachableError,
    WeightSyncError,
    WeightSyncTimeout,
)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def server_strategy(host: str, group_port: int | None = None) -> dict[str, Any]:
    """The strategy a trainer-side client of one server at ``host`` uses when given none (the
    reward and the policy client): a ``broadcast`` group the trainer hosts on ``group_port``
    (None: a free one), which a server on this machine's loopback reaches at 127.0.0.1 (any
    other server at this node's address, the strategy's default). No ``backend``: it follows
    the tensors (``config.broadcast_backend``)."""
    cfg: dict[str, Any] = {"type": "broadcast"}
    if group_port:
        cfg["master_port"] = int(group_port)
    if host in _LOOPBACK:
        cfg["master_addr"] = "127.0.0.1"
    return cfg


class HttpChannel:
    ordered = False
    one_call = True  # the server runs apply_update's steps for one POST (UpdateControl.apply)

    def __init__(self, base_url: str, *, api_key: str | None = None, name: str | None = None,
                 timeout_s: float = 30.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.communicator_id: int | None = None
        self._training_mode: str | None = None
        self._answered = False  # whether the server ever answered this channel
        self._http = LoopClients(
            timeout_s=self.timeout_s,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    async def world_size(self) -> int:
        answer = await self._request("GET", "/get_world_size", None, self.timeout_s)
        return int(answer["world_size"])

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        route = _ROUTES.get(method)
        if route is None:
            raise WeightSyncError(f"{self.name}: no control-plane route for {method!r}")
        return route(self, timeout_s, **kwargs)

    # -- the routes ----------------------------------------------------------------------------
    async def _init(self, timeout_s: float, *, strategy_cfg: dict, sync_info: dict,
                    rank_offset: int) -> None:
        answer = await self._request("POST", "/init_communicator", {
            "strategy": strategy_cfg, "sync_info": sync_info, "rank_offset": rank_offset,
        }, timeout_s)
        self.communicator_id = answer.get("communicator_id")

    async def _start(self, timeout_s: float, *, start: dict) -> None:
        mode = start.get("training_mode")
        self._training_mode = str(mode) if mode is not None else None
        extra = {"version": start["version"]} if start.get("version") is not None else {}
        await self._request("POST", "/update_param_batch", self._update_body(start, extra),
                            timeout_s)

    async def _chunk(self, timeout_s: float, *, request: dict) -> None:
        await self._request("POST", "/update_param_batch", self._update_body(request), timeout_s)

    async def _finish(self, timeout_s: float, *, finish: dict) -> int | None:
        answer = await self._request("POST", "/update_param_batch", self._update_body(finish),
                                     timeout_s)
        version = answer.get("version")
        return int(version) if version is not None else None

    async def _apply(self, timeout_s: float, *, start: dict | None, requests: list[dict],
                     finish: dict) -> int | None:
        extra: dict[str, Any] = {}
        if start is not None:  # as _start: the mode then travels with the update's calls
            mode = start.get("training_mode")
            self._training_mode = str(mode) if mode is not None else None
            if start.get("version") is not None:
                extra["version"] = start["version"]
        body = {"type": "apply", "start": start, "requests": requests, "finish": finish}
        answer = await self._request("POST", "/update_param_batch",
                                     self._update_body(body, extra), timeout_s)
        version = answer.get("version")
        return int(version) if version is not None else None

    async def _close(self, timeout_s: float) -> None:
        body = {"communicator_id": self.communicator_id} if self.communicator_id is not None else {}
        await self._request("POST", "/close_communicator", body, timeout_s)
        self.communicator_id = None

    async def _status(self, timeout_s: float) -> dict[str, Any]:
        answer = await self._request("GET", "/runtime_version", None, timeout_s)
        return {"name": self.name, **answer}

    def _update_body(self, metadata: dict, extra: dict | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"metadata": metadata, **(extra or {})}
        if self._training_mode is not None:
            body["training_mode"] = self._training_mode
        if self.communicator_id is not None:
            body["communicator_id"] = self.communicator_id
        return body

    # -- HTTP plumbing -------------------------------------------------------------------------
    async def _request(self, verb: str, path: str, body: dict | None, timeout_s: float) -> dict:
        import httpx

        where = self.base_url + path
        try:
            if verb == "GET":
                r = await self._http.get().get(where, timeout=timeout_s)
            else:
                r = await self._http.get().post(where, json=body or {}, timeout=timeout_s)
        except httpx.TimeoutException as e:
            raise WeightSyncTimeout(
                f"{where}: no answer within {timeout_s:g}s ({type(e).__name__})"
            ) from None
        except httpx.ConnectError as e:
            if not self._answered:
                raise EngineUnreachableError(
                    f"no engine at {self.base_url}: nothing answers there ({e}); check the URL "
                    f"and port, or start a server there (weightsync serve-policy / "
                    f"serve-reward --model DIR --port PORT) and wait for its ready line"
                ) from None
            raise EngineDiedError(f"{where}: {type(e).__name__}: {e}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise EngineDiedError(f"{where}: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{where}: {type(e).__name__}: {e}") from None
        self._answered = True
        if r.status_code < 400:
            return r.json()
        raise error_from_response(where, r)

    async def aclose(self) -> None:
        await self._http.aclose()

    def __repr__(self) -> str:
        return f"HttpChannel({self.base_url!r})"


_ROUTES = {
    "init_weight_transfer": HttpChannel._init,
    "start_weight_update": HttpChannel._start,
    "update_named_weights": HttpChannel._chunk,
    "finish_weight_update": HttpChannel._finish,
    "apply_update": HttpChannel._apply,
    "close_weight_transfer": HttpChannel._close,
    "status": HttpChannel._status,
}
