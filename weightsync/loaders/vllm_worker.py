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
* ``weightsync_call(method, kwargs, call_id, wait_s)``: the same call, but this RPC returns
  after at most ``wait_s`` seconds; a call not finished by then answers ``{"ok": True,
  "pending": call_id, "state"}`` and goes on in the background; ``weightsync_poll(call_id,
  wait_s)`` gives it up to ``wait_s`` more and answers the same way (the final answer is kept
  for later polls of the same id, so a driver can poll every worker until all are done);
  ``weightsync_cancel(call_id, why)`` abandons it (the endpoint sees a cancellation at its
  current ``await``: a join stops waiting for its rendezvous, a chunk fails as any failed chunk
  does) and answers its final ``{"ok": False, "error_type": "UpdateRefusedError", ...}``.
* ``weightsync_world_size()``, ``weightsync_version()``, ``weightsync_state()`` (the endpoint's
  ``status()`` plus rank, world size, load mode and, in direct mode, what the copy plan replays:
  ``copy_plan`` = names replayed, names that always go through ``load_weights``, tensors
  loaded each way: replayed, through ``load_weights``, written in place by the transport),
  ``weightsync_expected_metadata()``, ``weightsync_state_digest()`` (a hash of every tensor the
  worker serves: two engines compared without shipping their weights).

* The reference's worker-extension methods (``RewardWeightSyncExtension`` /
  ``WeightSyncWorkerExtension`` of the Ludic servers), for a driver that calls the workers
  itself: ``init_communicator(host, port, world_size)`` joins the trainer's group (the trainer
  is its last rank; blocks until it joins), ``update_param_batch(metadata_list)`` receives one
  batch of ``(name, dtype, shape)`` tensors, broadcast in that order from the trainer, and loads
  it as one update (the whole list checked before any byte moves; the worker's version counts
  on), ``close_communicator()`` leaves the group. They run the same endpoint as the calls above
  (``ludic_broadcast``), and raise on failure as the reference's do.

Why the sliced form (``call_id``): vLLM runs one ``collective_rpc`` at a time per worker, and its engine core
waits for every worker's answer before it schedules the next model step. A call that blocks in
the worker (a rendezvous waiting for a trainer that never comes, a collective waiting for a dead
peer) would hold every model request and every other RPC for as long as its timeout. Everything
that blocks runs on helper threads (``weightsync._runtime.threads.in_thread``); the endpoint's
own coroutines run on this worker's event loop, in the worker's main thread, but only while an
RPC drives the loop, so loads never race the model's forward passes.

The endpoint owns the update lifecycle (a failing finish hook leaves it torn, and a torn worker
refuses to serve); the extension only carries calls to it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from weightsync._runtime import trace
from weightsync._runtime import vllm_compat as compat
from weightsync.errors import (
    UpdateRefusedError,
    WeightSyncError,
    error_from_dict,
    error_to_dict,
    most_telling,
)

#: the dotted path to give vLLM as ``worker_extension_cls``
WORKER_EXTENSION = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"
#: final answers kept for polls of the same call id (a driver polls every worker until all are
#: done, so a worker that finished first is asked again)
_KEPT_ANSWERS = 32
#: how long ``weightsync_cancel`` drives the loop for the cancelled call to unwind
_CANCEL_WAIT_S = 1.0


