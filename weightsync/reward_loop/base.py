"""Reward managers: the base class and the registry (verl's ``RewardManagerBase``,
``@register``, ``get_reward_manager_cls``).

A reward manager turns one sample into ``{"reward_score": float, "reward_extra_info": dict}``
in ``async run_single(data)`` (``data`` holds exactly one sample: a ``RewardBatch`` or verl's
``DataProto``). It is built once per ``RewardLoopWorker`` as ``cls(config, tokenizer,
compute_score, reward_router_address, reward_model_tokenizer)`` (verl's order) and called
concurrently for every sample of a batch on the worker's event loop.

Subclass ``RewardManagerBase``, implement ``run_single`` and register the class with
``@register("name")``; ``reward_model.reward_manager: name`` picks it. An unknown name is an
error that lists the registered ones. The helpers here are what the built-in managers share:
decoding the response (``decode_response``), calling the reward function
(``function_score``), asking the discriminative reward model through the router
(``model_score``) and weighting the two (``combine``, ``reward_model.reward_weights``).
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from weightsync.registry import Registry
from weightsync.reward_loop.data import response_part

REWARD_MANAGERS = Registry("reward manager", {
    "naive": "weightsync.reward_loop.managers:NaiveRewardManager",
    "dapo": "weightsync.reward_loop.managers:DAPORewardManager",
    "rate_limited": "weightsync.reward_loop.managers:RateLimitRewardManager",
})


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a reward manager available as ``reward_model.reward_manager:
    name``."""
    return REWARD_MANAGERS.register(name)


def get_reward_manager_cls(name: str) -> type:
    """The class registered as ``name``; ``ValueError`` listing the registered names."""
    return REWARD_MANAGERS.get(name)


class RewardManagerBase(ABC):
    """verl's base: ``config`` (the whole reward-loop config), ``tokenizer`` (the policy's,
    decodes responses), ``loop`` (the running event loop), ``init_class`` (state shared by
    every instance of a class in this process, set up once)."""

    _class_initialized = False

    def __init__(self, config: Any, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._loop: asyncio.AbstractEventLoop | None = None
        self.reward_router_address: str | None = None
        self.reward_model_tokenizer: Any = None
        self.compute_score: Callable[..., Any] | None = None
        self.init_class(config, tokenizer)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop (the worker's); outside one, a loop of this manager's own."""
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
            return self._loop

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        if cls._class_initialized:
            return
        cls._class_initialized = True

    @abstractmethod
    async def run_single(self, data: Any) -> dict:
        """-> ``{"reward_score": float, "reward_extra_info": dict}`` for the one sample."""

    # -- helpers the built-in managers share ----------------------------------------------------
    @property
    def reward_weights(self) -> dict[str, float] | None:
        weights = _section(self.config, "reward_model").get("reward_weights")
        return {str(k): float(v) for k, v in dict(weights).items()} if weights else None

    async def decode_response(self, item: Any) -> tuple[str, int]:
        """(the response text, its valid length in tokens), decoded off the loop."""
        ids, length = response_part(item)
        text = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(ids, skip_special_tokens=True))
        return text, length

    def router_kwargs(self) -> dict[str, Any]:
        """What a reward function gets besides the sample when a reward model is enabled."""
        if self.reward_router_address is None:
            return {}
        return {"reward_router_address": self.reward_router_address,
                "reward_model_tokenizer": self.reward_model_tokenizer}

    async def function_score(self, item: Any, response_str: str,
                             **extra: Any) -> tuple[float, dict[str, Any]]:
        """The reward function on one sample -> (score, extra info). A dict result gives
        ``score`` and keeps every entry; a number is the score and is kept as ``acc``."""
        from weightsync.reward_loop.functions import call_reward_fn

        nt = item.non_tensor_batch
        data_source = nt["data_source"]
        reward_model = nt.get("reward_model") or {}
        result = await call_reward_fn(
            self.compute_score, what=f"a sample of data_source {data_source!r} (response "
                                     f"{response_str[:60]!r})",
            data_source=data_source, solution_str=response_str,
            ground_truth=reward_model.get("ground_truth"),
            extra_info=dict(nt.get("extra_info") or {}), **self.router_kwargs(), **extra)
        if isinstance(result, Mapping):
            if "score" not in result:
                raise ValueError(f"reward function returned a dict without 'score' (keys "
                                 f"{sorted(result)}) for data_source {data_source!r}")
            return _finite(result["score"], "score"), dict(result)
        score = _finite(result, "score")
        return score, {"acc": score}

    async def model_score(self, item: Any, response_str: str) -> tuple[float, int | None]:
        """The discriminative reward model's score of the sample's chat (raw, through the
        router's ``/classify``) and the weight version behind it."""
        from weightsync.reward_loop.client import classify

        if self.reward_router_address is None:
            raise ValueError("reward_model.enable is false: there is no reward model to score "
                             "with (reward_model.reward_weights.model needs one)")
        text = disrm_prompt(item, response_str, self.reward_model_tokenizer)
        model = _section(self.config, "reward_model").get("model") or {}
        name = model.get("served_model_name") or model.get("path")
        return await classify(self.reward_router_address, name, text)

    async def combined(self, item: Any, response_str: str,
                       **extra: Any) -> tuple[float, dict[str, Any]]:
        """The sample's reward: the reward function's score, or with ``reward_weights``
        ``function * w_function + model * w_model`` (each part kept in the extra info as
        ``function_score`` / ``rm_score``, the model's version as ``rm_version``)."""
        weights = self.reward_weights
        if weights is None:
            return await self.function_score(item, response_str, **extra)
        jobs: dict[str, Any] = {}
        if "function" in weights:
            jobs["function"] = self.function_score(item, response_str, **extra)
        if "model" in weights:
            jobs["model"] = self.model_score(item, response_str)
        done = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
        info: dict[str, Any] = {}
        reward = 0.0
        if "function" in done:
            score, info = done["function"]
            info["function_score"] = score
            reward += weights["function"] * score
        if "model" in done:
            rm, version = done["model"]
            info["rm_score"], info["rm_version"] = rm, version
            reward += weights["model"] * rm
        return reward, info


def disrm_prompt(item: Any, response_str: str, rm_tokenizer: Any) -> str:
    """What a discriminative reward model scores (verl's rendering): the sample's
    ``raw_prompt`` chat plus the response as the assistant's turn, through the reward model's
    chat template, without a generation prompt and without a leading BOS text."""
    chat = list(item.non_tensor_batch["raw_prompt"])
    chat.append({"role": "assistant", "content": response_str})
    text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    bos = getattr(rm_tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return text


def _section(config: Any, name: str) -> Any:
    node = config.get(name) if hasattr(config, "get") else getattr(config, name, None)
    return node if node is not None else {}


def _finite(value: Any, what: str) -> float:
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        f = float(value)  # a Python, numpy or one-element torch number
    except (TypeError, ValueError):
        raise ValueError(f"reward function: {what} must be a number, got {value!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"reward function: {what} is {f}")
    return f
