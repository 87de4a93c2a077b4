"""The vLLM worker extension: a weight-update endpoint inside every vLLM worker.

Pass ``worker_extension_cls="weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"`` to
``LLM`` / ``AsyncEngineArgs`` / ``vllm serve``; vLLM mixes the class into its worker, so these
methods run in each worker process (one per TP x PP rank) and are reached with
``collective_rpc(method, args=...)`` from the engine's driver (an in-process ``LLM``, a Ray
actor that owns one, the reward or policy server).

Every method takes and returns JSON-safe data; tensors never travel through ``collective_rpc``
(msgpack turns them into lists): requests carry metadata and handles, the bytes come over the
strategy's data plane.

* ``weightsync_call(method, kwargs)`` forwards one endpoint call (``WeightUpdateEndpoint.call``:
  init / start / chunk / finish / close / status) and never raises: it answers ``{"ok": True,
  "result", "state"}`` or ``{"ok": False, "error_type", "error", "offenders", "state"}`` (the
  error codec of ``weightsync.errors``); ``raise_for_results`` on the driver turns the answers
  of all workers back into one exception. The worker's receiver rank is the engine's
  ``rank_offset`` plus the worker's rank inside the engine.
* ``weightsync_world_size()``, ``weightsync_version()``, ``weightsync_state()`` (the endpoint's
  ``status()`` plus rank, world size, load mode and, in direct mode, what the copy plan replays:
  ``copy_plan`` = names replayed, names that always go through ``load_weights``, tensors
  loaded each way: replayed, through ``load_weights``, written in place by the transport), ``weightsync_expected_metadata()``.

* The reference's worker-extension methods (``RewardWeightSyncExtension`` /
  ``WeightSyncWorkerExtension`` of the Ludic servers), for a driver that calls the workers
  itself: ``init_communicator(host, port, world_size)`` joins the trainer's group (the trainer
  is its last rank; blocks until it joins), ``update_param_batch(metadata_list)`` receives one
  batch of ``(name, dtype, shape)`` tensors, broadcast in that order from the trainer, and loads
  it as one update (the whole list checked before any byte moves; the worker's version counts
  on), ``close_communicator()`` leaves the group. They run the same endpoint as the calls above
  (``ludic_broadcast``), and raise on failure as the reference's do.

The endpoint owns the update lifecycle (a failing finish hook leaves it torn, and a torn worker
refuses to serve); the extension only carries calls to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from weightsync._runtime import vllm_compat as compat
from weightsync.errors import WeightSyncError, error_from_dict, error_to_dict, most_telling

#: the dotted path to give vLLM as ``worker_extension_cls``
WORKER_EXTENSION = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its worker class; call them with ``collective_rpc``."""

    _ws_endpoint: Any = None
    _ws_loop: asyncio.AbstractEventLoop | None = None
    _ws_trainer_rank: int | None = None  # the trainer's rank in a group joined by init_communicator
    _ws_group_timeout_s: float = 120.0  # joining that group and each of its collectives

    def weightsync_setup(self, loader_cfg: dict | None = None) -> dict:
        """(Re)build the endpoint with a loader config (optional; built lazily otherwise). The
        served version carries over."""
        from weightsync.engine import WeightUpdateEndpoint
        from weightsync.loaders.vllm import VLLMLoaderConfig, VLLMWeightLoader

        cfg = VLLMLoaderConfig(**{k: v for k, v in (loader_cfg or {}).items() if k != "type"})
        loader = VLLMWeightLoader(cfg, worker=self)
        rank, _ = compat.worker_rank_and_size(self)
        version = self._ws_endpoint.version if self._ws_endpoint is not None else 0
        self._ws_endpoint = WeightUpdateEndpoint(
            loader, version=version, name=f"vllm worker {rank}"
        )
        return self.weightsync_state()

    def _ws(self) -> Any:
        if self._ws_endpoint is None:
            self.weightsync_setup()
        return self._ws_endpoint

    def _ws_run(self, coro: Any) -> Any:
        if self._ws_loop is None or self._ws_loop.is_closed():
            self._ws_loop = asyncio.new_event_loop()
        return self._ws_loop.run_until_complete(coro)

    def weightsync_call(self, method: str, kwargs: dict | None = None) -> dict:
        endpoint = self._ws()
        kwargs = dict(kwargs or {})
        try:
            if method == "init_weight_transfer":
                rank, _ = compat.worker_rank_and_size(self)
                kwargs["rank_offset"] = int(kwargs.get("rank_offset", 1)) + rank
            result = self._ws_run(endpoint.call(method, kwargs))
            return {"ok": True, "result": result, "state": self.weightsync_state()}
        except BaseException as e:  # noqa: BLE001 - reported to the driver, never swallowed
            return {"ok": False, **error_to_dict(e), "state": self.weightsync_state()}

    # -- the reference's methods ------------------------------------------------------------------
    def init_communicator(self, host: str, port: int, world_size: int) -> None:
        """Join the trainer's group at ``host:port`` as rank ``worker rank``; the trainer is
        rank ``world_size - 1``. NCCL (vLLM's PyNccl) on a GPU worker, gloo on a CPU one."""
        from weightsync.strategies.ludic_broadcast import ludic_group

        backend = "nccl" if compat.worker_device(self).startswith("cuda") else "gloo"
        strategy, sync_info = ludic_group(host, int(port), int(world_size), backend=backend,
                                          timeout_s=self._ws_group_timeout_s)
        self._ws_trainer_rank = int(world_size) - 1
        self._ws_checked("init_weight_transfer", {"strategy_cfg": strategy,
                                                  "sync_info": sync_info, "rank_offset": 0})

    def update_param_batch(self, metadata_list: Sequence[Any]) -> None:
        """Receive ``metadata_list`` (``(name, dtype, shape)`` items, e.g. ``("score.weight",
        "torch.float32", [1, 64])``) from the trainer and load it as one update."""
        import uuid

        from weightsync.strategies.ludic_broadcast import ludic_update
        from weightsync.types import TensorMeta

        if self._ws_trainer_rank is None:
            raise WeightSyncError("update_param_batch: no trainer group; call "
                                  "init_communicator(host, port, world_size) first")
        metas = []
        for i, item in enumerate(metadata_list):
            if isinstance(item, dict):
                metas.append(TensorMeta.from_dict(item))
                continue
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise ValueError(f"metadata_list[{i}]: expected (name, dtype, shape), got {item!r}")
            name, dtype, shape = item
            metas.append(TensorMeta.from_dict({"name": name, "dtype": dtype,
                                               "shape": list(shape)}))
        start, request, finish = ludic_update(metas, None, self._ws_trainer_rank,
                                              f"worker-batch-{uuid.uuid4().hex[:12]}")
        self._ws_checked("apply_update", {"start": start, "requests": [request],
                                          "finish": finish})

    def close_communicator(self) -> None:
        self._ws_trainer_rank = None
        self._ws_checked("close_weight_transfer", {})

    def _ws_checked(self, method: str, kwargs: dict) -> Any:
        """``weightsync_call`` that raises the worker's error (the reference's methods raise)."""
        answer = self.weightsync_call(method, kwargs)
        rank, _ = compat.worker_rank_and_size(self)
        return raise_for_results([answer], engine=f"vllm worker {rank}")[0]

    def weightsync_world_size(self) -> int:
        return compat.worker_rank_and_size(self)[1]

    def weightsync_version(self) -> int:
        return int(self._ws().version)

    def weightsync_state(self) -> dict:
        endpoint = self._ws()
        rank, size = compat.worker_rank_and_size(self)
        plan = getattr(endpoint.loader, "plan", None)
        return {**endpoint.status().to_dict(), "rank": rank, "world_size": size,
                "load_mode": endpoint.loader.mode,
                "metadata_source": endpoint.loader.metadata_source,
                "copy_plan": None if plan is None else {
                    "names": len(plan.names), "opaque": plan.opaque[:20],
                    "replayed": plan.replayed, "loaded": plan.loaded,
                    "direct": plan.direct}}

    def weightsync_expected_metadata(self) -> list[dict] | None:
        meta = self._ws().loader.expected_metadata()
        return None if meta is None else [m.to_dict() for m in meta.values()]


def raise_for_results(results: Sequence[Any], *, engine: str = "vLLM engine") -> list[Any]:
    """The workers' answers to one ``weightsync_call`` -> their results; if any worker failed,
    the most telling failure (``weightsync.errors.most_telling``) is raised, naming the engine
    and the worker."""
    errors: list[BaseException] = []
    for i, r in enumerate(results):
        if not isinstance(r, dict) or "ok" not in r:
            raise WeightSyncError(f"{engine}: unexpected worker answer {r!r}")
        if not r["ok"]:
            worker = engine if len(results) == 1 else f"{engine} worker {i}"
            errors.append(error_from_dict(r, engine=worker))
    if errors:
        raise most_telling(errors)
    return [r.get("result") for r in results]
