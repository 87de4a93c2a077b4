"""Ray actors that serve a vLLM engine and receive weights: the usual shape in verl / OpenRLHF /
SkyRL (one actor per engine, its workers inside).

``VLLMEngineMixin``: mix it into an actor that owns a vLLM ``LLM`` or ``AsyncLLM`` built with
``worker_extension_cls="weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"`` and implement
``_weightsync_llm()``. Receivers live in the vLLM workers (one per TP x PP rank); the mixin
forwards every endpoint call to them through ``weightsync.loaders.vllm_driver.VLLMWorkers`` (one
``collective_rpc``, their answers turned back into weightsync errors, the prefix cache reset
after a finished update).
``weightsync.clients.RayChannel`` / the controller drive it like any other engine actor.

``VLLMEngineActor``: a ready-made one (offline ``LLM``) with ``generate`` and ``classify``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from weightsync.ray.engine import WeightSyncEngineMixin

EXTENSION = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"


class VLLMEngineMixin(WeightSyncEngineMixin):
    """Engine-actor methods that forward to the vLLM workers' weight-sync extension."""

    def _weightsync_llm(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} mixes in VLLMEngineMixin but does not implement "
            f"_weightsync_llm() -> the vLLM LLM / AsyncLLM built with worker_extension_cls="
            f"{EXTENSION!r}"
        )

    def _weightsync_workers(self) -> Any:
        from weightsync.loaders.vllm_driver import VLLMWorkers

        workers = getattr(self, "_weightsync_driver", None)
        if workers is None:
            workers = self._weightsync_driver = VLLMWorkers(
                self._weightsync_llm(), name=self._weightsync_name())
        return workers

    async def _weightsync_dispatch(self, method: str, kwargs: dict[str, Any]) -> Any:
        if method == "status":
            return await self.get_weight_sync_state()
        return await self._weightsync_workers().call(method, kwargs)

    async def get_weight_sync_world_size(self) -> int:
        return await self._weightsync_workers().world_size()

    async def get_weight_version(self) -> int:
        return int((await self._weightsync_workers().rpc("weightsync_version"))[0])

    async def get_weight_sync_state(self) -> dict[str, Any]:
        states = await self._weightsync_workers().states()
        worst = next((s for s in states if s.get("state") == "torn"), states[0])
        return {**worst, "workers": states}

    def check_weights_servable(self) -> None:  # the workers' endpoints guard serving
        return None


class VLLMEngineActor(VLLMEngineMixin):
    """An offline vLLM engine in a Ray actor. ``llm_kwargs`` go to ``vllm.LLM`` (the worker
    extension is added). For tests and simple use; real deployments mix ``VLLMEngineMixin``
    into their own actor."""

    def __init__(self, model: str, *, name: str = "", **llm_kwargs: Any) -> None:
        from vllm import LLM

        llm_kwargs.setdefault("worker_extension_cls", EXTENSION)
        self.llm = LLM(model=model, **llm_kwargs)
        self._weightsync_engine_name = name

    def _weightsync_llm(self) -> Any:
        return self.llm

    async def classify(self, texts: list[str], use_activation: bool = False) -> list[list[float]]:
        """Raw logits (no activation unless asked) of a pooling/classification model."""
        from vllm import PoolingParams

        outs = await asyncio.to_thread(
            self.llm.classify, texts, pooling_params=PoolingParams(use_activation=use_activation),
            use_tqdm=False,
        )
        return [list(map(float, o.outputs.probs)) for o in outs]

    async def generate(self, prompts: list[str], max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids of a generative model."""
        from vllm import SamplingParams

        outs = await asyncio.to_thread(
            self.llm.generate, prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    async def shutdown(self) -> None:
        from weightsync._runtime.vllm_compat import shutdown_llm

        shutdown_llm(self.llm)
