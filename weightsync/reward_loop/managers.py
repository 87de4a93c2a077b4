"""The built-in reward managers: ``naive``, ``dapo``, ``rate_limited``.

Each is built as ``cls(config, tokenizer, compute_score=None, reward_router_address=None,
reward_model_tokenizer=None)`` (verl's signature; ``compute_score`` None: the rule-based
``default_compute_score``) and scores one sample per ``run_single`` call, returning
``{"reward_score", "reward_extra_info"}``. All three combine the reward function's score with the
reward model's when ``reward_model.reward_weights`` says so (``RewardManagerBase.combined``).

- ``NaiveRewardManager``: the reward function's score (a dict result's ``score``; the other
  entries in the extra info, a number also as ``acc``).
- ``DAPORewardManager``: the same, called with ``strict_box_verify``
  (``reward_kwargs.strict_box_verify``), plus DAPO's overlong penalty when
  ``reward_kwargs.overlong_buffer_cfg.enable``: with ``L = max_resp_len``, ``B`` the buffer
  length and ``n`` the response length, ``min(-(n - (L - B)) / B * penalty_factor, 0)`` is added
  (0 up to ``L - B`` tokens, ``-penalty_factor`` at ``L``); ``log: true`` keeps it as
  ``overlong_reward`` / ``overlong``.
- ``RateLimitRewardManager`` (verl's ``RateLimitedRewardManager``, also importable under that
  name): for reward functions that call an external API. Per process, shared by every instance
  (class-level, as verl does): at most ``reward_model.max_concurrent`` calls at once,
  ``max_rpm`` requests and ``max_tpm`` tokens per minute (``estimated_tokens_per_request`` per
  call) through token buckets; each call is cut off after ``timeout`` seconds. A call that
  times out or raises scores 0.0 with ``timeout: true`` or ``error`` in the extra info (an
  external judge's outage must not stop training; verl's behaviour), and is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from weightsync.reward_loop.base import RewardManagerBase, _section

log = logging.getLogger(__name__)


class NaiveRewardManager(RewardManagerBase):
    def __init__(self, config: Any, tokenizer: Any, compute_score: Callable[..., Any] | None = None,
                 reward_router_address: str | None = None,
                 reward_model_tokenizer: Any = None) -> None:
        from weightsync.reward_loop.rules import default_compute_score

        super().__init__(config, tokenizer)
        self.compute_score = compute_score or default_compute_score
        self.reward_router_address = reward_router_address
        self.reward_model_tokenizer = reward_model_tokenizer

    async def run_single(self, data: Any) -> dict:
        _one(data)
        item = data[0]
        response_str, _ = await self.decode_response(item)
        reward, info = await self.combined(item, response_str)
        return {"reward_score": reward, "reward_extra_info": info}


class DAPORewardManager(NaiveRewardManager):
    def __init__(self, config: Any, tokenizer: Any, compute_score: Callable[..., Any] | None = None,
                 reward_router_address: str | None = None,
                 reward_model_tokenizer: Any = None) -> None:
        super().__init__(config, tokenizer, compute_score, reward_router_address,
                         reward_model_tokenizer)
        kwargs = _section(config, "reward_model").get("reward_kwargs") or {}
        self.overlong_buffer_cfg = kwargs.get("overlong_buffer_cfg")
        self.max_resp_len = kwargs.get("max_resp_len")
        self.strict_box_verify = bool(kwargs.get("strict_box_verify", False))
        buffer = self.overlong_buffer_cfg
        if buffer is not None and buffer.get("enable", False):
            if self.max_resp_len is None:
                raise ValueError("reward_model.reward_kwargs.max_resp_len: required with "
                                 "overlong_buffer_cfg")
            if not 0 < int(buffer.get("len", 0)) <= int(self.max_resp_len):
                raise ValueError(f"reward_model.reward_kwargs.overlong_buffer_cfg.len: must be "
                                 f"in 1..max_resp_len ({self.max_resp_len}), got "
                                 f"{buffer.get('len')}")

    async def run_single(self, data: Any) -> dict:
        _one(data)
        item = data[0]
        response_str, length = await self.decode_response(item)
        reward, info = await self.combined(item, response_str,
                                           strict_box_verify=self.strict_box_verify)
        buffer = self.overlong_buffer_cfg
        if buffer is not None and buffer.get("enable", False):
            penalty = overlong_penalty(length, int(self.max_resp_len), int(buffer["len"]),
                                       float(buffer.get("penalty_factor", 1.0)))
            reward += penalty
            if buffer.get("log", False):
                info["overlong_reward"], info["overlong"] = penalty, penalty < 0
        return {"reward_score": reward, "reward_extra_info": info}


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (<= 0)."""
    exceed = length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


