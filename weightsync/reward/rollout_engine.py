"""``RolloutEngine``: sample rollouts from a policy, score them with a reward model, assign
credit, and hand the trainer a ``SAWBatch`` (the reward plan's ``generate_batch(...,
reward_scorer=)`` hook); ``RolloutBatchSource`` makes it a ``BatchSource``.

Who calls: the RL loop in the trainer process, once per step::

    engine = RolloutEngine(policy_client)                      # any ChatClient
    batch = await engine.generate_batch(requests=requests, credit_assigner=algo.credit_assigner,
                                        reward_scorer=algo.reward_scorer)

``generate_batch`` runs, in this order: ``generate_rollouts`` (every episode of every request,
concurrently), ``await reward_scorer.score(rollouts)`` (when given: the scores land in the
rollouts' metadata **before** credit assignment reads them), ``credit_assigner.compute
(rollouts)``, then one ``SAWItem`` per step: the prompt and completion token ids the policy
server reported (``return_token_ids``), ``action_mask`` 1 on the completion, the step's weight,
and the sampling log-probabilities as ``actor_logps``.

A rollout here is one turn: ``RolloutRequest.prompt`` -> one completion; the environment's reward
for it is ``env_reward(prompt, completion)`` (0.0 without one). ``num_episodes`` completions of
one prompt share ``meta["initial_obs"]``, the group key of the GRPO / ScaleRL assigners. A
client with ``complete_n(request, n)`` (``VLLMChatClient``) samples them in one call (one
``sampling["seed"]`` gives ``n`` different, reproducible samples); any other ``ChatClient`` gets
one ``complete`` per episode, episode ``i`` with the seed ``seed + i``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.reward.rollout import CreditAssigner, Rollout, SAWBatch, SAWItem, Step


@dataclass(kw_only=True)
class RolloutRequest:
    """``num_episodes`` completions of ``prompt``: ``sampling`` (OpenAI sampling arguments:
    ``max_tokens``, ``temperature``, ``seed``, ...), ``extra_body`` (vLLM's extensions, e.g.
    ``ignore_eos``), ``env_reward(prompt, completion) -> float`` (None: 0.0), ``meta`` (copied
    into every rollout's metadata)."""

    prompt: str
    num_episodes: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    env_reward: Callable[[str, str], float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ValueError(f"prompt: a non-empty string, got {self.prompt!r}")
        if isinstance(self.num_episodes, bool) or not isinstance(self.num_episodes, int) or (
                self.num_episodes < 1):
            raise ValueError(f"num_episodes: an int >= 1, got {self.num_episodes!r}")


class RolloutEngine:
    """See the module docstring. ``client``: a ``ChatClient`` (``VLLMChatClient`` for a policy
    server); ``max_concurrency``: completion calls in flight at once."""

    def __init__(self, client: Any, *, max_concurrency: int = 16) -> None:
        if not callable(getattr(client, "complete", None)):
            raise TypeError(f"client must be a ChatClient (async complete(request)); a "
                            f"{type(client).__name__} has none")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or (
                max_concurrency < 1):
            raise ValueError(f"max_concurrency: an int >= 1, got {max_concurrency!r}")
        self.client = client
        self.max_concurrency = max_concurrency

    async def generate_rollouts(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        """Every episode of every request, in request order (episodes in order)."""
        sem = asyncio.Semaphore(self.max_concurrency)
        grouped = callable(getattr(self.client, "complete_n", None))

        async def group(req: RolloutRequest) -> list[Rollout]:
            async with sem:
                responses, _ = await self.client.complete_n(_completion(req, req.sampling),
                                                            req.num_episodes)
            return [_rollout(req, resp) for resp in responses]

        async def episode(req: RolloutRequest, i: int) -> list[Rollout]:
            sampling = dict(req.sampling)
            if sampling.get("seed") is not None:
                sampling["seed"] = int(sampling["seed"]) + i
            async with sem:
                resp, _ = await self.client.complete(_completion(req, sampling))
            return [_rollout(req, resp)]

        calls = ([group(req) for req in requests] if grouped else
                 [episode(req, i) for req in requests for i in range(req.num_episodes)])
        return [r for batch in await asyncio.gather(*calls) for r in batch]

    async def generate_batch(
        self,
        *,
        requests: Sequence[RolloutRequest],
        credit_assigner: CreditAssigner,
        reward_scorer: Any = None,
    ) -> SAWBatch:
        """Rollouts -> reward-model scores (``reward_scorer``, before credit) -> credit ->
        ``SAWBatch`` (see the module docstring). ``batch.meta``: ``rollouts``,
        ``policy_versions`` (the versions that sampled them)."""
        rollouts = await self.generate_rollouts(requests)
        if reward_scorer is not None:
            await reward_scorer.score(rollouts)
        weights = credit_assigner.compute(rollouts)
        items = [saw_item(r, s, weights[(r.id, s.index)]) for r in rollouts for s in r.steps]
        versions = sorted({v for r in rollouts
                           if (v := r.meta.get("policy_version")) is not None})
        return SAWBatch(items, {"rollouts": rollouts, "policy_versions": versions})


def _completion(req: RolloutRequest, sampling: dict[str, Any]) -> Any:
    from weightsync.policy.types import ChatCompletionRequest

    return ChatCompletionRequest(prompt=req.prompt, sampling=dict(sampling),
                                 return_token_ids=True, logprobs=0,
                                 extra_body=dict(req.extra_body))


def _rollout(req: RolloutRequest, resp: Any) -> Rollout:
    """One sampled completion as a one-step rollout (token ids and log-probabilities kept)."""
    reward = float(req.env_reward(req.prompt, resp.text)) if req.env_reward else 0.0
    step = Step(0, req.prompt, resp.text, reward=reward, terminated=True, info={
        "prompt_token_ids": resp.prompt_token_ids,
        "completion_token_ids": resp.completion_token_ids,
        "completion_logprobs": resp.completion_logprobs,
        "finish_reason": resp.finish_reason,
    })
    meta = {"initial_obs": req.prompt, **req.meta, "policy_version": resp.weight_version}
    return Rollout(steps=[step], meta=meta)


def saw_item(rollout: Rollout, step: Step, weight: float) -> SAWItem:
    """The training sample of one sampled step (its token ids in ``step.info``)."""
    prompt = step.info.get("prompt_token_ids")
    completion = step.info.get("completion_token_ids")
    if prompt is None or completion is None:
        raise ValueError(f"rollout {rollout.id!r} step {step.index}: no token ids in step.info "
                         f"(the policy client must return prompt and completion token ids)")
    logps = step.info.get("completion_logprobs")
    n_prompt, n_completion = len(prompt), len(completion)
    return SAWItem(
        input_ids=[*prompt, *completion],
        attention_mask=[1] * (n_prompt + n_completion),
        action_mask=[0] * n_prompt + [1] * n_completion,
        weight=float(weight),
        actor_logps=list(logps) if logps is not None and len(logps) == n_completion else None,
        meta={"rollout_id": rollout.id, "step_index": step.index,
              "policy_version": rollout.meta.get("policy_version")},
    )


class RolloutBatchSource:
    """A ``BatchSource`` that samples a fresh batch on every ``next_batch()``:
    ``requests_fn()`` gives the step's requests."""

    def __init__(self, engine: RolloutEngine, requests_fn: Callable[[], Sequence[RolloutRequest]],
                 credit_assigner: CreditAssigner, *, reward_scorer: Any = None) -> None:
        self.engine = engine
        self.requests_fn = requests_fn
        self.credit_assigner = credit_assigner
        self.reward_scorer = reward_scorer

    async def next_batch(self) -> SAWBatch:
        return await self.engine.generate_batch(
            requests=list(self.requests_fn()), credit_assigner=self.credit_assigner,
            reward_scorer=self.reward_scorer)
