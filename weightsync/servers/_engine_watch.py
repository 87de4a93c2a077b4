"""What a server does once vLLM's engine core died: say so everywhere, then leave loudly, as
``vllm serve`` does.

Callers: ``weightsync.servers._serving.serve_app`` (``watch=``), built by both servers' ``serve``
around their app. A dead engine core never comes back (vLLM's ``AsyncLLM`` only refuses every
call from then on), so a server that stays up only misleads a supervisor or a router. Once
vLLM's client marks the engine dead (its monitor saw the engine-core process exit, or the core
reported a fatal error) or an engine-core process is seen gone (asked at every request to our
routes and twice a second), ``EngineWatch``:

* logs one line naming the engine core, its exit code and the server's exit code;
* fails the worker calls still waiting for an answer (vLLM answers none of them once its core
  is gone: an update in progress would otherwise wait forever) and aborts the update in
  progress, so its gate opens and the requests waiting behind it end too;
* answers ``/runtime_version`` 503 with ``state: "engine_dead"`` (its usual fields, a
  ``reason``, and ``detail`` / ``error_type`` as our error answers), ``/health`` 503, and
  weightsync's own routes (``own``: the control plane, ``/score``, ...) 503 ``{"detail":
  reason, "error_type": "EngineDiedError"}``, including a call in flight whose answer would
  have been a 5xx; vLLM's routes answer as vLLM does (its 500 "EngineCore encountered an
  issue", for which its handler needs ``app.state.server``, set here);
* stops uvicorn (which lets what is in flight end), and ``raise_if_died`` then raises
  ``EngineDiedError`` so that ``run_main`` leaves the process with code 1.

A death while the server is stopping (Ctrl-C reaches the engine core too) is not one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from typing import Any

from weightsync.errors import EngineDiedError

log = logging.getLogger(__name__)

#: how often the watch asks the engine whether it is alive (vLLM's own watchdog: 5 s)
WATCH_EVERY_S = 0.5
#: what ``/runtime_version`` says once the engine core died
DEAD_STATE = "engine_dead"
#: the status of every weightsync answer about a dead engine
DEAD_STATUS = 503
#: the exit code of a server whose engine core died (``run_main``'s for a failure)
EXIT_CODE = 1


class EngineWatch:
    """Watches one server's ``AsyncLLM`` for its engine core's death.

    Args:
        engine: vLLM's ``AsyncLLM``.
        control: the server's ``UpdateControl`` (its update in progress is aborted).
        vllm_app: vLLM's FastAPI app (its engine-error handler reads ``state.server``).
        what: the server's name in the log, e.g. ``"policy server"``.
        own: the paths (prefixes) weightsync's routes answer, besides ``/health`` and
            ``/runtime_version``; every other path is vLLM's and answers as vLLM does.
    """

    def __init__(self, engine: Any, control: Any, vllm_app: Any, *, what: str,
                 own: tuple[str, ...]) -> None:
        self.engine = engine
        self.control = control
        self.vllm_app = vllm_app
        self.what = what
        self.own = tuple(own) + ("/health", "/runtime_version")
        self.reason: str | None = None  # set once the death was seen
        self._stop: asyncio.Event | None = None
        self._logged = False

    # -- what is dead ---------------------------------------------------------------------------
    @property
    def dead(self) -> bool:
        """Whether the engine core died (not while the server is stopping): vLLM's client says
        so (``errored``, what vLLM's watchdog asks), or an engine-core process has exited,
        which is known here as soon as the process is gone, before vLLM's monitor thread ran."""
        if self.reason is None and not self._stopping() and (
                self._engine_errored() or self._exited()):
            self.reason = self._describe()
        return self.reason is not None

    def _engine_errored(self) -> bool:
        try:
            return bool(self.engine.errored)
        except Exception:  # noqa: BLE001 - an engine that cannot say is not known dead
            return False

    def _exited(self) -> list:
        from weightsync._runtime.vllm_compat import engine_core_processes

        return [p for p in engine_core_processes(self.engine) if p.exitcode is not None]

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _describe(self) -> str:
        gone = self._exited()
        if gone:
            how = "; ".join(f"pid {p.pid}, exit code {p.exitcode}{_signal_name(p.exitcode)}"
                            for p in gone)
            return f"vLLM's engine core died ({how}); the server stops"
        return ("vLLM's engine core died (it reported a fatal error: see its traceback); the "
                "server stops")

    def runtime_version(self) -> dict:
        """``/runtime_version``'s answer for a dead engine: its fields, state ``engine_dead``,
        the ``reason``, and ``detail`` / ``error_type`` as every error answer of ours (a client
        that reads it as an error rebuilds ``EngineDiedError``)."""
        return {**self.control.runtime_version(), "state": DEAD_STATE, "reason": self.reason,
                "detail": self.reason, "error_type": "EngineDiedError"}

    # -- the lifecycle --------------------------------------------------------------------------
    def start(self, http: Any, stop: asyncio.Event | None) -> asyncio.Task:
        """Start watching, on the running loop.

        Args:
            http: uvicorn's server, told to exit on a death (and set as vLLM's
                ``app.state.server``).
            stop: the server's stop event: a death once it is set is the stop's, not one.

        Returns:
            The watching task; the caller cancels it once uvicorn stopped.
        """
        self._stop = stop
        self.vllm_app.state.server = http
        return asyncio.ensure_future(self._run(http))

    async def _run(self, http: Any) -> None:
        while not self.dead:
            await asyncio.sleep(WATCH_EVERY_S)
        self._log_death()
        http.should_exit = True  # uvicorn stops accepting and waits for what is in flight
        self._fail_waiting_calls()
        active = self.control.active_update
        if active is not None:
            with contextlib.suppress(Exception):  # its abort call fails too: the gate opens
                await self.control.abort(active, "vLLM's engine core died")

    def _fail_waiting_calls(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        from weightsync._runtime.vllm_compat import fail_engine_calls

        failed = fail_engine_calls(self.engine, EngineDeadError)
        if failed:
            log.warning("%s: %d engine call(s) that vLLM will never answer failed", self.what,
                        failed)

    def _log_death(self) -> None:
        if not self._logged:
            self._logged = True
            log.error("%s: %s (exit code %d)", self.what, self.reason, EXIT_CODE)

    def raise_if_died(self) -> None:
        """Called once uvicorn stopped.

        Raises:
            EngineDiedError: the engine core died (the reason as its message).
        """
        if self.dead:
            self._log_death()
            raise EngineDiedError(self.reason)

    # -- the answers ----------------------------------------------------------------------------
    def wrap(self, app: Any) -> Any:
        """``app`` behind the answers for a dead engine (an ASGI app)."""
        return _DeadEngineAnswers(app, self)

    def ours(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.own)

    def answer(self, path: str) -> tuple[int, dict]:
        if path == "/runtime_version":
            return DEAD_STATUS, self.runtime_version()
        if path == "/health":
            return DEAD_STATUS, {"status": "error", "detail": self.reason}
        return DEAD_STATUS, {"detail": self.reason, "error_type": "EngineDiedError"}


class _DeadEngineAnswers:
    """ASGI middleware: once the engine died, weightsync's routes answer ``EngineWatch.answer``
    (at arrival, or instead of a 5xx or a failure of a call in flight); vLLM's are untouched."""

    def __init__(self, app: Any, watch: EngineWatch) -> None:
        self.app = app
        self.watch = watch

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or not self.watch.ours(path):
            await self.app(scope, receive, send)
            return
        if self.watch.dead:
            await _send_json(send, *self.watch.answer(path))
            return
        started, replaced = False, False

        async def guarded(message: dict) -> None:
            nonlocal started, replaced
            if replaced:
                return
            if (message["type"] == "http.response.start" and message["status"] >= 500
                    and self.watch.dead):
                replaced = True
                await _send_json(send, *self.watch.answer(path))
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, guarded)
        except Exception:
            if not self.watch.dead:
                raise
            if not started and not replaced:
                await _send_json(send, *self.watch.answer(path))


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    with contextlib.suppress(ValueError):
        return f" ({signal.Signals(-exitcode).name})"
    return ""
