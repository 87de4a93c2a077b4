"""The reward router: one address in front of several reward (or judge) servers.

``RewardRouter(server_urls, cfg)`` is an HTTP proxy (FastAPI on uvicorn) that the reward loop's
workers and reward functions reach at ``reward_router_address`` (``host:port``, verl's form).
It runs on an event loop of its own (``RewardModelManager`` hosts it on a thread) and forwards
the model routes of the servers behind it: the scoring routes (``SCORING_PATHS``: vLLM's
``/classify``, ``/pooling``, ``/v1/score``, ...; ours ``/score``; OpenRLHF's ``/get_reward``),
generation (``/v1/chat/completions``, ``/v1/completions``: a generative judge on
``weightsync serve-policy``) and a few read-only routes. Anything else (the weight-sync control
plane above all) is refused: a push must reach every server, and goes through
``weightsync.connect`` over all of them (``RewardModelManager.push``), never through one.

What it promises:

- **Least outstanding requests**: each request goes to the healthy server with the fewest
  requests in flight through this router (ties: the one that served fewer).
- **Health**: every server must answer ``/health`` and ``/runtime_version`` at ``start``; a
  background check repeats that every ``health_check_interval_s``; a server whose connection
  fails is marked unhealthy at once and gets no more requests until a check finds it back.
- **Versions**: each server's weight version is known from the checks and from the
  ``x-weight-version`` header of every answer. While two healthy servers report different
  versions a request is refused (409, each server and its version named) unless
  ``allow_mixed_versions``; an answer that reveals a new version is refused the same way
  rather than returned, so a batch never mixes versions unless told. A request with an
  ``x-weight-version: N`` header is served only by a server at version N.
- **Failures**: fail fast by default: a server that fails (connection lost, 502/503/504) turns
  into a 502 answer naming it. With ``max_retries > 0`` a scoring request is retried on another
  server (at most that many times, ``retry_backoff_s`` apart); generation and everything else
  is never retried. A 4xx from a server is passed on unchanged (bad input stays the caller's).

Answers are passed on whole (a streamed answer is buffered), with the server's status, body,
``content-type`` and ``x-weight-version``, plus ``x-weightsync-server`` naming the server.
Router errors answer ``{"detail": ..., "server": url | null}``.
"""

# no ``from __future__ import annotations``: FastAPI reads the proxy's ``Request`` annotation
# at definition time, and ``Request`` is imported inside ``RewardRouter.app``.

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

VERSION_HEADER = "x-weight-version"
SERVER_HEADER = "x-weightsync-server"

