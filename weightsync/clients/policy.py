"""The fan-out's error policy, on its own so that anything that calls several engines (or several
workers of one engine) follows the same one: ``gather``.

* every call has a timeout; a call that outlives it is a ``WeightSyncTimeout`` naming the engine
  (the channel enforces it; ``gather`` has a backstop a few seconds later);
* all calls are awaited, so none is left mid-call while another's failure is raised; once one
  failed, the others get ``grace_s`` to answer (an engine stuck in a collective with a dead peer
  may otherwise hang until its own timeout), then they are cancelled on our side and reported
  as abandoned in the raised error's notes;
* of several failures the most telling is raised (``weightsync.errors.most_telling``): a
  ``WeightMismatchError`` with its offenders, then a dead engine, then a timeout, then the
  rest; the others are attached as notes. Every error names the engine and the method.

Pure asyncio over ``weightsync.errors``; no other import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.errors import (
    WeightSyncError,
    WeightSyncTimeout,
    error_from_dict,
    error_to_dict,
    most_telling,
)

#: once an engine failed, how long the others may take to answer before they are cancelled
DEFAULT_GRACE_S = 5.0


async def gather(
    calls: Sequence[Awaitable[Any]],
    *,
    names: Sequence[str],
    method: str,
    timeout_s: float,
    grace_s: float = DEFAULT_GRACE_S,
) -> list[Any]:
    """Await one call per engine with the fan-out's error policy (see the module docstring);
    the results in engine order."""
    tasks = [asyncio.ensure_future(_bounded(c, n, method, timeout_s))
             for c, n in zip(calls, names, strict=True)]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if not any(_error(t) for t in done):
            return [t.result() for t in tasks]
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        errors: list[BaseException] = []
        for task, name in zip(tasks, names, strict=True):
            err = _error(task)
            if err is not None:
                errors.append(named(err, name, method))
        best = most_telling(errors)
        for task, name in zip(tasks, names, strict=True):
            if task in pending:
                best.add_note(f"{name}: {method} still running after {grace_s:g}s; abandoned")
        raise best
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


async def _bounded(aw: Awaitable[Any], name: str, method: str, timeout_s: float) -> Any:
    """The channel enforces ``timeout_s`` itself; this backstop keeps a channel that does not
    from hanging the fan-out."""
    try:
        return await asyncio.wait_for(aw, timeout_s + 5.0)
    except TimeoutError as e:
        if isinstance(e, WeightSyncError):  # the channel's own timeout: it says more
            raise
        raise WeightSyncTimeout(
            f"{name}: no answer to {method} within {timeout_s:g}s (the engine may have died or "
            f"hung; raise timeout_s if it is just slow)"
        ) from None


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
