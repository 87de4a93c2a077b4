"""``WeightSyncTrainerMixin``: lets a training actor send its weights to engine actors.

Mix it into the Ray actor class that trains, and implement ``_weightsync_model()`` to return the
model to extract from. Then (usually through ``weightsync.ray.controller``):

    await trainer.setup_weight_sync.remote(strategy_cfg, extractor_cfg, engine_handles)
    stats = await trainer.sync_weights.remote(version=None)

or the interface design's controller flow: ``sync_info = trainer.initialize_weight_sync(strategy,
cfg, engines)`` on training rank 0, then each engine's ``initialize_weight_sync(strategy, cfg,
sync_info, rank_offset)`` (``weightsync.ray.engine``), then ``sync_weights()``.

On the sending rank ``setup_weight_sync`` builds the strategy, a ``FanOutClient`` over the
engine handles (``RayChannel`` each), the sync info and the sender; building the sender makes every engine build its
receiver at the same time (rendezvous). A broadcast strategy without ``master_addr`` gets this
node's address from Ray (``ray.util.get_node_ip_address()``), so the same code spans nodes.

For sharded training (FSDP, ZeRO-3) every training rank is an actor with this mixin: rank 0 gets
the engine handles and ``is_sender=True``; the others get ``engine_handles=None`` and only run
the extractor's collectives in ``sync_weights`` (all ranks must call it together). With an IPC
strategy, a model sharded over more than one rank of ``torch.distributed``'s default group (or
an extractor that runs on every rank) sends from every rank (``every_rank``,
``weightsync.extractor_ranks.every_rank_wanted``; ``every_rank: false`` in the strategy config
keeps rank 0 alone): each rank builds a sender in ``setup_weight_sync`` and sends handles to its
own copy in ``sync_weights``, rank 0 gathers them and talks to the engines
(``strategies/_every_rank.py``); the other ranks return ``{}``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.clients import FanOutClient
    from weightsync.interfaces import (
        WeightExtractor,
        WeightTransferSender,
        WeightTransferStrategy,
    )
    from weightsync.types import WeightSyncInfo

log = logging.getLogger(__name__)


@dataclass
class _TrainerSyncState:
    extractor: WeightExtractor
    strategy: WeightTransferStrategy | None = None
    client: FanOutClient | None = None
    sender: WeightTransferSender | None = None
    generator_dtype: torch.dtype | None = None
    version: int = 0  # last version the engines published


class WeightSyncTrainerMixin:
    """Sender-side set-up and ``sync_weights``; implement ``_weightsync_model``."""

    _weightsync: _TrainerSyncState | None = None

    def _weightsync_model(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} mixes in WeightSyncTrainerMixin but does not implement "
            f"_weightsync_model() -> the model to extract weights from"
        )

    async def setup_weight_sync(
        self,
        strategy_cfg: Any,
        extractor_cfg: Any = None,
        engine_handles: list[Any] | None = None,
        *,
        is_sender: bool = True,
        generator_dtype: str | None = None,
        timeout_s: float | None = None,
        engine_names: list[str] | None = None,
    ) -> dict[str, Any]:
        """Build extractor (every rank) and strategy/client/sender (sending rank).

        Returns ``{"sync_info", "world_sizes", "versions"}`` on the sender, ``{}`` elsewhere.
        Calling it again tears the previous set-up down first.
        """
        from weightsync.clients import FanOutClient
        from weightsync.config import build_extractor, build_strategy, resolve_strategy
        from weightsync.extractor_ranks import every_rank_wanted, send_from_every_rank
        from weightsync.types import EmptyWeightSyncInfo, str_to_dtype

        await self.close_weight_sync()
        extractor = build_extractor(_with_sender_flag(extractor_cfg, is_sender))
        state = _TrainerSyncState(
            extractor=extractor,
            generator_dtype=str_to_dtype(generator_dtype) if generator_dtype else None,
        )
        strategy_cfg = resolve_strategy(strategy_cfg)
        if every_rank_wanted(strategy_cfg, extractor, self._weightsync_model()):
            # every rank keeps its copy and sends handles to it; rank 0 talks to the engines
            strategy_cfg["every_rank"] = True
            send_from_every_rank(extractor)
            if not is_sender:
                state.strategy = build_strategy(strategy_cfg)
                state.sender = await state.strategy.create_sender(
                    state.strategy.cfg, None, EmptyWeightSyncInfo())
        if not is_sender:
            self._weightsync = state
            return {}
        if not engine_handles:
            raise ValueError("setup_weight_sync: the sending rank needs engine_handles")
        strategy = build_strategy(strategy_cfg)
        _fill_ray_address(strategy.cfg)
        timeout = float(timeout_s if timeout_s is not None else strategy.cfg.timeout_s)
        client = FanOutClient(engine_handles, timeout_s=timeout, names=engine_names)
        sync_info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, sync_info)
        versions = await client.versions()
        state.strategy, state.client, state.sender = strategy, client, sender
        state.version = max(versions)
        self._weightsync = state
        return {
            "sync_info": sync_info.to_dict(),
            "world_sizes": await client.get_world_sizes(),
            "versions": versions,
        }

    async def initialize_weight_sync(
        self, strategy: Any, cfg: Any = None, inference_client: Any = None
    ) -> WeightSyncInfo:
        """The interface design's training-side step (training rank 0): the strategy's sync info
        and sender, built here; returns the sync info (the controller hands it to each inference
        actor's ``initialize_weight_sync``). ``strategy``: a ``WeightTransferStrategy`` (or any
        strategy spec the front door takes; a SkyRL-style ``cfg`` picks one when it is None);
        ``inference_client``: the engines' actor handles (or a list of anything
        ``FanOutClient`` reaches). The extractor follows the model's kind. Building the sender
        makes every engine join at once (a broadcast group needs both sides together), so the
        engines' own ``initialize_weight_sync`` finds its receiver built."""
        from weightsync.config import resolve_strategy
        from weightsync.extractors.auto import extractor_config_for
        from weightsync.types import WeightSyncInfo

        if strategy is None and cfg is None:
            raise ValueError("initialize_weight_sync: give a strategy or a SkyRL-style cfg")
        spec = resolve_strategy(strategy if strategy is not None else cfg)
        handles = inference_client if isinstance(inference_client, (list, tuple)) else (
            [inference_client] if inference_client is not None else None)
        out = await self.setup_weight_sync(
            spec, extractor_config_for(self._weightsync_model()), handles)
        return WeightSyncInfo.from_dict(out["sync_info"])

    async def sync_weights(self, version: int | None = None) -> dict[str, Any]:
        """Extract the model's weights and send them to every engine as one update.

        ``version`` defaults to one more than the highest version the engines published, so all
        engines publish the same number. Returns the sync stats as a dict (``version``,
        ``versions`` per engine, ``total_bytes``, ``seconds``, ``gbps``, ...). On a non-sending
        rank it only runs the extractor's collectives and returns ``{}``.
        """
        state = self._weightsync
        if state is None:
            raise RuntimeError(
                f"{type(self).__name__}.sync_weights called before setup_weight_sync"
            )
        from weightsync.raw_weights import update_manifest

        model = self._weightsync_model()
        chunks = state.extractor.extract_weights(model, state.generator_dtype)
        if state.sender is None:
            async for _ in chunks:  # lockstep collectives; nothing is kept here
                pass
            return {}
        if version is None:
            version = state.version + 1
        manifest = await update_manifest(state.extractor, model, state.generator_dtype)
        stats = await state.sender.send_chunks(
            chunks, state.client, version=version, manifest=manifest
        )
        state.version = max([v for v in stats.versions if v is not None] or [version])
        if state.client is None:  # every_rank: a rank other than 0 sent its copy; 0 reports
            return {}
        out = dataclasses.asdict(stats)
        out["version"] = version
        out["gbps"] = stats.gbps
        return out

    async def close_weight_sync(self) -> None:
        """Tear down sender and engine receivers, best effort: an engine that died or does not
        answer is logged, not raised (safe to call twice)."""
        state, self._weightsync = self._weightsync, None
        if state is None or state.sender is None:
            return
        try:
            await state.sender.close()
        finally:
            if state.client is not None:
                try:
                    await state.client.close_weight_transfer()
                except Exception as e:
                    log.warning("closing the previous weight-sync group: %s", e)


def _with_sender_flag(extractor_cfg: Any, is_sender: bool) -> Any:
    from weightsync.config import to_plain

    data = to_plain(extractor_cfg) if extractor_cfg is not None else {"type": "hf"}
    if "extractor" in data and "type" not in data:
        data = dict(data["extractor"])
    data["is_sender"] = is_sender
    return data


def _fill_ray_address(cfg: Any) -> None:
    """A broadcast config without ``master_addr`` rendezvous at this node's Ray address."""
    if hasattr(cfg, "master_addr") and not getattr(cfg, "master_addr", None):
        import ray

        if ray.is_initialized():
            cfg.master_addr = ray.util.get_node_ip_address()
