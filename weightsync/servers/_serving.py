"""What both servers do around their app: serve it until told to stop, say once that it is
ready, and the process's exit.

Callers: ``weightsync.servers.reward`` and ``weightsync.servers.policy``, in the server process.
``serve_app`` runs uvicorn on the caller's event loop (the engine lives on it too) with uvicorn's
own signal handling off, and prints the server's ready line (``ready_line``: its URL, model and
version, the control plane, whether a token is required, the update timeouts) on stdout once
uvicorn accepts connections. Signals are ``run_main``'s business, which maps SIGINT / SIGTERM to
the ``stop`` event, logs a failure and leaves the process at once with its exit code (a gloo
group joined by the vLLM workers can otherwise keep interpreter exit waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

from weightsync._runtime.http import (  # the idle keep-alive default of every server
    KEEP_ALIVE_ENV,
    KEEP_ALIVE_TIMEOUT_S,
    default_keep_alive_s,
)

#: seconds a stopping server gives vLLM's engine core to stop its workers and unlink its
#: shared-memory queues before it is killed (vLLM's default, ``shutdown_timeout`` 0, kills it at
#: once: the segments leak and Python's resource tracker warns about them at exit)
ENGINE_STOP_GRACE_S = 10.0
_POKE_EVERY_S = 0.25
_ASK_STOPPING_S = 2.0

#: vLLM's loggers that report the engine core's exit as a failure; quiet once a stop began
ENGINE_DEATH_LOGGERS = ("vllm.v1.engine.async_llm",)



#: the control plane's routes, as the ready line lists them
CONTROL_SUMMARY = "/init_communicator, /update_param_batch, /close_communicator"


def add_server_arguments(parser: Any, defaults: Any, *, open_routes: str) -> None:
    """The flags both servers take, each with its default and unit: ``--host``, ``--port``,
    ``--api-key``, ``--update-timeout-s``, ``--group-timeout-s``, ``--max-body-bytes``,
    ``--keep-alive-timeout-s``, ``--log-level``, ``--serve-during-updates`` (the Ludic reference
    server's behaviour), ``--monotonic-versions`` (ours; versions as given is the reference's) and
    the deprecated ``--allow-version-reset`` (``UpdateControl``) (``defaults``: the server's config
    with its defaults; ``open_routes``: what stays open without the token)."""
    d = defaults
    parser.add_argument("--host", metavar="ADDR", help=f"bind address (default {d.host})")
    parser.add_argument("--port", type=int, help=f"HTTP port (default {d.port})")
    parser.add_argument("--api-key", metavar="TOKEN",
                        help="token every weight/communicator route requires (Authorization: "
                             f"Bearer TOKEN); {open_routes} stay open (default: "
                             "$WEIGHTSYNC_API_KEY, else no token)")
    parser.add_argument("--update-timeout-s", type=float, metavar="SECONDS",
                        help=f"abort an update that gets no call for this long (default "
                             f"{d.update_timeout_s:g} s)")
    parser.add_argument("--group-timeout-s", type=float, metavar="SECONDS",
                        help="a Ludic/TRL-style trainer group: joining it and each collective "
                             f"(default {d.group_timeout_s:g} s)")
    parser.add_argument("--max-body-bytes", type=int, metavar="BYTES",
                        help=f"largest request body weightsync's own routes read "
                             f"(default {d.max_body_bytes} bytes = {d.max_body_bytes >> 20} MiB; "
                             f"413 past it)")
    parser.add_argument("--keep-alive-timeout-s", type=_positive_seconds, metavar="SECONDS",
                        help="close an idle keep-alive connection after this long (default "
                             f"${KEEP_ALIVE_ENV} if set, else {KEEP_ALIVE_TIMEOUT_S:g} s: longer "
                             "than clients keep idle connections, so none reuses one the server "
                             "is closing)")
    parser.add_argument("--log-level", metavar="LEVEL",
                        help="weightsync's and uvicorn's log level: debug, info, warning, "
                             f"error (default {d.log_level})")
    # the Ludic reference server's behaviour (docs/reference_differences.md)
    parser.add_argument("--serve-during-updates", action="store_true", default=None,
                        help="keep answering with the last complete weights while an update is "
                             "received (staged: one more copy of its bytes), then flip at its "
                             "end (default: requests wait while an update runs)")
    parser.add_argument("--monotonic-versions", action="store_true", default=None,
                        help="refuse (409) an update whose version is not newer than the served "
                             "one, so versions order the weights (default: off, a version is "
                             "taken as given, as the reference's server does: a trainer that "
                             "resumes from an older checkpoint restarts its count)")
    parser.add_argument("--allow-version-reset", action="store_true", default=None,
                        help="deprecated, no effect: taking versions as given is the default "
                             "(default: off)")


def _positive_seconds(raw: str) -> float:
    import argparse

    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {raw!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {raw!r}")
    return value


def ready_line(
    what: str,
    *,
    url: str,
    model: str,
    version: int,
    api_key: str | None,
    update_timeout_s: float,
    wait_timeout_s: float,
    serves: str,
    dtype: str = "",
) -> str:
    """The one line a server prints when it accepts connections: ``what`` (e.g. ``policy
    server``) at ``url`` serving ``model`` at weight ``version`` in ``dtype`` (the dtype served
    and why: ``_gpu.served_dtype_note``), what else it serves (``serves``), the control plane
    and whether it needs a token, and the update timeouts (an update silent for
    ``update_timeout_s`` is aborted; a request waits ``wait_timeout_s`` for an update and an
    update as long for the requests in flight)."""
    token = "token required (--api-key)" if api_key else "no token required (no --api-key)"
    served = f"; {dtype}" if dtype else ""
    return (f"weightsync {what} ready on {url}: model {model} (weight version {version})"
            f"{served}; {serves}; control plane {CONTROL_SUMMARY}, {token}; update timeout "
            f"{update_timeout_s:g} s, request/update wait {wait_timeout_s:g} s")


#: ``--warmup``'s help: what it sends and what it costs at start (measured: docs/reliability.md)
WARMUP_HELP = (
    "answer {request} before serving, so vLLM's one-time work for it happens at start, not in a "
    "user's first request (with a first update waiting behind it); costs at start: {cost} "
    "(default on; --no-warmup skips it)")


async def warm_up(what: str, outputs: Callable[[str], AsyncIterator[Any]],
                  log: logging.Logger) -> float:
    """Run one request to its end before the server serves: ``outputs(request_id)`` is the
    engine's stream for it (``engine.generate`` / ``engine.encode``). Logs and returns the
    seconds it took."""
    t0 = time.monotonic()
    async for _ in outputs(f"weightsync-warmup-{uuid.uuid4().hex[:8]}"):
        pass
    seconds = time.monotonic() - t0
    log.info("warm-up (%s) took %.2fs", what, seconds)
    return seconds


async def serve_app(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    lifespan: str,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    announce: str | None = None,
    keep_alive_s: float | None = None,
    watch: Any = None,
) -> None:
    """Serve ``app`` on ``host:port`` until ``stop`` is set (or the task is cancelled); idle
    keep-alive connections close after ``keep_alive_s`` (None: ``default_keep_alive_s()``);
    ``ready`` is set just before serving starts; ``announce`` (a ``ready_line``) is printed on
    stdout once uvicorn accepts connections. ``watch``: the server's
    ``_engine_watch.EngineWatch``, which answers for a dead engine and stops serving then.
    Raises ``OSError`` when the port could not be bound, ``EngineDiedError`` when serving
    stopped because vLLM's engine core died."""
    import uvicorn

    if keep_alive_s is None:
        keep_alive_s = default_keep_alive_s()
    if keep_alive_s <= 0:
        raise ValueError(f"keep_alive_s must be > 0 seconds, got {keep_alive_s!r}")
    if watch is not None:
        app = watch.wrap(app)
    http = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, lifespan=lifespan,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # uvicorn hints int; a float works
    ))
    http.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    watcher = None
    if stop is not None:
        async def _watch() -> None:
            await stop.wait()
            http.should_exit = True

        watcher = asyncio.ensure_future(_watch())
    herald = asyncio.ensure_future(_announce(http, announce)) if announce else None
    stalls = asyncio.ensure_future(watch_loop_stalls(logging.getLogger(__name__)))
    guard = watch.start(http, stop) if watch is not None else None
    freeze_heap()
    if ready is not None:
        ready.set()
    try:
        await http.serve()
    finally:
        for task in (watcher, herald, stalls, guard):
            if task is not None:
                task.cancel()
    if not http.started:
        raise OSError(f"could not serve on {host}:{port} (port in use?)")
    if watch is not None:
        watch.raise_if_died()


