"""``RayChannel``: the channel to a Ray actor that mixes in ``weightsync.ray.WeightSyncEngineMixin``.

Lives in the sending process (a trainer actor or a driver). ``call`` submits the actor task
(``.remote()``) before it returns, so tasks are submitted in call order, and the engine actor
passes chunks to its endpoint in ``chunk_index`` order through a ``ChunkTurnstile`` (Ray does not
promise the order of an async actor's tasks): the channel is ordered. A dead actor is an
``EngineDiedError``, an actor-side failure is rebuilt through the codec naming the engine, and a
call that outlives its timeout is cancelled and reported as a ``WeightSyncTimeout``. Carries
the endpoint's ``apply_update`` (``one_call``; the actor's ``apply_update``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from weightsync.errors import (
    EngineDiedError,
    WeightSyncError,
    WeightSyncTimeout,
    error_from_dict,
    error_to_dict,
)

#: endpoint method -> actor method (the rest have the same name on the actor)
_ACTOR_METHOD = {"status": "get_weight_sync_state"}


def actor_label(handle: Any, index: int) -> str:
    """``engine<index> (actor <id>)``: how an unnamed engine actor is called in errors."""
    try:
        actor_id = handle._actor_id.hex()[:12]
    except Exception:
        actor_id = "?"
    return f"engine{index} (actor {actor_id})"


class RayChannel:
    ordered = True
    one_call = True  # the engine actor's apply_update runs the endpoint's (one task per update)

    def __init__(self, handle: Any, *, name: str | None = None, index: int = 0) -> None:
        self.handle = handle
        self.name = name or actor_label(handle, index)

    async def world_size(self) -> int:
        ref = self._submit("get_weight_sync_world_size", {})
        return await self._answer(ref, "get_weight_sync_world_size", 600.0)

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        actor_method = _ACTOR_METHOD.get(method, method)
        ref = self._submit(actor_method, kwargs)  # submitted now: call order is task order
        return self._answer(ref, method, timeout_s)

    def _submit(self, actor_method: str, kwargs: dict[str, Any]) -> Any:
        try:
            fn = getattr(self.handle, actor_method)
        except AttributeError:
            raise WeightSyncError(
                f"{self.name}: actor has no method {actor_method!r}; engine actor classes must "
                f"mix in weightsync.ray.WeightSyncEngineMixin"
            ) from None
        return fn.remote(**kwargs)

    async def _answer(self, ref: Any, method: str, timeout_s: float) -> Any:
        import ray
        import ray.exceptions as rex

        fut = asyncio.wrap_future(ref.future())
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except rex.RayActorError as e:
            raise EngineDiedError(
                f"{self.name}: actor died or is unreachable during {method} "
                f"({type(e).__name__}); its weights are in an unknown state, connect again"
            ) from None
        except rex.RayTaskError as e:  # the actor's own exception, wrapped by Ray
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise error_from_dict(error_to_dict(cause), engine=self.name, method=method) from cause
        except TimeoutError:
            ray.cancel(ref)
            raise WeightSyncTimeout(
                f"{self.name}: no answer to {method} within {timeout_s:g}s (the actor may have "
                f"died or hung; raise timeout_s if it is just slow)"
            ) from None

    async def aclose(self) -> None:
        return None  # the actor belongs to whoever started it

    def __repr__(self) -> str:
        return f"RayChannel({self.name!r})"
