"""``RayEngineClient``: the ``InferenceEngineClient`` over Ray actor handles.

Lives in the sending process (a trainer actor, or a driver). Each handle is an actor whose class
mixes in ``WeightSyncEngineMixin`` (or has the same async methods). Every call fans out to all
engines at once and waits with a timeout; a dead actor, a timeout or an engine-side error is
raised as a weightsync error that names the engine (index and actor name/id), so a sync that
loses an engine fails fast instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from weightsync.errors import (
    EngineDiedError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncTimeout,
)
from weightsync.interfaces import InferenceEngineClient


class RayEngineClient(InferenceEngineClient):
    """Fan-out to Ray engine actors.

    ``handles``: actor handles (order fixes rank offsets: engine ``i`` gets
    ``1 + sum(world sizes before it)``). ``timeout_s`` bounds every call; ``init_timeout_s``
    bounds ``init_weight_transfer`` (a rendezvous, may wait for a slow process start).
    ``names`` label engines in errors (default: the actor's name, else ``engine<i>``).
    """

    #: actor tasks are submitted in call order (``.remote()`` runs before the first await) and
    #: the engine's endpoint loads chunks in ``chunk_index`` order
    max_inflight_updates = 2

    def __init__(
        self,
        handles: Sequence[Any],
        *,
        timeout_s: float = 600.0,
        init_timeout_s: float | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if not handles:
            raise ValueError("RayEngineClient needs at least one engine actor handle")
        if names is not None and len(names) != len(handles):
            raise ValueError(f"{len(names)} names given for {len(handles)} engine handles")
        self.handles = list(handles)
        self.timeout_s = float(timeout_s)
        self.init_timeout_s = float(init_timeout_s if init_timeout_s is not None else timeout_s)
        self.names = list(names) if names is not None else [
            _actor_label(h, i) for i, h in enumerate(self.handles)
        ]
        self._world_sizes: list[int] | None = None

    # -- InferenceEngineClient --------------------------------------------------------------
    async def get_world_sizes(self) -> list[int]:
        if self._world_sizes is None:
            sizes = await self._fanout("get_weight_sync_world_size", timeout=self.timeout_s)
            bad = [f"{n}: {s!r}" for n, s in zip(self.names, sizes, strict=True) if not _is_pos_int(s)]
            if bad:
                raise WeightSyncError(
                    f"engines reported invalid weight-sync world sizes (need ints >= 1): {bad}"
                )
            self._world_sizes = [int(s) for s in sizes]
        return list(self._world_sizes)

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        offsets = self.rank_offsets(await self.get_world_sizes())
        await self._fanout(
            "init_weight_transfer",
            per_engine_args=[(strategy_cfg, sync_info, off) for off in offsets],
            timeout=self.init_timeout_s,
        )

    async def start_weight_update(self, start: dict) -> None:
        await self._fanout("start_weight_update", start, timeout=self.timeout_s)

    async def update_named_weights(self, request: dict) -> None:
        await self._fanout("update_named_weights", request, timeout=self.timeout_s)

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        return await self._fanout("finish_weight_update", finish, timeout=self.timeout_s)

    async def close_weight_transfer(self) -> None:
        await self._fanout("close_weight_transfer", timeout=self.timeout_s)

    # -- extras ----------------------------------------------------------------------------------
    async def get_weight_versions(self) -> list[int]:
        return await self._fanout("get_weight_version", timeout=self.timeout_s)

    # -- machinery -------------------------------------------------------------------------------
    async def _fanout(
        self,
        method: str,
        *args: Any,
        per_engine_args: Sequence[tuple] | None = None,
        timeout: float,
    ) -> list[Any]:
        """Call ``method`` on every engine at once; return results in engine order.

        Waits for all engines (so none is left mid-call), then raises the first failure in
        engine order, naming the engine. Engines that did not answer within ``timeout`` are
        reported together as a ``WeightSyncTimeout``.
        """
        import ray

        refs = []
        for i, h in enumerate(self.handles):
            a = per_engine_args[i] if per_engine_args is not None else args
            try:
                refs.append(getattr(h, method).remote(*a))
            except AttributeError:
                raise WeightSyncError(
                    f"{self.names[i]}: actor has no method {method!r}; engine actor classes "
                    f"must mix in weightsync.ray.WeightSyncEngineMixin"
                ) from None
        futs = [asyncio.wrap_future(r.future()) for r in refs]
        done, pending = await asyncio.wait(futs, timeout=timeout)
        if pending:
            for r, f in zip(refs, futs, strict=True):
                if f in pending:
                    ray.cancel(r)
                    f.cancel()
            late = [n for n, f in zip(self.names, futs, strict=True) if f in pending]
            raise WeightSyncTimeout(
                f"{method}: no answer within {timeout:g} s from {', '.join(late)} (the engine "
                f"may have died or hung; raise timeout_s if it is just slow)"
            )
        results = []
        for name, f in zip(self.names, futs, strict=True):
            exc = f.exception()
            if exc is not None:
                raise _engine_error(name, method, exc) from exc
            results.append(f.result())
        return results


def _engine_error(name: str, method: str, exc: BaseException) -> BaseException:
    """Turn a Ray-side failure into a weightsync error that names the engine."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayActorError):
        return EngineDiedError(
            f"{name}: actor died or is unreachable during {method} ({type(exc).__name__}); "
            f"its weights are in an unknown state, rebuild the sync group"
        )
    cause = exc.cause if isinstance(exc, rex.RayTaskError) else exc
    if isinstance(cause, WeightMismatchError):
        err = WeightMismatchError(cause.offenders, target=f"model of {name}")
        return err
    if isinstance(cause, WeightSyncError):
        return type(cause)(f"{name}: {cause}") if _rebuildable(type(cause)) else WeightSyncError(
            f"{name}: {cause}"
        )
    if isinstance(cause, ValueError):
        return ValueError(f"{name}: {method} rejected its input: {cause}")
    return WeightSyncError(f"{name}: {method} failed: {type(cause).__name__}: {cause}")


def _rebuildable(cls: type) -> bool:
    try:
        cls("probe")
        return True
    except Exception:
        return False


def _actor_label(handle: Any, index: int) -> str:
    try:
        actor_id = handle._actor_id.hex()[:12]
    except Exception:
        actor_id = "?"
    return f"engine{index} (actor {actor_id})"


def _is_pos_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1
