"""Shared by the tests that compare an offline vLLM ``LLM`` with transformers: greedy tokens
and their logprobs for the same prompts on both sides."""

from __future__ import annotations

from typing import Any

import torch

PROMPTS = ["The model is", "Weights move from", "Question: name a colour. Answer:"]


def vllm_greedy(llm: Any, n: int = 8, *, lora_request: Any = None,
                ) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM's greedy tokens for ``PROMPTS`` and the logprob of each (``lora_request``: served
    by that adapter)."""
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, logprobs=1),
                        use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs], [
        [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]


def hf_greedy(model: Any, tok: Any = None, n: int = 8) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and logprobs for ``PROMPTS``; ``model``: a causal LM, or
    the directory of one (its tokenizer then comes from there too)."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model).eval()
    tokens, logprobs = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        gen = out.sequences[0, ids.shape[1]:].tolist()
        tokens.append(gen)
        logprobs.append([s.log_softmax(-1)[0, t].item()
                         for s, t in zip(out.scores, gen, strict=True)])
    return tokens, logprobs