class AsyncTokenBucket:
    """Tokens refill at ``rate`` per second up to ``capacity``; ``acquire(n)`` waits until
    ``n`` are there and takes them (a request larger than the capacity waits for the deficit
    and leaves the bucket negative)."""

    def __init__(self, rate: float, capacity: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate: must be > 0, got {rate}")
        self.rate = rate
        self.capacity = capacity or rate
        self.tokens = self.capacity
        self.updated = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self, n: float = 1.0) -> None:
        while True:
            async with self._lock:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
                self.updated = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
                if n > self.capacity:  # never fits: take it now, wait for the deficit
                    self.tokens -= n
                    break
            await asyncio.sleep(wait)
        await asyncio.sleep(wait)


class RateLimitRewardManager(NaiveRewardManager):
    _semaphore: asyncio.Semaphore | None = None
    _rpm_limiter: AsyncTokenBucket | None = None
    _tpm_limiter: AsyncTokenBucket | None = None
    _limits: dict[str, Any] = {}

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        rm = _section(config, "reward_model")
        limits = {"max_concurrent": int(rm.get("max_concurrent", 1) or 1),
                  "max_rpm": rm.get("max_rpm"), "max_tpm": rm.get("max_tpm"),
                  "estimated_tokens_per_request": int(rm.get("estimated_tokens_per_request",
                                                             2000))}
        if cls._class_initialized:
            if limits != cls._limits:
                log.warning("RateLimitRewardManager: the limits are shared by every instance in "
                            "this process and were set first as %s; %s is ignored",
                            cls._limits, limits)
            return
        cls._limits = limits
        cls._semaphore = asyncio.Semaphore(limits["max_concurrent"])
        rpm, tpm = limits["max_rpm"], limits["max_tpm"]
        cls._rpm_limiter = AsyncTokenBucket(rpm / 60.0) if rpm else None
        cls._tpm_limiter = AsyncTokenBucket(tpm / 60.0) if tpm else None
        cls._class_initialized = True

    @classmethod
    def reset_class(cls) -> None:
        """Forget the shared limits (the next instance sets them again)."""
        cls._class_initialized = False
        cls._semaphore = cls._rpm_limiter = cls._tpm_limiter = None
        cls._limits = {}

    def __init__(self, config: Any, tokenizer: Any, compute_score: Callable[..., Any] | None = None,
                 reward_router_address: str | None = None,
                 reward_model_tokenizer: Any = None) -> None:
        super().__init__(config, tokenizer, compute_score, reward_router_address,
                         reward_model_tokenizer)
        self.timeout = float(_section(config, "reward_model").get("timeout", 300.0))

    async def run_single(self, data: Any) -> dict:
        _one(data)
        item = data[0]
        response_str, _ = await self.decode_response(item)
        if self._rpm_limiter is not None:
            await self._rpm_limiter.acquire(1.0)
        if self._tpm_limiter is not None:
            await self._tpm_limiter.acquire(float(self._limits["estimated_tokens_per_request"]))
        assert self._semaphore is not None
        source = item.non_tensor_batch["data_source"]
        async with self._semaphore:
            try:
                reward, info = await asyncio.wait_for(self.combined(item, response_str),
                                                      self.timeout)
            except TimeoutError:
                log.warning("reward for data_source %r timed out after %gs; scored 0.0",
                            source, self.timeout)
                reward, info = 0.0, {"timeout": True, "acc": 0.0}
            except Exception as e:  # noqa: BLE001 - verl's policy: an API failure scores 0
                log.error("reward for data_source %r failed; scored 0.0: %s", source, e)
                reward, info = 0.0, {"error": str(e), "acc": 0.0}
        return {"reward_score": reward, "reward_extra_info": info}


#: verl's class name
RateLimitedRewardManager = RateLimitRewardManager


def _one(data: Any) -> None:
    if len(data) != 1:
        raise ValueError(f"run_single: takes one sample, got a batch of {len(data)}")
