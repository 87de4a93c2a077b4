"""Shared by the policy-server tests: a transformers reference of the served causal LM and
helpers that read vLLM's completion answers (prompt logprobs, greedy tokens, versions)."""

from __future__ import annotations

import httpx
import torch

PROMPTS = ["The model is helpful", "Weights move from the trainer to", "hi"]
TOL = 1e-4  # fp32 served vs fp32 transformers
N_NEW = 6


class Reference:
    """A transformers copy of the served model whose weights the tests change in place."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def ids(self, text: str) -> list[int]:
        return self.tok(text).input_ids

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1."""
        x = torch.tensor([ids])
        lp = self.model(x).logits[0].log_softmax(-1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int = N_NEW) -> list[int]:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.model(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(ids):]

    @torch.no_grad()
    def greedy_on_kv(self, kv_from: Reference, ids: list[int], kv_len: int,
                     n: int = N_NEW) -> list[int]:
        """Greedy continuation of ``ids`` by this model, on the KV that ``kv_from`` computed
        for ``ids[:kv_len]`` (what a request in flight does after a flip that keeps its KV:
        ``--in-flight-kv keep``); the rest of ``ids`` is run by this model first."""
        past = kv_from.model(torch.tensor([ids[:kv_len]]), use_cache=True).past_key_values
        x, out = torch.tensor([ids[kv_len:]]), []
        for _ in range(n):
            step = self.model(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
        return out

    def perturb(self, seed: int) -> dict[str, torch.Tensor]:
        """Move every parameter by seeded noise, in place; returns the new state (the names a
        tied model's checkpoint holds: no ``lm_head.weight``)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for n, t in state.items():
                if n in params:
                    params[n].copy_(t)


def served(server, prompt: str, *, n: int = N_NEW, **extra) -> tuple[dict, httpx.Response]:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny-policy", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "prompt_logprobs": 0, "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
        **extra,
    })
    assert r.status_code == 200, r.text
    return r.json(), r


def prompt_lps(body: dict) -> list[float]:
    plp = body["choices"][0]["prompt_logprobs"]
    ids = body["choices"][0]["prompt_token_ids"]
    return [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def completion_lps(body: dict) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def check_against(server, ref: Reference, prompt: str) -> int:
    """The served prompt logprobs, greedy tokens and their logprobs equal transformers';
    returns the version the response reports."""
    body, r = served(server, prompt)
    ids = body["choices"][0]["prompt_token_ids"]
    assert ids == ref.ids(prompt)
    assert max_diff(prompt_lps(body), ref.logprobs(ids)) <= TOL
    gen = body["choices"][0]["token_ids"]
    assert gen == ref.greedy(ids)
    assert max_diff(completion_lps(body), ref.logprobs(ids + gen)[len(ids) - 1:]) <= TOL
    assert int(r.headers["x-weight-version"]) == body["weight_version"]
    return body["weight_version"]


