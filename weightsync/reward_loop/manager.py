"""``RewardLoopManager``: reward-loop workers as Ray actors, and the reward model behind them.

Runs in the single controller (the driver; ``ray.init`` first). Built as
``RewardLoopManager(config, rm_resource_pool=None)`` (verl's signature; ``config`` any form
``reward_loop_config`` takes): with ``reward_model.enable`` it starts a ``RewardModelManager``
(which launches the reward-model servers on ``rm_resource_pool``, or routes over
``reward_model.server_urls`` / ``server_urls=`` without one) and passes its router's address
to the workers; it then starts ``reward_model.num_workers`` ``RewardLoopWorker`` actors, worker
``i`` on the ``i % n``-th alive node with CPUs (round robin, soft node affinity: verl's
placement).

Two ways to score:

- **A batch** (colocate mode): ``compute_rm_score(data)`` splits the batch over the workers
  (consecutive parts), waits for all, and returns a ``RewardBatch`` with ``rm_scores`` (each
  sample's reward at its last valid response token, zeros elsewhere: verl's layout),
  every ``reward_extra_info`` key as a ``non_tensor_batch`` column and
  ``meta_info["reward_extra_keys"]``. With ``reward_model.rollout.free_cache_engine`` the reward
  servers are woken before and put back to sleep after. ``compute_scores(data)`` returns the
  per-sample dicts instead.
- **Sample by sample** (standalone mode): ``await score_sample(sample)`` sends one sample to the
  worker with the fewest samples in flight, so each rollout is scored the moment it finishes
  while the others still generate.

Either way a batch never mixes reward-model weight versions: if the samples' ``rm_version``
differ, ``compute_*`` raises ``VersionMixError`` naming them (unless
``reward_model.router.allow_mixed_versions``). A failing sample raises the worker's error
(``RewardLoopError`` naming the sample and the cause); bad configuration fails at construction.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from weightsync.ray.controller import gather_refs, run_blocking
from weightsync.reward_loop.data import RewardBatch, response_part

#: CPUs each worker actor asks Ray for (it mostly waits on HTTP; see _init_reward_loop_workers)
WORKER_CPUS = 0.01


class VersionMixError(RuntimeError):
    """One batch was scored by different reward-model weight versions."""


class RewardLoopManager:
    def __init__(self, config: Any, rm_resource_pool: Any = None, *,
                 server_urls: list[str] | None = None, api_key: str | None = None) -> None:
        from weightsync.reward_loop.config import reward_loop_config

        self.config = reward_loop_config(config)
        rm = self.config.reward_model
        self.reward_model_manager = None
        self.reward_router_address: str | None = None
        if rm.enable:
            from weightsync.reward_loop.model_manager import RewardModelManager

            self.reward_model_manager = RewardModelManager(
                self.config.reward_model, rm_resource_pool, server_urls=server_urls,
                api_key=api_key)
            kind = self.reward_model_manager.kind
            if kind != "discriminative" and not self.config.custom_reward_function.path:
                self.reward_model_manager.shutdown()
                raise ValueError(f"reward_model: the servers behind the router are {kind} "
                                 "(policy servers: a judge); a generative reward model needs "
                                 "custom_reward_function (it asks the judge through "
                                 "reward_router_address and parses the verdict)")
            self.reward_router_address = self.reward_model_manager.get_router_address()
        self._in_flight: list[int] = []
        try:
            self._init_reward_loop_workers()
        except BaseException:
            self.shutdown()
            raise

    def _init_reward_loop_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from weightsync.reward_loop.worker import RewardLoopWorker

        actor_cls = ray.remote(RewardLoopWorker)
        node_ids = [n["NodeID"] for n in ray.nodes()
                    if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        if not node_ids:
            raise RuntimeError("RewardLoopManager: no alive Ray node with CPUs")
        tag = uuid.uuid4().hex[:8]
        self.reward_loop_workers = []
        for i in range(int(self.config.reward_model.num_workers)):
            self.reward_loop_workers.append(actor_cls.options(
                # a nominal CPU share: with none, Ray 2.60 does not apply a soft node affinity
                name=f"reward_loop_worker_{tag}_{i}", num_cpus=WORKER_CPUS,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=node_ids[i % len(node_ids)], soft=True),
            ).remote(self.config, self.reward_router_address))
        self._in_flight = [0] * len(self.reward_loop_workers)
        # the constructors ran the checks: surface a bad configuration here, not at first use
        run_blocking(_gather([w.__ray_ready__.remote() for w in self.reward_loop_workers]))

    # -- a batch ---------------------------------------------------------------------------------
    def compute_rm_score(self, data: Any) -> RewardBatch:
        """verl's colocate-mode call: see the module docstring."""
        return run_blocking(self.compute_rm_score_async(data))

    async def compute_rm_score_async(self, data: Any) -> RewardBatch:
        import numpy as np
        import torch

        outputs = await self.compute_scores_async(data)
        rm_scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        for i, out in enumerate(outputs):
            _, length = response_part(data[i])
            rm_scores[i, max(length, 1) - 1] = float(out["reward_score"])
        infos = [out.get("reward_extra_info") or {} for out in outputs]
        keys = list(dict.fromkeys(k for info in infos for k in info))
        columns = {k: np.array([info.get(k) for info in infos], dtype=object) for k in keys}
        return RewardBatch({"rm_scores": rm_scores}, columns, {"reward_extra_keys": keys})

    def compute_scores(self, data: Any) -> list[dict]:
        """Per-sample results (``{"reward_score", "reward_extra_info"}``) in batch order."""
        return run_blocking(self.compute_scores_async(data))

    async def compute_scores_async(self, data: Any) -> list[dict]:
        rmm = self.reward_model_manager
        asleep = rmm is not None and self.config.reward_model.rollout.free_cache_engine
        if asleep:
            await asyncio.to_thread(rmm.wake_up)
        try:
            parts = data.chunk(len(self.reward_loop_workers))
            refs = [w.compute_score_batch.remote(p)
                    for w, p in zip(self.reward_loop_workers, parts, strict=True) if len(p)]
            outputs = [o for part in await _gather(refs) for o in part]
        finally:
            if asleep:
                await asyncio.to_thread(rmm.sleep)
        check_versions(outputs, allow_mixed=self.config.reward_model.router.allow_mixed_versions)
        return outputs

    # -- sample by sample ------------------------------------------------------------------------
    async def score_sample(self, data: Any) -> dict:
        """Score one sample (a one-sample batch) on the least busy worker (standalone mode)."""
        if len(data) != 1:
            raise ValueError(f"score_sample: takes one sample, got {len(data)}")
        i = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
        self._in_flight[i] += 1
        try:
            (out,) = await _gather([self.reward_loop_workers[i].compute_score.remote(data)])
        finally:
            self._in_flight[i] -= 1
        return out

    # -- worker placement and shutdown ---------------------------------------------------------
    def worker_nodes(self) -> list[str]:
        """The Ray node id of each worker, in worker order."""
        return run_blocking(_gather([w.node_id.remote() for w in self.reward_loop_workers]))

    def shutdown(self) -> None:
        import ray

        for w in getattr(self, "reward_loop_workers", []):
            ray.kill(w)
        self.reward_loop_workers = []
        if self.reward_model_manager is not None:
            self.reward_model_manager.shutdown()
            self.reward_model_manager = None


async def _gather(refs: list[Any]) -> list[Any]:
    return await gather_refs(refs, None, what="reward loop")


def check_versions(outputs: list[dict], *, allow_mixed: bool = False) -> None:
    """Raise ``VersionMixError`` when ``outputs`` (per-sample results) came from several
    reward-model weight versions (``reward_extra_info["rm_version"]``), unless ``allow_mixed``."""
    if allow_mixed:
        return
    by_version: dict[Any, list[int]] = {}
    for i, out in enumerate(outputs):
        version = (out.get("reward_extra_info") or {}).get("rm_version")
        if version is not None:
            by_version.setdefault(version, []).append(i)
    if len(by_version) > 1:
        listed = "; ".join(f"version {v}: samples {idx[:8]}{' ...' if len(idx) > 8 else ''}"
                           for v, idx in sorted(by_version.items()))
        raise VersionMixError(f"one batch was scored by reward-model weight versions "
                              f"{sorted(by_version)} ({listed}); push to every server before "
                              "scoring, or set reward_model.router.allow_mixed_versions")
