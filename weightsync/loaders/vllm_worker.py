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
  ``status()`` plus rank, world size and load mode), ``weightsync_expected_metadata()``.

The endpoint owns the update lifecycle (a failing finish hook leaves it torn, and a torn worker
refuses to serve); the extension only carries calls to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from weightsync._runtime import vllm_compat as compat
from weightsync.errors import WeightSyncError, error_from_dict, error_to_dict, most_telling
from weightsync.interfaces import InferenceEngineClient

#: the dotted path to give vLLM as ``worker_extension_cls``
WORKER_EXTENSION = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its worker class; call them with ``collective_rpc``."""

    _ws_endpoint: Any = None
    _ws_loop: asyncio.AbstractEventLoop | None = None

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

    def weightsync_world_size(self) -> int:
        return compat.worker_rank_and_size(self)[1]

    def weightsync_version(self) -> int:
        return int(self._ws().version)

    def weightsync_state(self) -> dict:
        endpoint = self._ws()
        rank, size = compat.worker_rank_and_size(self)
        return {**endpoint.status().to_dict(), "rank": rank, "world_size": size,
                "load_mode": endpoint.loader.mode,
                "metadata_source": endpoint.loader.metadata_source}

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


# --------------------------------------------------------------------------------------------
# Driver side: an engine client for in-process LLM / AsyncLLM
# --------------------------------------------------------------------------------------------


class VLLMEngineClient(InferenceEngineClient):
    """Fan-out to in-process vLLM engines (``LLM`` or ``AsyncLLM``) built with the worker
    extension. Lives in the sending process; sync ``LLM.collective_rpc`` calls run in a thread so
    the sender's data plane (e.g. a broadcast) proceeds at the same time."""

    def __init__(self, engines: Any, *, timeout_s: float | None = None) -> None:
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.timeout_s = timeout_s
        self._offsets: list[int] | None = None

    # One chunk at a time. ``AsyncLLM``'s engine core runs utility calls in the order they were
    # sent, so 2 should be safe there, but no test drives an ``AsyncLLM`` through this client
    # yet; the blocking ``LLM``'s client is not meant for concurrent calls at all.
    max_inflight_updates = 1

    async def _rpc(self, engine: Any, method: str, *args: Any) -> list[Any]:
        fn = engine.collective_rpc
        if asyncio.iscoroutinefunction(fn):
            return await fn(method, timeout=self.timeout_s, args=args)
        return await asyncio.to_thread(fn, method, self.timeout_s, args)

    async def _call_all(self, method: str, kwargs_per_engine: Sequence[dict]) -> list[list[Any]]:
        answers = await asyncio.gather(
            *(self._rpc(e, "weightsync_call", method, kw)
              for e, kw in zip(self.engines, kwargs_per_engine, strict=True)),
        )
        return [raise_for_results(a, engine=f"vLLM engine {i}") for i, a in enumerate(answers)]

    async def get_world_sizes(self) -> list[int]:
        sizes = await asyncio.gather(*(self._rpc(e, "weightsync_world_size") for e in self.engines))
        return [int(s[0]) for s in sizes]

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        offsets = self.rank_offsets(await self.get_world_sizes())
        self._offsets = offsets
        await self._call_all(
            "init_weight_transfer",
            [{"strategy_cfg": strategy_cfg, "sync_info": sync_info, "rank_offset": o}
             for o in offsets],
        )

    async def start_weight_update(self, start: dict) -> None:
        await self._call_all("start_weight_update", [{"start": start}] * len(self.engines))

    async def update_named_weights(self, request: dict) -> None:
        await self._call_all("update_named_weights", [{"request": request}] * len(self.engines))

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        results = await self._call_all("finish_weight_update", [{"finish": finish}] * len(self.engines))
        for e in self.engines:
            fn = e.reset_prefix_cache
            if asyncio.iscoroutinefunction(fn):
                await compat.async_reset_prefix_cache(e)
            else:
                await asyncio.to_thread(compat.reset_prefix_cache, e)
        return [int(r[0]) if r and r[0] is not None else None for r in results]

    async def close_weight_transfer(self) -> None:
        await self._call_all("close_weight_transfer", [{}] * len(self.engines))

    async def states(self) -> list[list[dict]]:
        return list(await asyncio.gather(*(self._rpc(e, "weightsync_state") for e in self.engines)))