class WeightSyncWorkerExtension:
    """Methods vLLM adds to its worker class; call them with ``collective_rpc``."""

    _ws_endpoint: Any = None
    _ws_loop: asyncio.AbstractEventLoop | None = None
    _ws_trainer_rank: int | None = None  # the trainer's rank in a group joined by init_communicator
    _ws_group_timeout_s: float = 120.0  # joining that group and each of its collectives
    _ws_calls: dict[str, asyncio.Task] | None = None  # call id -> its task (until collected)
    _ws_answers: OrderedDict[str, dict] | None = None  # call id -> final answer (recent ones)

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

    def _ws_loop_now(self) -> asyncio.AbstractEventLoop:
        if self._ws_loop is None or self._ws_loop.is_closed():
            self._ws_loop = asyncio.new_event_loop()
        return self._ws_loop

    def weightsync_call(self, method: str, kwargs: dict | None = None,
                        call_id: str | None = None, wait_s: float | None = None) -> dict:
        """One endpoint call; with ``call_id`` this RPC returns after at most ``wait_s``
        seconds (see the module docstring), else when the call is done."""
        trace.mark("worker.call", method=method)
        endpoint = self._ws()
        kwargs = dict(kwargs or {})
        try:
            if method == "init_weight_transfer":
                rank, _ = compat.worker_rank_and_size(self)
                kwargs["rank_offset"] = int(kwargs.get("rank_offset", 1)) + rank
        except Exception as e:  # noqa: BLE001 - reported to the driver, never raised into vLLM
            return {"ok": False, **error_to_dict(e), "state": self.weightsync_state()}
        loop = self._ws_loop_now()
        task = loop.create_task(endpoint.call(method, kwargs))
        if call_id is None:
            loop.run_until_complete(asyncio.wait({task}))
            answer = self._ws_answer(task)
            trace.mark("worker.answer")
            return answer
        if self._ws_calls is None:
            self._ws_calls, self._ws_answers = {}, OrderedDict()
        self._ws_calls[str(call_id)] = task
        return self.weightsync_poll(call_id, wait_s or 0.0)

    def weightsync_poll(self, call_id: str, wait_s: float = 0.0) -> dict:
        """Drive the worker's loop until call ``call_id`` is done or ``wait_s`` passed; its
        final answer, or ``{"ok": True, "pending": call_id, "state"}``."""
        call_id = str(call_id)
        done = (self._ws_answers or {}).get(call_id)
        if done is not None:
            return done
        task = (self._ws_calls or {}).get(call_id)
        if task is None:
            return {"ok": False, "error_type": "UpdateRefusedError",
                    "error": f"no call {call_id!r} on this worker (never started, or its answer "
                             f"was collected long ago)", "offenders": [],
                    "state": self.weightsync_state()}
        # max(): one pass of the loop even at 0, so work a helper thread finished lands now
        self._ws_loop_now().run_until_complete(asyncio.wait({task}, timeout=max(wait_s, 1e-4)))
        if not task.done():
            return {"ok": True, "pending": call_id, "state": self.weightsync_state()}
        answer = self._ws_answer(task)
        del self._ws_calls[call_id]
        self._ws_answers[call_id] = answer
        while len(self._ws_answers) > _KEPT_ANSWERS:
            self._ws_answers.popitem(last=False)
        return answer

    def weightsync_cancel(self, call_id: str, why: str = "abandoned by the server") -> dict:
        """Abandon call ``call_id`` (a join nobody completes, a chunk whose sender is gone) and
        answer its final outcome; a call already done answers as it ended."""
        task = (self._ws_calls or {}).get(str(call_id))
        if task is not None and not task.done():
            task.cancel(why)
        return self.weightsync_poll(call_id, _CANCEL_WAIT_S)

    def _ws_answer(self, task: asyncio.Task) -> dict:
        if task.cancelled():
            why = _cancel_reason(task)
            e: BaseException = UpdateRefusedError(f"abandoned: {why}")
            return {"ok": False, **error_to_dict(e), "state": self.weightsync_state()}
        e = task.exception()
        if e is not None:
            return {"ok": False, **error_to_dict(e), "state": self.weightsync_state()}
        return {"ok": True, "result": task.result(), "state": self.weightsync_state()}

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
                    "direct": plan.direct, "swapped": plan.swapped,
                    "shadow_bytes": plan.shadow_bytes}}

    def weightsync_release_staging(self) -> int:
        """Free what staged updates keep beside the weights between updates (the copy plan's
        shadows): the sleep mode calls it before vLLM's sleep. Returns the bytes freed."""
        release = getattr(self._ws().loader, "release_staging", None)
        freed = int(release()) if release is not None else 0
        if freed and compat.worker_device(self) == "cuda":
            import torch

            torch.cuda.empty_cache()
        return freed

    def weightsync_expected_metadata(self) -> list[dict] | None:
        meta = self._ws().loader.expected_metadata()
        return None if meta is None else [m.to_dict() for m in meta.values()]

    def weightsync_lora_digest(self, adapter_id: int) -> dict[str, dict] | None:
        """``loaders.vllm_lora.adapter_digest`` of the LoRA adapter ``adapter_id`` (a
        ``LoRARequest``'s ``lora_int_id``) in this worker; None when it holds no such adapter."""
        from weightsync.loaders.vllm_lora import adapter_digest

        return adapter_digest(self, adapter_id)

    def weightsync_lora_slot(self, adapter_id: int) -> dict[str, Any]:
        """How this worker installed the last version of adapter ``adapter_id`` (``installed``:
        "built" by vLLM or "rewritten[ from lent views], slot ..."; "" if never) and, where the adapter is active,
        its slot and the digest of what the slot holds (``loaders.vllm_lora.adapter_slot_digest``)."""
        from weightsync.loaders.vllm_lora import adapter_slot_digest

        memory = getattr(self._ws().loader, "adapter_memory", None)
        how = memory.how.get(int(adapter_id), "") if memory is not None else ""
        return {"installed": how, **(adapter_slot_digest(self, int(adapter_id)) or {})}

    def weightsync_state_digest(self) -> dict[str, dict]:
        """``weightsync.digest.state_digest`` of the served model's state dict as this worker
        holds it (after vLLM's processing: fused, sliced for TP, repacked): two engines of one
        configuration that serve the same weights answer the same. Hashes every tensor on the
        CPU: for checks and tests, not for every step."""
        from weightsync.digest import module_digest

        return module_digest(compat.get_model(self))


class RewardWeightSyncExtension(WeightSyncWorkerExtension):
    """The Ludic reward spec's name for the reward server's worker extension: the same methods
    (the spec's ``init_communicator`` / ``update_param_batch`` / ``close_communicator`` and
    weightsync's), so ``worker_extension_cls`` may name either class."""


#: the dotted path of ``RewardWeightSyncExtension``, for ``worker_extension_cls``
REWARD_WORKER_EXTENSION = "weightsync.loaders.vllm_worker.RewardWeightSyncExtension"


def _cancel_reason(task: asyncio.Task) -> str:
    """The message ``task.cancel(msg)`` was given (asyncio keeps it on the exception)."""
    try:
        task.result()
    except asyncio.CancelledError as e:
        return str(e.args[0]) if e.args else "abandoned by the server"
    return "abandoned by the server"


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
