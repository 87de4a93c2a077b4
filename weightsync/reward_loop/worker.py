"""``RewardLoopWorker``: scores batches, one sample per task, on its own event loop.

A plain class (``import weightsync.reward_loop`` does not import Ray); ``RewardLoopManager``
makes it a Ray actor (``ray.remote(RewardLoopWorker)``), and it works in-process too. Built as
``RewardLoopWorker(config, reward_router_address=None)`` (verl's signature), it loads the policy
tokenizer (``actor_rollout_ref.model.path``), the reward model's (``reward_model.model.path``,
when enabled), the custom reward function and the reward manager chosen by
``reward_model.reward_manager`` (or, with ``reward_loop_source: importlib``, the class
``reward_loop_class_name`` of the file ``reward_loop_module_path``). Bad configuration fails
here, in the constructor, naming the key.

Per sample (verl's rule): a custom reward function, or ``reward_weights``, -> the manager's
``run_single``; else with a reward model -> the discriminative model's score alone
(``compute_score_disrm``; a generative one needs a custom function); else the manager with the
rule-based default. ``compute_score_batch(data)`` runs every sample as its own task and returns
their results in order; a sample that fails makes the batch fail with ``RewardLoopError``
naming the sample's index and what failed.
"""

from __future__ import annotations

import asyncio
from typing import Any


class RewardLoopError(RuntimeError):
    """A sample of a batch could not be scored; the message names the sample and the cause."""


class RewardLoopWorker:
    def __init__(self, config: Any, reward_router_address: str | None = None) -> None:
        from weightsync.reward_loop.config import reward_loop_config

        self.config = reward_loop_config(config)
        self.reward_router_address = reward_router_address
        self._init_reward_fn()

    def _init_reward_fn(self) -> None:
        from weightsync.reward_loop.base import get_reward_manager_cls
        from weightsync.reward_loop.functions import get_custom_reward_fn

        rm = self.config.reward_model
        policy_path = self.config.get("actor_rollout_ref", {}).get("model", {}).get("path")
        if not policy_path:
            raise ValueError("actor_rollout_ref.model.path: the policy's tokenizer is needed to "
                             "decode responses; give the policy model's directory")
        self.input_tokenizer = _tokenizer(policy_path, "actor_rollout_ref.model.path")
        self.reward_model_tokenizer = None
        if rm.enable:
            if not rm.model.path:
                raise ValueError("reward_model.model.path: required with reward_model.enable "
                                 "(its tokenizer renders what the reward model scores)")
            if self.reward_router_address is None:
                raise ValueError("reward_model.enable: the worker needs reward_router_address "
                                 "(RewardModelManager.get_router_address())")
            self.reward_model_tokenizer = _tokenizer(rm.model.path, "reward_model.model.path")
        self.reward_fn = get_custom_reward_fn(self.config)
        if rm.reward_loop_source == "importlib":
            from weightsync.reward_loop.functions import load_function

            manager_cls = load_function(rm.reward_loop_module_path, rm.reward_loop_class_name)
        else:
            try:
                manager_cls = get_reward_manager_cls(rm.reward_manager)
            except ValueError as e:
                raise ValueError(f"reward_model.reward_manager: {e}") from None
        self.reward_loop = manager_cls(self.config, self.input_tokenizer, self.reward_fn,
                                       self.reward_router_address, self.reward_model_tokenizer)

    async def compute_score_batch(self, data: Any) -> list[dict]:
        tasks = [asyncio.ensure_future(self.compute_score(data[i:i + 1]))
                 for i in range(len(data))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        failed = [(i, t.exception()) for i, t in enumerate(tasks)
                  if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            i, e = failed[0]
            raise RewardLoopError(f"sample {i} of a batch of {len(data)}: "
                                  f"{type(e).__name__}: {e}") from e
        return [t.result() for t in tasks]

    async def compute_score(self, data: Any) -> dict:
        if len(data) != 1:
            raise ValueError(f"compute_score: takes one sample, got {len(data)}")
        rm = self.config.reward_model
        if self.reward_fn is not None or rm.reward_weights or not rm.enable:
            return await self.reward_loop.run_single(data)
        return await self.compute_score_disrm(data)

    async def compute_score_disrm(self, data: Any) -> dict:
        """The discriminative reward model's score of the one sample, with the weight version
        behind it in ``reward_extra_info["rm_version"]``."""
        item = data[0]
        response_str, _ = await self.reward_loop.decode_response(item)
        score, version = await self.reward_loop.model_score(item, response_str)
        return {"reward_score": score,
                "reward_extra_info": {"rm_score": score, "rm_version": version}}

    async def node_id(self) -> str:
        """The Ray node this worker runs on (where ``RewardLoopManager`` placed it)."""
        import ray

        return ray.get_runtime_context().get_node_id()


def _tokenizer(path: str, key: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"{key}: cannot load a tokenizer from {path!r}: {type(e).__name__}: "
                         f"{e}") from e