async def stop_engine(engine: Any, grace_s: float = ENGINE_STOP_GRACE_S) -> None:
    """Shut vLLM's ``AsyncLLM`` down so that its engine core exits by itself: SIGTERM, up to
    ``grace_s`` for it to stop its workers and unlink its shared-memory queues, then a kill.

    vLLM's own exit path (``shutdown_timeout`` 0) kills the engine core at once, which leaks
    its queues (``resource_tracker: There appear to be N leaked shared_memory objects``). And an
    idle engine core that has served requests may sit in a blocking wait on its input queue
    that the SIGTERM does not interrupt, so its handler runs only when the next input arrives:
    while the shutdown waits (in a thread), a cheap utility call every ``_POKE_EVERY_S`` gives
    it that input. vLLM's output handler (a task on this loop) is cancelled first: it would
    otherwise log the engine core's exit as an ``EngineDeadError`` traceback. An engine core
    that is already stopping by itself (Ctrl-C in a terminal signals the whole process group)
    is not signalled: it gets up to ``grace_s`` to leave on its own first. Callers: both
    servers' ``serve``, on their loop, after uvicorn stopped."""
    from weightsync._runtime.vllm_compat import engine_core_processes

    handler = getattr(engine, "output_handler", None)
    if isinstance(handler, asyncio.Task):
        handler.cancel()
    cores = [p for p in engine_core_processes(engine) if p.is_alive()]
    if cores and await _engine_core_stopping(engine):
        # Ctrl-C in a terminal signals the whole process group: the engine core got the SIGINT
        # too and is stopping its workers. vLLM's shutdown below would SIGTERM it, and a SIGTERM
        # that lands after it restored the default handler (its teardown does that first) kills
        # it before it unlinks its queues: wait for it to leave by itself instead.
        await asyncio.to_thread(_join_all, cores, grace_s)
    done = asyncio.ensure_future(asyncio.to_thread(engine.shutdown, timeout=grace_s))
    while not done.done():
        with contextlib.suppress(Exception):  # a stopping engine may answer nothing
            await asyncio.wait_for(engine.reset_prefix_cache(), _POKE_EVERY_S)
        await asyncio.wait([done], timeout=_POKE_EVERY_S)
    await done


