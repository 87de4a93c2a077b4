"""The trainer side's HTTP plumbing: an httpx client per event loop, error answers decoded.

Callers, in the training process: ``weightsync.clients.http_control`` (``HttpChannel``, the
control plane), ``weightsync.policy.client`` and ``weightsync.reward.client`` (generation,
scoring). An ``httpx.AsyncClient`` is bound to the event loop that first used it, and one object
may be used from several loops in turn (a blocking twin's private loop, then ``asyncio.run``),
so ``LoopClients`` keeps one client for the loop in use and makes a new one when the loop
changes. ``error_from_response`` turns an error answer into the error the codec
(``weightsync.errors.error_from_http``) rebuilds from it.

The other side of those connections: ``default_keep_alive_s``, how long every HTTP server
weightsync runs keeps an idle connection (the policy and reward servers,
``weightsync.servers._serving``; the reward loop's router, ``weightsync.reward_loop.router``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

#: seconds an idle keep-alive connection stays open (``--keep-alive-timeout-s``) unless vLLM's
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` says otherwise. Longer than the idle expiry of common HTTP
#: clients (httpx 5 s, aiohttp 15 s) and load balancers (60 s), so the client always drops an
#: idle connection before the server does. With uvicorn's 5 s (vLLM's default) a client
#: that reuses a connection idle for about 5 s (a trainer thread that was busy, a request every
#: few seconds) races the server's close and gets "Server disconnected without sending a
#: response" instead of an answer: seen under load (tests/integration/servers, the load test;
#: the reward loop's router, tests/integration/reward_loop).
KEEP_ALIVE_TIMEOUT_S = 65.0
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"


def default_keep_alive_s() -> float:
    """``$VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` when set (what ``vllm serve`` would use), else
    ``KEEP_ALIVE_TIMEOUT_S``."""
    raw = os.environ.get(KEEP_ALIVE_ENV)
    if not raw:
        return KEEP_ALIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${KEEP_ALIVE_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"${KEEP_ALIVE_ENV} must be > 0 seconds, got {raw!r}")
    return value


class LoopClients:
    """One ``httpx.AsyncClient`` (with ``headers`` and ``timeout_s``) for the running event
    loop, made on first use there; a client of an earlier loop is dropped, not reused."""

    def __init__(self, *, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._clients: dict[int, Any] = {}

    def get(self) -> Any:
        """The client of the running loop (call from a coroutine)."""
        import httpx

        key = id(asyncio.get_running_loop())
        client = self._clients.get(key)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(headers=self.headers,
                                       timeout=httpx.Timeout(self.timeout_s))
            self._clients = {key: client}
        return client

    async def aclose(self) -> None:
        """Close the client; one whose loop is gone is just dropped."""
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                await c.aclose()
            except RuntimeError:  # its loop is gone
                pass


def error_from_response(where: str, response: Any) -> BaseException:
    """The error for an HTTP error answer at ``where``: its JSON body (or the start of its
    text) through the codec."""
    from weightsync.errors import error_from_http

    try:
        body: Any = response.json()
    except ValueError:
        body = {"detail": response.text[:2000]}
    return error_from_http(response.status_code, body, where=where)
