"""The policy half of the RLHF demo: sampling from the policy server, and the trainer's copy.

Runs in the trainer process (``weightsync.demo.rlhf``, ``examples/reward_model/``).

- ``served_model_name(http, url)``: the name to put in requests (``GET /v1/models``).
- ``sample_group(http, url, ...)``: one ``POST /v1/completions`` to the policy server (vLLM's
  OpenAI route behind ``weightsync serve-policy``) for ``n`` completions of one prompt, with the
  token ids (``return_token_ids``), vLLM's log-probability of each sampled token and the weight
  version that produced them (the ``x-weight-version`` header). ``ignore_eos`` keeps every
  completion ``max_tokens`` long.
- ``PolicyTrainer``: the trainer's transformers copy of the same checkpoint (fp32), its Adam
  optimiser, ``logprobs(samples)`` (of the sampled tokens, in the server's exact context) and
  ``update(samples, weights, loss, epochs)``: a few policy-gradient epochs over one batch with
  the algorithm's loss; the sampling-time log-probabilities (before the first epoch) are the
  ``old_logprobs`` of the clipped objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION_HEADER = "x-weight-version"


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled completion, as the policy server returned it."""

    prompt: str
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]
    served_logprobs: list[float]  # vLLM's log-probability of each sampled token
    version: int | None  # the policy weight version that sampled it


async def served_model_name(http: Any, url: str) -> str:
    """The model name the policy server at ``url`` serves (``GET /v1/models``)."""
    r = await http.get(url + "/v1/models")
    if r.status_code != 200 or not r.json().get("data"):
        raise RuntimeError(f"policy server {url}/v1/models answered {r.status_code}: "
                           f"{r.text[:300]}")
    return str(r.json()["data"][0]["id"])


async def sample_group(
    http: Any,
    url: str,
    model: str,
    prompt: str,
    *,
    n: int,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
) -> list[Sample]:
    """``n`` completions of ``prompt`` from the policy server at ``url`` (see the module doc)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens,
        "temperature": temperature, "top_p": 1.0, "ignore_eos": True, "logprobs": 0,
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    r = await http.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"policy server {url}/v1/completions answered {r.status_code}: "
                           f"{r.text[:500]}")
    data = r.json()
    version = r.headers.get(VERSION_HEADER)
    out = []
    for choice in sorted(data["choices"], key=lambda c: c["index"]):
        ids = choice.get("token_ids")
        prompt_ids = choice.get("prompt_token_ids")
        if ids is None or prompt_ids is None:
            raise RuntimeError(f"policy server {url}: no token ids in the completion (is it "
                               "vLLM's OpenAI server? return_token_ids needs vLLM >= 0.10)")
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        out.append(Sample(prompt, list(prompt_ids), choice["text"], list(ids),
                          [float(x) for x in lps], int(version) if version else None))
    return out


class PolicyTrainer:
    """The trainer's copy of the policy: transformers causal LM (fp32) + Adam."""

    def __init__(self, model_dir: str, *, lr: float, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.to(device).eval()
        self.device = device
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def logprobs(self, samples: Sequence[Sample]) -> tuple[Any, Any]:
        """-> (``[B, T]`` log-probabilities of each sample's completion tokens, ``[B, T]`` mask
        of real tokens), with grad when the model is in train mode."""
        import torch
        import torch.nn.functional as F

        seqs = [s.prompt_ids + s.completion_ids for s in samples]
        width = max(len(x) for x in seqs)
        t_max = max(len(s.completion_ids) for s in samples)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            attn[i, : len(x)] = 1
        logits = self.model(input_ids=ids.to(self.device),
                            attention_mask=attn.to(self.device)).logits.float()
        logp_all = torch.log_softmax(logits, dim=-1)
        rows, mask = [], torch.zeros(len(seqs), t_max, device=self.device)
        for i, s in enumerate(samples):
            p, t = len(s.prompt_ids), len(s.completion_ids)
            # position j predicts token j + 1, so completion token k is read at p - 1 + k
            positions = torch.arange(p - 1, p - 1 + t, device=self.device)
            tokens = torch.tensor(s.completion_ids, device=self.device)
            rows.append(F.pad(logp_all[i, positions, tokens], (0, t_max - t)))
            mask[i, :t] = 1.0
        return torch.stack(rows), mask

    def update(self, samples: Sequence[Sample], weights: Sequence[float], loss_fn: Any, *,
               epochs: int) -> tuple[float, float]:
        """``epochs`` full-batch steps of ``loss_fn(logprobs, weights, mask=, old_logprobs=)``
        -> (first loss, last loss). ``old_logprobs``: this model's before the first step."""
        import torch

        with torch.no_grad():
            old, mask = self.logprobs(samples)
        losses = []
        self.model.train()
        try:
            for _ in range(epochs):
                logp, _ = self.logprobs(samples)
                loss = loss_fn(logp, list(weights), mask=mask, old_logprobs=old)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                losses.append(float(loss.detach()))
        finally:
            self.model.eval()
        return losses[0], losses[-1]

    def max_logprob_gap(self, samples: Sequence[Sample]) -> float:
        """max |trainer log-prob - server log-prob| over the sampled tokens: ~0 when the
        server samples with the weights the trainer holds (the last push landed)."""
        import torch

        with torch.no_grad():
            mine, mask = self.logprobs(samples)
        gap = 0.0
        for i, s in enumerate(samples):
            if len(s.served_logprobs) != len(s.completion_ids):
                raise RuntimeError("the policy server returned no log-probability per token")
            served = torch.tensor(s.served_logprobs, device=mine.device)
            gap = max(gap, float((mine[i, : len(served)] - served).abs().max()))
        return gap
