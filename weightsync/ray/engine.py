"""``WeightSyncEngineMixin``: makes a user's inference actor a weight-sync engine.

Mix it into the Ray actor class that owns the inference model (a torch module, a vLLM engine,
...) and implement ``_weightsync_loader()`` to return the ``WeightLoader`` for it. The mixin
exposes the endpoint methods that ``weightsync.clients.RayChannel`` calls, as async actor methods, and
forwards them to one ``weightsync.engine.WeightUpdateEndpoint`` created on first use in the
actor's process:

    get_weight_sync_world_size()  -> receiving workers in this engine (override for TP > 1)
    init_weight_transfer(strategy_cfg, sync_info, rank_offset)
    initialize_weight_sync(strategy, cfg, sync_info, rank_offset)   the interface design's name
    start_weight_update(start) / update_named_weights(request) / finish_weight_update(finish)
    close_weight_transfer()
    get_weight_version() / get_weight_sync_state()

All arguments are plain dicts (what ``to_dict()`` gives); nothing but them crosses Ray. The
actor must be async (it is, as soon as it has these async methods), so Ray runs them on one event
loop: the endpoint's data-plane waits run in threads and the actor keeps answering.

Serving code in the actor should call ``self.check_weights_servable()`` before using the model:
it raises ``UpdateIncompleteError`` while a failed update left the weights half-written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.engine import ChunkTurnstile, WeightUpdateEndpoint
    from weightsync.interfaces import WeightLoader


class WeightSyncEngineMixin:
    """Endpoint methods for an inference actor; implement ``_weightsync_loader``."""

    _weightsync_ep: WeightUpdateEndpoint | None = None
    _weightsync_turnstile: ChunkTurnstile | None = None

    # -- what the actor provides --------------------------------------------------------------
    def _weightsync_loader(self) -> WeightLoader:
        raise NotImplementedError(
            f"{type(self).__name__} mixes in WeightSyncEngineMixin but does not implement "
            f"_weightsync_loader() -> WeightLoader"
        )

    def _weightsync_name(self) -> str:
        """How this engine is named in errors and logs (override to give a friendlier name)."""
        name = getattr(self, "_weightsync_engine_name", None)
        if name:
            return str(name)
        try:
            import ray

            actor_id = ray.get_runtime_context().get_actor_id() or "?"
        except Exception:
            actor_id = "?"
        return f"{type(self).__name__}({actor_id[:12]})"

    def _weightsync_endpoint(self) -> WeightUpdateEndpoint:
        if self._weightsync_ep is None:
            from weightsync.engine import WeightUpdateEndpoint

            self._weightsync_ep = WeightUpdateEndpoint(
                self._weightsync_loader(), name=self._weightsync_name()
            )
        return self._weightsync_ep

    async def _weightsync_dispatch(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Where endpoint calls go. Default: this process's endpoint. Engines whose receivers
        live elsewhere (vLLM workers, see ``weightsync.ray.vllm``) override this."""
        return await self._weightsync_endpoint().call(method, kwargs)

    # -- actor methods (called by weightsync.clients.RayChannel) ------------------------------
    async def get_weight_sync_world_size(self) -> int:
        """Receiving workers of this engine; 1 for a module in this process."""
        return 1

    async def get_weight_sync_name(self) -> str:
        return self._weightsync_name()

    async def init_weight_transfer(
        self, strategy_cfg: dict, sync_info: dict, rank_offset: int
    ) -> None:
        await self._weightsync_dispatch(
            "init_weight_transfer",
            {"strategy_cfg": strategy_cfg, "sync_info": sync_info, "rank_offset": rank_offset},
        )

    async def initialize_weight_sync(
        self, strategy: Any, cfg: Any, sync_info: Any, rank_offset: int
    ) -> None:
        """The interface design's inference-side step: this engine's receiver for
        ``sync_info`` at ``rank_offset``. The trainer's ``initialize_weight_sync`` built it
        already (its sender makes every engine join at once); then nothing changes. Otherwise
        (the engines are wired in another order) the receiver is built here. ``strategy``: a
        ``WeightTransferStrategy`` or any strategy spec (a SkyRL-style ``cfg`` when None)."""
        from weightsync.config import resolve_strategy

        info = sync_info.to_dict() if hasattr(sync_info, "to_dict") else dict(sync_info)
        state = await self._weightsync_dispatch("status", {})
        if state.get("has_receiver") and state.get("sync_info") == info:
            return
        spec = resolve_strategy(strategy if strategy is not None else cfg)
        await self.init_weight_transfer(spec, info, int(rank_offset))

    async def start_weight_update(self, start: dict) -> None:
        await self._weightsync_dispatch("start_weight_update", {"start": start})

    async def update_named_weights(self, request: dict) -> None:
        # the sender keeps two chunks in flight and Ray may start an async actor's tasks out
        # of order: chunks go on to the endpoint (or the vLLM workers) one by one, in order
        if self._weightsync_turnstile is None:
            from weightsync.engine import ChunkTurnstile

            self._weightsync_turnstile = ChunkTurnstile()
        async with self._weightsync_turnstile.turn(request):
            await self._weightsync_dispatch("update_named_weights", {"request": request})

    async def finish_weight_update(self, finish: dict) -> int:
        return await self._weightsync_dispatch("finish_weight_update", {"finish": finish})

    async def apply_update(self, start: dict | None, requests: list[dict], finish: dict) -> int:
        """The endpoint's ``apply_update`` (a one-chunk update, or a started update's requests
        and finish, in one actor task): its requests run in order inside the one call, so it
        takes no turn at the chunk turnstile."""
        return await self._weightsync_dispatch(
            "apply_update", {"start": start, "requests": requests, "finish": finish})

    async def close_weight_transfer(self) -> None:
        await self._weightsync_dispatch("close_weight_transfer", {})

    async def get_weight_version(self) -> int:
        return self._weightsync_endpoint().version

    async def get_weight_sync_state(self) -> dict[str, Any]:
        """The endpoint's ``status()`` as a plain dict."""
        return self._weightsync_endpoint().status().to_dict()

    def check_weights_servable(self) -> None:
        """Raise ``UpdateIncompleteError`` while the weights are a partial update."""
        if self._weightsync_ep is not None:
            self._weightsync_ep.check_serving()