async def _engine_core_stopping(engine: Any) -> bool:
    """Whether the engine core is stopping by itself (or gone): it no longer answers a utility
    call as it does while serving. Once a signal started its shutdown it refuses the call
    ("Server shutting down") while still in its loop, and answers nothing once it left the loop
    for its teardown; a serving core answers within a step."""
    try:
        await asyncio.wait_for(engine.reset_prefix_cache(), _ASK_STOPPING_S)
    except Exception:  # noqa: BLE001 - refused, unanswered or dead: it is not serving
        return True
    return False


def _join_all(procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


#: a server's event loop that did not run for this long is logged (``watch_loop_stalls``)
LOOP_STALL_WARN_S = 1.0
_LOOP_TICK_S = 0.25


async def watch_loop_stalls(log: logging.Logger, *, warn_s: float = LOOP_STALL_WARN_S,
                            tick_s: float = _LOOP_TICK_S) -> None:
    """Log a warning whenever this event loop did not run for ``warn_s`` or more: every
    request, control call and keep-alive timer of the server waited that long. Its cause is
    something holding the loop (a blocking call in a handler, a long garbage collection) or
    the process not getting a CPU. Runs until cancelled (``serve_app`` runs it beside uvicorn)."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(tick_s)
        stalled = time.monotonic() - t0 - tick_s
        if stalled >= warn_s:
            log.warning("the server's event loop did not run for %.2fs: requests and control "
                        "calls waited that long (something held the loop, or the process got "
                        "no CPU)", stalled)


def freeze_heap() -> float:
    """Collect once, then move every object alive now (the engine client, vLLM's app, the
    tokenizer, the model config: millions of objects) out of the garbage collector's sight, as
    vLLM's engine core does with its own heap: a full collection then scans only what serving
    allocates. Without it a full collection of the server process stands every request and
    control call still for a noticeable pause (``docs/reliability.md``). Called by ``serve_app``
    just before serving;
    returns the seconds the collection took (logged)."""
    import gc

    t0 = time.monotonic()
    gc.collect()
    gc.freeze()
    seconds = time.monotonic() - t0
    logging.getLogger(__name__).info(
        "garbage collector: %d objects frozen (collection took %.2fs)", gc.get_freeze_count(),
        seconds)
    return seconds


async def _announce(http: Any, line: str) -> None:
    while not http.started:  # set by uvicorn once its socket listens
        if http.should_exit:
            return
        await asyncio.sleep(0.05)
    print(line, file=sys.stdout, flush=True)


def configure_logging(log_level: str) -> None:
    """The servers' log format, and weightsync's own level (a server says how it starts before
    ``run_main`` runs; calling this again changes nothing).

    Args:
        log_level: ``debug``, ``info``, ``warning`` or ``error``.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    # our own level, not the root's: a package vLLM's app imports sets the root logger to ERROR
    # (model_hosting_container_standards), which silenced every line the policy server logs
    logging.getLogger("weightsync").setLevel(log_level.upper())


def run_main(serve: Callable[[asyncio.Event], Awaitable[None]], *, what: str, log_level: str,
             log: logging.Logger) -> NoReturn:
    """Run ``serve(stop)`` with SIGINT / SIGTERM setting ``stop`` (and quieting
    ``ENGINE_DEATH_LOGGERS``); then leave the process with code 0, or 1 after logging the
    failure (``what`` names the server)."""
    configure_logging(log_level)

    async def _run() -> None:
        stop = asyncio.Event()

        def stopping() -> None:
            # Ctrl-C in a terminal reaches vLLM's engine core too, which then exits by itself:
            # expected now, not an error worth vLLM's EngineDeadError traceback
            for name in ENGINE_DEATH_LOGGERS:
                logging.getLogger(name).setLevel(logging.CRITICAL)
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping)
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

