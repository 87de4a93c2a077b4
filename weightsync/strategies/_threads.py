"""Run a blocking call (a collective, a pipe read) in a daemon thread and await it.

Why not ``asyncio.to_thread``: a collective stuck on a dead peer keeps its thread busy until the
transport's own timeout, and the default executor's threads are joined when ``asyncio.run``
ends and at interpreter exit. A daemon thread per call never holds up either; its result (or
exception) is delivered to the awaiting task if that task still waits, else dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any, name: str = "weightsync-io") -> T:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def _set(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # delivered to the awaiting task
            ok, value = False, e
        else:
            ok, value = True, result
        try:
            loop.call_soon_threadsafe(_set, ok, value)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name=name, daemon=True).start()
    return await fut
