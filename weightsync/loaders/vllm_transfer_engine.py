"""weightsync inside vLLM's own weight-transfer API: the engine each vLLM worker builds for
``weight_transfer_config={"backend": "weightsync"}``.

vLLM 0.32's ``vllm.distributed.weight_transfer`` lets a trainer drive an engine through four
calls, the same on an offline ``LLM``, an ``AsyncLLM`` and (in dev mode) the server's HTTP
routes: ``init_weight_transfer_engine(init_info)``, ``start_weight_update()``,
``update_weights(update_info)`` (any number of times) and ``finish_weight_update()``. Its own
backends are NCCL and CUDA IPC (on a CPU engine they fail). weightsync registers a backend of
its own (``weightsync._runtime.vllm_compat.register_transfer_backend``, run by weightsync's vLLM
plugin in every vLLM process), so those calls reach the same ``WeightUpdateEndpoint`` and
``VLLMWeightLoader`` as the worker extension does, with every strategy and every check:

* ``init_info`` = ``{"strategy": <strategy config>, "sync_info": <its sync info>,
  "rank_offset": <the engine's first rank>, "loader": <VLLMLoaderConfig fields, optional>}``:
  the receiver is built (the worker's rank in the engine is added to ``rank_offset``);
* ``update_info`` = ``{"method": <endpoint method>, "kwargs": {...}}``: one endpoint call,
  ``start_weight_update`` (the manifest checked before any byte moves; versions; a delta's
  base), ``update_named_weights`` (one chunk on the strategy's data plane),
  ``finish_weight_update`` (the version published only if every chunk landed; torn weights
  otherwise) or ``apply_update``;
* vLLM's ``start_weight_update()`` prepares nothing (the update starts with its first
  ``update_info``); vLLM's ``finish_weight_update()`` closes an update the trainer left open as
  aborted (its weights torn if a chunk had landed; logged, not raised, so that vLLM's own
  update state is reset).

A failure leaves the worker as an exception whose message carries the error's wire dict
(``weightsync.errors.error_to_text``): ``weightsync.clients.VLLMNativeChannel`` on the trainer
raises the same typed error (a ``WeightMismatchError`` with its offenders, a
``DeltaBaseMismatchError``, ...). The trainer side that speaks this is
``weightsync.vllm_backend``. Runs in each vLLM worker process; imports vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync._runtime import vllm_compat as compat
from weightsync.errors import WeightSyncError, error_to_text

log = logging.getLogger(__name__)

#: the endpoint methods an ``update_info`` may name
UPDATE_METHODS = ("start_weight_update", "update_named_weights", "finish_weight_update",
                  "apply_update")


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """vLLM's ``init_info`` for this backend (see the module docstring)."""

    strategy: dict[str, Any]
    sync_info: dict[str, Any]
    rank_offset: int = 1
    loader: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("strategy", "sync_info", "loader"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"weightsync init_info: {name} must be an object, got "
                                 f"{type(getattr(self, name)).__name__}")
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ValueError(f"weightsync init_info: rank_offset must be an int >= 1, got "
                             f"{self.rank_offset!r}")


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """vLLM's ``update_info`` for this backend: one endpoint call."""

    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in UPDATE_METHODS:
            raise ValueError(f"weightsync update_info: method must be one of {UPDATE_METHODS}, "
                             f"got {self.method!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError("weightsync update_info: kwargs must be an object")


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """vLLM's ``WeightTransferEngine`` over a ``WeightUpdateEndpoint`` (one per worker)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.endpoint: Any = None
        self._loop = asyncio.new_event_loop()
        self._loader_cfg: dict[str, Any] = {}

    # -- vLLM's calls ---------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        endpoint = self._endpoint(init_info.loader)
        rank = compat.WorkerView(self.vllm_config, self.model_config, self.device,
                                 self.model).rank
        self._run(endpoint.init_weight_transfer(init_info.strategy, init_info.sync_info,
                                                init_info.rank_offset + rank))

    def start_weight_update(self) -> None:
        """Nothing to prepare: the update's start comes as its first ``update_info``."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        self.receive_weights(info)  # the loader waited for its copies already

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        self._run(self._endpoint().call(update_info.method, update_info.kwargs))

    def finish_weight_update(self) -> None:
        endpoint = self.endpoint
        update = endpoint.status().update if endpoint is not None else None
        if update is None:
            return
        why = (f"vLLM's finish_weight_update came while update {update.update_id} was still "
               f"open ({update.chunks_done} chunk(s) landed, no finish from the trainer)")
        try:
            self._run(endpoint.finish_weight_update(
                {"update_id": update.update_id, "ok": False, "error": why}))
        except WeightSyncError:
            pass
        log.error("weightsync: %s; closed as aborted (state now %s)", why, endpoint.state.value)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self._run(self.endpoint.close_weight_transfer())

    # -- internals ------------------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightSyncInitInfo:
        try:
            return WeightSyncInitInfo(**init_dict)
        except TypeError as e:
            raise ValueError(f"weightsync init_info: {e}; expected strategy, sync_info, "
                             f"rank_offset, loader") from None

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightSyncUpdateInfo:
        try:
            return WeightSyncUpdateInfo(**update_dict)
        except TypeError as e:
            raise ValueError(f"weightsync update_info: {e}; expected method, kwargs") from None

    def _endpoint(self, loader_cfg: dict[str, Any] | None = None) -> Any:
        """The worker's endpoint, built at the first call (again when the loader config
        changes; the served version carries over)."""
        if self.endpoint is not None and (loader_cfg is None or loader_cfg == self._loader_cfg):
            return self.endpoint
        from weightsync.engine import WeightUpdateEndpoint
        from weightsync.loaders.vllm import VLLMLoaderConfig, VLLMWeightLoader

        cfg = dict(loader_cfg or {})
        view = compat.WorkerView(self.vllm_config, self.model_config, self.device, self.model)
        loader = VLLMWeightLoader(
            VLLMLoaderConfig(**{k: v for k, v in cfg.items() if k != "type"}), worker=view)
        version = self.endpoint.version if self.endpoint is not None else 0
        self.endpoint = WeightUpdateEndpoint(loader, version=version,
                                             name=f"vllm worker {view.rank}")
        self._loader_cfg = cfg
        return self.endpoint

    def _run(self, coro: Any) -> Any:
        """Run an endpoint call to completion here; a failure leaves as a message that carries
        its wire dict (see the module docstring)."""
        try:
            return self._loop.run_until_complete(coro)
        except Exception as e:
            raise WeightSyncError(error_to_text(e)) from e
