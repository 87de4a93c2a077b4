"""Controller: wire a sync group of trainer and engine actors, then run syncs.

Runs in the driver (or any process that holds the actor handles). The heavy lifting happens in
the actors; the controller only sends them plain configs and handles:

    group = wire_sync_group(trainer, engines, "broadcast_gloo")  # a preset name or a YAML path
    stats = run_sync(group)            # version 1
    stats = run_sync(group)            # version 2
    close_sync_group(group)

``trainer`` is one actor handle (mixing in ``WeightSyncTrainerMixin``) or a list of them, one
per training rank of a sharded model (the first sends; all run the extractor in lockstep).
``engines`` are actor handles mixing in ``WeightSyncEngineMixin``. ``cfg`` is a preset
(``WeightSyncConfig``, a YAML path / preset name, or a mapping with ``strategy`` and
``extractor`` sections) or just a strategy mapping (``{"type": "broadcast", ...}``, extractor
``hf``). Each function has an ``async`` twin (``*_async``) for callers on an event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SyncGroup:
    """Handles and wiring of one trainer -> engines sync group."""

    trainers: list[Any]
    engines: list[Any]
    strategy_cfg: dict[str, Any]
    extractor_cfg: dict[str, Any]
    engine_names: list[str]
    sync_info: dict[str, Any] = field(default_factory=dict)
    world_sizes: list[int] = field(default_factory=list)
    timeout_s: float = 600.0

    @property
    def sender(self) -> Any:
        return self.trainers[0]


def split_config(cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A preset / mapping / YAML path -> (strategy dict, extractor dict)."""
    from weightsync.config import WeightSyncConfig, load_config, to_plain

    if isinstance(cfg, str) and not cfg.strip().startswith("{"):
        cfg = load_config(cfg)
    if isinstance(cfg, WeightSyncConfig):
        return dict(cfg.strategy), dict(cfg.extractor)
    data = to_plain(cfg) if cfg is not None else {}
    if "strategy" in data and isinstance(data["strategy"], Mapping):
        from weightsync.config import with_strategy_bucket

        strategy = dict(data["strategy"])
        return strategy, with_strategy_bucket(data.get("extractor") or {"type": "hf"}, strategy)
    return dict(data) or {"type": "broadcast"}, {"type": "hf"}


async def wire_sync_group_async(
    trainer: Any,
    engines: list[Any],
    cfg: Any,
    *,
    extractor_cfg: Any = None,
    generator_dtype: str | None = None,
    timeout_s: float | None = None,
) -> SyncGroup:
    """Build sender (trainer rank 0) and receivers (every engine) for one sync group.

    ``extractor_cfg`` overrides the preset's extractor section. Returns a ``SyncGroup`` to pass
    to ``run_sync``. Raises what the trainer raised (an unknown strategy type lists the
    registered ones; a dead engine is named).
    """
    strategy_cfg, ex_cfg = split_config(cfg)
    if extractor_cfg is not None:
        from weightsync.config import to_plain

        ex_cfg = to_plain(extractor_cfg)
    trainers = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
    if not trainers:
        raise ValueError("wire_sync_group: no trainer actor given")
    if not engines:
        raise ValueError("wire_sync_group: no engine actors given")
    timeout = float(timeout_s if timeout_s is not None else strategy_cfg.get("timeout_s", 600.0))
    names = await _engine_names(engines, timeout)
    calls = [
        trainers[0].setup_weight_sync.remote(
            strategy_cfg, ex_cfg, list(engines), is_sender=True,
            generator_dtype=generator_dtype, timeout_s=timeout, engine_names=names,
        )
    ] + [
        t.setup_weight_sync.remote(
            strategy_cfg, ex_cfg, None, is_sender=False, generator_dtype=generator_dtype
        )
        for t in trainers[1:]
    ]
    results = await gather_refs(calls, timeout * 2, what="setup_weight_sync")
    info = results[0]
    return SyncGroup(
        trainers=trainers, engines=list(engines), strategy_cfg=strategy_cfg,
        extractor_cfg=ex_cfg, engine_names=names, sync_info=info.get("sync_info", {}),
        world_sizes=info.get("world_sizes", []), timeout_s=timeout,
    )


async def run_sync_async(group: SyncGroup | Any, version: int | None = None) -> dict[str, Any]:
    """One update from the trainer(s) to every engine; returns the sending rank's stats dict.

    ``group`` is a ``SyncGroup`` (or a single, already set-up trainer handle).
    """
    trainers = group.trainers if isinstance(group, SyncGroup) else [group]
    timeout = group.timeout_s * 4 if isinstance(group, SyncGroup) else None
    calls = [trainers[0].sync_weights.remote(version)] + [
        t.sync_weights.remote(version) for t in trainers[1:]
    ]
    results = await gather_refs(calls, timeout, what="sync_weights")
    return results[0]


async def close_sync_group_async(group: SyncGroup) -> None:
    await gather_refs(
        [t.close_weight_sync.remote() for t in group.trainers], group.timeout_s,
        what="close_weight_sync",
    )


def wire_sync_group(trainer: Any, engines: list[Any], cfg: Any, **kwargs: Any) -> SyncGroup:
    """Blocking ``wire_sync_group_async`` (call from a driver without a running loop)."""
    return run_blocking(wire_sync_group_async(trainer, engines, cfg, **kwargs))


def run_sync(group: SyncGroup | Any, version: int | None = None) -> dict[str, Any]:
    """Blocking ``run_sync_async``."""
    return run_blocking(run_sync_async(group, version))


def close_sync_group(group: SyncGroup) -> None:
    """Blocking ``close_sync_group_async``."""
    run_blocking(close_sync_group_async(group))


# --------------------------------------------------------------------------------------------


async def _engine_names(engines: list[Any], timeout: float) -> list[str]:
    from weightsync.clients import actor_label

    refs = []
    for i, h in enumerate(engines):
        try:
            refs.append(h.get_weight_sync_name.remote())
        except AttributeError:
            raise TypeError(
                f"engine {i} is not a weight-sync engine actor: its class must mix in "
                f"weightsync.ray.WeightSyncEngineMixin"
            ) from None
    try:
        names = await gather_refs(refs, timeout, what="get_weight_sync_name")
    except Exception:
        return [actor_label(h, i) for i, h in enumerate(engines)]
    return [f"engine{i} {n}" if not str(n).startswith("engine") else str(n)
            for i, n in enumerate(names)]


async def gather_refs(refs: list[Any], timeout: float | None, *, what: str) -> list[Any]:
    """Await Ray refs; on a Ray task error (or an actor whose constructor failed) re-raise the
    actor's own exception."""
    import ray.exceptions as rex

    from weightsync.errors import WeightSyncTimeout

    futs = [asyncio.wrap_future(r.future()) for r in refs]
    try:
        return await asyncio.wait_for(asyncio.gather(*futs), timeout)
    except TimeoutError:
        raise WeightSyncTimeout(f"{what}: no answer within {timeout:g} s") from None
    except rex.RayTaskError as e:
        cause = e.cause
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except rex.RayActorError as e:  # an actor whose constructor raised: raise what it raised
        failed = [a for a in e.args if isinstance(a, rex.RayTaskError)]
        if failed and isinstance(failed[0].cause, BaseException):
            raise failed[0].cause from None
        raise


def run_blocking(coro: Any) -> Any:
    """Run ``coro`` to completion from code without a running event loop (the blocking twins
    of this package's async calls); inside a running loop it refuses, naming the *_async
    variant to use."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "called a blocking weightsync.ray function from a running event loop; use the *_async "
        "variant"
    )