#: routes that score (retryable: scoring twice gives the same answer)
SCORING_PATHS = ("/classify", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/v1/embeddings", "/v2/embed", "/get_reward")
#: routes that generate (a judge's verdict): forwarded, never retried
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
#: read-only routes, answered by any server
INFO_PATHS = ("/v1/models", "/tokenize", "/detokenize")
FORWARDED = SCORING_PATHS + GENERATION_PATHS + INFO_PATHS


@dataclass(kw_only=True)
class RouterConfig:
    """``reward_model.router``. ``host``/``port``: where the router listens (port 0: a free
    one; bind the node's address instead of 127.0.0.1 when workers run on other machines)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_retries: int = 0
    retry_backoff_s: float = 0.5
    health_check_interval_s: float = 5.0
    request_timeout_s: float = 300.0
    allow_mixed_versions: bool = False

    def check(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"reward_model.router.max_retries: must be >= 0, got "
                             f"{self.max_retries}")
        for name in ("retry_backoff_s", "health_check_interval_s", "request_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "retry_backoff_s"):
                raise ValueError(f"reward_model.router.{name}: must be a positive number of "
                                 f"seconds, got {value!r}")


class RouterError(Exception):
    """An answer the router gives itself: ``status``, a message, the server it concerns."""

    def __init__(self, status: int, message: str, server: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.server = status, message, server


@dataclass
class ServerState:
    """What the router knows of one server."""

    url: str
    healthy: bool = True
    version: int | None = None
    kind: str = ""  # "reward" (a reward server) or "generative" (a policy server: a judge)
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    last_error: str = ""
    checked_at: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        state = "healthy" if self.healthy else f"unhealthy ({self.last_error or 'no answer'})"
        return f"{self.url} (version {self.version}, {state})"


class RewardRouter:
    """See the module docstring. Lives on one event loop: ``start`` / ``stop`` / ``forward``
    and the served app all run there."""

    def __init__(self, server_urls: list[str], cfg: RouterConfig | None = None) -> None:
        if not server_urls:
            raise ValueError("server_urls: the router needs at least one server")
        self.cfg = cfg or RouterConfig()
        self.cfg.check()
        self.servers = [ServerState(u.rstrip("/")) for u in server_urls]
        if len({s.url for s in self.servers}) != len(self.servers):
            raise ValueError(f"server_urls: a server is listed twice: {server_urls}")
        self.port: int | None = None
        self.http: Any = None
        self._uvicorn: Any = None
        self._serving: asyncio.Task | None = None
        self._checker: asyncio.Task | None = None

    # -- life cycle ------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port`` (verl's ``reward_router_address``: no scheme)."""
        if self.port is None:
            raise RuntimeError("RewardRouter: not started")
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> str:
        """Check every server, start serving; -> the address. A server that does not answer
        is an error naming it (nothing is served then)."""
        import httpx
        import uvicorn

        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.request_timeout_s,
                                                             connect=10.0))
        await self.refresh()
        down = [s for s in self.servers if not s.healthy]
        if down:
            await self.http.aclose()
            raise ConnectionError("reward router: server(s) not answering at start: "
                                  + "; ".join(s.describe() for s in down))
        from weightsync._runtime.http import default_keep_alive_s

        # idle connections outlive what clients keep (httpx: 5 s; uvicorn's own 5 s races them)
        config = uvicorn.Config(self.app(), host=self.cfg.host, port=self.cfg.port,
                                log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=default_keep_alive_s())  # type: ignore[arg-type]
        self._uvicorn = uvicorn.Server(config)
        self._uvicorn.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self._serving = asyncio.ensure_future(self._uvicorn.serve())
        while not self._uvicorn.started:
            if self._serving.done():
                self._serving.result()  # raises the bind error
                raise OSError(f"reward router could not listen on {self.cfg.host}:"
                              f"{self.cfg.port}")
            await asyncio.sleep(0.02)
        self.port = int(self._uvicorn.servers[0].sockets[0].getsockname()[1])
        self._checker = asyncio.ensure_future(self._check_forever())
        return self.address

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._serving, 10)
        if self.http is not None:
            await self.http.aclose()

    # -- health and versions ---------------------------------------------------------------
    async def refresh(self) -> dict[str, int | None]:
        """Ask every server for its health and version now; -> ``{url: version}``."""
        await asyncio.gather(*(self._check(s) for s in self.servers))
        return self.versions()

    def versions(self) -> dict[str, int | None]:
        return {s.url: s.version for s in self.servers}

    def stats(self) -> dict[str, dict[str, Any]]:
        """``{url: {healthy, version, kind, outstanding, served, failures, last_error}}``."""
        return {s.url: {"healthy": s.healthy, "version": s.version, "kind": s.kind,
                        "outstanding": s.outstanding, "served": s.served,
                        "failures": s.failures, "last_error": s.last_error}
                for s in self.servers}

    async def _check(self, s: ServerState) -> None:
        try:
            health = await self.http.get(s.url + "/health", timeout=5.0)
            version = await self.http.get(s.url + "/runtime_version", timeout=5.0)
            if health.status_code != 200 or version.status_code != 200:
                raise RuntimeError(f"/health {health.status_code}, /runtime_version "
                                   f"{version.status_code}")
            kind = health.json().get("type")
            s.kind = "reward" if kind == "reward_model" else "generative"
            s.version = int(version.json()["version"])
            if not s.healthy:
                log.warning("reward router: %s answers again (version %s)", s.url, s.version)
            s.healthy, s.last_error = True, ""
        except Exception as e:  # noqa: BLE001 - any failure means: not usable now
            s.healthy, s.last_error = False, f"{type(e).__name__}: {e}"[:300]
        s.checked_at = time.monotonic()

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            await self.refresh()

    def _mixed(self) -> RouterError | None:
        healthy = [s for s in self.servers if s.healthy and s.version is not None]
        if self.cfg.allow_mixed_versions or len({s.version for s in healthy}) < 2:
            return None
        listed = ", ".join(f"{s.url} at version {s.version}" for s in healthy)
        return RouterError(409, f"reward servers serve different weight versions ({listed}); a "
                                "batch must not mix them: push to every server (one "
                                "weightsync.connect over all of them), or set "
                                "reward_model.router.allow_mixed_versions")

    # -- forwarding ------------------------------------------------------------------------
    def _pick(self, pinned: int | None, tried: list[ServerState]) -> ServerState:
        mixed = self._mixed()
        if mixed is not None:
            raise mixed
        candidates = [s for s in self.servers if s.healthy and s not in tried]
        if pinned is not None:
            candidates = [s for s in candidates if s.version == pinned]
        if not candidates:
            why = f"at version {pinned} " if pinned is not None else ""
            raise RouterError(503 if pinned is None else 409,
                              f"no healthy reward server {why}left to take the request; "
                              f"servers: {'; '.join(s.describe() for s in self.servers)}")
        return min(candidates, key=lambda s: (s.outstanding, s.served))

    async def forward(self, method: str, path: str, body: bytes,
                      headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """Send one request to a server (see the module docstring); -> (status, headers,
        body). Raises ``RouterError`` for the router's own answers."""
        import httpx

        if path not in FORWARDED:
            raise RouterError(404, f"{method} {path}: the reward router forwards only the model "
                                   f"routes {', '.join(FORWARDED)}; weight pushes go to every "
                                   "server through weightsync.connect (RewardModelManager.push)")
        pinned = _pinned_version(headers)
        retryable = path in SCORING_PATHS
        attempts = 1 + (self.cfg.max_retries if retryable else 0)
        tried: list[ServerState] = []
        error: RouterError | None = None
        sent = {k: v for k, v in headers.items()
                if k.lower() in ("content-type", "authorization", "accept")}
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.cfg.retry_backoff_s)
            server = self._pick(pinned, tried)
            tried.append(server)
            server.outstanding += 1
            try:
                r = await self.http.request(method, server.url + path, content=body,
                                             headers=sent)
            except httpx.TransportError as e:
                server.healthy, server.failures = False, server.failures + 1
                server.last_error = f"{type(e).__name__}: {e}"[:300]
                error = RouterError(502, f"reward server {server.url} failed during {method} "
                                         f"{path}: {server.last_error or type(e).__name__} "
                                         "(marked unhealthy)", server.url)
                log.warning("reward router: %s", error.message)
                continue
            finally:
                server.outstanding -= 1
            version = r.headers.get(VERSION_HEADER)
            if version is not None and version.isdigit():
                server.version = int(version)
            if r.status_code in (502, 503, 504):
                server.failures += 1
                error = RouterError(502, f"reward server {server.url} answered {r.status_code} "
                                         f"to {method} {path}: {r.text[:300]}", server.url)
                continue
            mixed = self._mixed()
            if mixed is not None:
                mixed.server = server.url
                raise mixed
            if pinned is not None and server.version not in (None, pinned):
                error = RouterError(409, f"reward server {server.url} answered at version "
                                         f"{server.version}, the request asked for {pinned}",
                                    server.url)
                continue
            server.served += 1
            out = {k: v for k, v in r.headers.items()
                   if k.lower() in ("content-type", VERSION_HEADER)}
            out[SERVER_HEADER] = server.url
            return r.status_code, out, r.content
        assert error is not None
        if attempts > 1:
            error.message += f" (after {len(tried)} attempt(s) on {', '.join(s.url for s in tried)})"
        raise error

    def app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response

        app = FastAPI(title="weightsync reward router", docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def proxy(path: str, request: Request) -> Any:
            body = await request.body()
            try:
                status, headers, content = await self.forward(
                    request.method, "/" + path, body, dict(request.headers))
            except RouterError as e:
                return JSONResponse({"detail": e.message, "server": e.server},
                                    status_code=e.status)
            return Response(content, status_code=status, headers=headers)

        return app


def _pinned_version(headers: dict[str, str]) -> int | None:
    for k, v in headers.items():
        if k.lower() == VERSION_HEADER:
            if not v.strip().isdigit():
                raise RouterError(400, f"{VERSION_HEADER}: a weight version (an integer >= 0), "
                                       f"got {v!r}")
            return int(v)
    return None
