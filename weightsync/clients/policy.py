"""The fan-out's error policy, on its own so that anything that calls several engines (or several
workers of one engine) follows the same one: ``gather``.

* every call has a timeout; a call that outlives it is a ``WeightSyncTimeout`` naming the engine
  (the channel enforces it; ``gather`` has a backstop ``BACKSTOP_S`` later);
* all calls are awaited, so none is left mid-call while another's failure is raised; once one
  failed, the others get ``grace_s`` to answer (an engine stuck in a collective with a dead peer
  may otherwise hang until its own timeout), then they are cancelled on our side and each is an
  ``EngineSilentError`` (abandoned);
* of several failures the most telling is raised (``weightsync.errors.most_telling``): a
  ``WeightMismatchError`` with its offenders, then a dead engine, corrupted bytes, an engine's
  timeout, any other error, an engine silent after another failed, and last a broken
  collective (the follow-on of someone else's failure); the others are attached as notes.
  Every error names the engine and the method (the phase).

Pure asyncio over ``weightsync.errors``; no other import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.errors import (
    EngineSilentError,
    WeightSyncTimeout,
    error_from_dict,
    error_to_dict,
    most_telling,
)

#: once an engine failed, how long the others may take to answer before they are cancelled
DEFAULT_GRACE_S = 5.0
#: how long past the call's own timeout the fan-out waits before it calls the engine silent
BACKSTOP_S = 5.0


async def gather(
    calls: Sequence[Awaitable[Any]],
    *,
    names: Sequence[str],
    method: str,
    timeout_s: float,
    grace_s: float = DEFAULT_GRACE_S,
    backstop_s: float = BACKSTOP_S,
) -> list[Any]:
    """Await one call per engine with the fan-out's error policy (see the module docstring);
    the results in engine order."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        # the channels enforce timeout_s themselves; this deadline is a backstop for one that
        # does not (one wait for all calls: no timer per call on the hot path)
        done, pending = await asyncio.wait(
            tasks, timeout=timeout_s + backstop_s, return_when=asyncio.FIRST_EXCEPTION
        )
        failed = any(_error(t) is not None for t in done)
        if not failed and not pending:
            return [t.result() for t in tasks]
        if failed and pending:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        errors: list[BaseException] = []
        first = next((n for t, n in zip(tasks, names, strict=True) if _error(t) is not None), "")
        for task, name in zip(tasks, names, strict=True):
            err = _error(task)
            if err is not None:
                errors.append(named(err, name, method))
            elif task in pending and not failed:
                errors.append(named(WeightSyncTimeout(
                    f"{name}: no answer to {method} within {timeout_s:g}s (the engine may have "
                    f"died or hung; raise timeout_s if it is just slow)"
                ), name, method))
            elif task in pending:  # silent while another failed: stuck, or slow; abandoned
                errors.append(named(EngineSilentError(
                    f"{name}: {method} still running {grace_s:g}s after {first} failed; "
                    f"abandoned (the engine is stuck, e.g. a stopped process or a hung "
                    f"collective, or just slow)"
                ), name, method))
        raise most_telling(errors)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
                t.add_done_callback(_consume)
            else:
                _consume(t)


def named(e: BaseException, engine: str, method: str) -> BaseException:
    """``e`` with the engine and the method in its message (rebuilt through the codec when its
    message does not name the engine yet); ``engine`` / ``method`` attributes are set too."""
    if engine not in str(e):
        rebuilt = error_from_dict(error_to_dict(e), engine=engine, method=method)
        rebuilt.__cause__ = e
        e = rebuilt
    try:
        e.engine, e.method = engine, method  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - an exception type with __slots__
        pass
    return e


async def failed(e: BaseException) -> Any:
    """An awaitable that raises ``e`` (a call that failed before it was issued)."""
    raise e


def _error(task: asyncio.Future) -> BaseException | None:
    if not task.done():
        return None
    if task.cancelled():
        return asyncio.CancelledError("cancelled")
    return task.exception()


def _consume(t: asyncio.Future) -> None:
    if not t.cancelled():
        t.exception()
