"""What both servers do around their app: serve it until told to stop, and the process's exit.

Callers: ``weightsync.servers.reward`` and ``weightsync.servers.policy``, in the server process.
``serve_app`` runs uvicorn on the caller's event loop (the engine lives on it too) with uvicorn's
own signal handling off: signals are ``run_main``'s business, which maps SIGINT / SIGTERM to the
``stop`` event, logs a failure and leaves the process at once with its exit code (a gloo group
joined by the vLLM workers can otherwise keep interpreter exit waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn


async def serve_app(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    lifespan: str,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` until ``stop`` is set (or the task is cancelled);
    ``ready`` is set just before serving starts. Raises ``OSError`` when the port could not
    be bound."""
    import uvicorn

    http = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, lifespan=lifespan,
    ))
    http.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    watcher = None
    if stop is not None:
        async def _watch() -> None:
            await stop.wait()
            http.should_exit = True

        watcher = asyncio.ensure_future(_watch())
    if ready is not None:
        ready.set()
    try:
        await http.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
    if not http.started:
        raise OSError(f"could not serve on {host}:{port} (port in use?)")


def run_main(serve: Callable[[asyncio.Event], Awaitable[None]], *, what: str, log_level: str,
             log: logging.Logger) -> NoReturn:
    """Run ``serve(stop)`` with SIGINT / SIGTERM setting ``stop``; then leave the process with
    code 0, or 1 after logging the failure (``what`` names the server)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    code = 0
    try:
        asyncio.run(_run())
    except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
        log.error("%s failed: %s: %s", what, type(e).__name__, e)
        code = 1
    # a gloo group joined by the workers can keep interpreter exit waiting: leave at once
    logging.shutdown()
    os._exit(code)
