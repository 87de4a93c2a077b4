"""Did the engine get the trainer's weights? Two checks for ``weightsync.bench.vllm_runner``:

* ``verify_engine(llm, module)``: every parameter of every vLLM worker against what the trainer's
  checkpoint-format ``module`` implies for that worker (fused q/k/v and gate/up, the worker's TP
  slice), by on-device checksums (``weightsync.bench.checksum``): nothing but one integer per
  tensor crosses to the host. Parameters the engine cannot show in checkpoint form (vLLM on CPU
  repacks linear weights to shape [0]) are listed as ``unreadable``, not compared.
* ``logprob_check(llm, module, model_dir, ...)``: prompt logprobs served by vLLM against
  transformers holding ``module``'s weights (same dtype), for what checksums cannot read.

Runs in the bench process; the engine needs ``BenchWorkerExtension``.
"""

from __future__ import annotations

from typing import Any


def verify_engine(llm: Any, module: Any) -> dict[str, Any]:
    """``{bit_exact, compared, mismatched, missing, unreadable, extra, num_*}`` (lists cut to
    10 names; ``num_*`` count them all)."""
    import torch

    from weightsync.bench.checksum import expected_engine_tensors, tensor_checksum_device

    packed = llm.collective_rpc("bench_packed_mapping")[0]
    tp = len(llm.collective_rpc("bench_noop"))
    named = list(module.state_dict().items())
    expected_by_rank: list[dict[str, list[int]]] = []
    want_by_rank: list[dict[str, int]] = []
    with torch.no_grad():
        for r in range(tp):
            shapes: dict[str, list[int]] = {}
            sums: dict[str, Any] = {}
            for name, t in expected_engine_tensors(named, packed, tp_rank=r, tp_size=tp):
                shapes[name] = list(t.shape)
                sums[name] = tensor_checksum_device(t)
            expected_by_rank.append(shapes)
            keys = list(sums)
            vals = torch.stack([sums[k] for k in keys]).tolist() if keys else []
            want_by_rank.append(dict(zip(keys, (int(v) for v in vals), strict=True)))
    answers = llm.collective_rpc("bench_checksums", args=(expected_by_rank,))
    out: dict[str, Any] = {"compared": 0, "mismatched": [], "missing": [], "unreadable": [],
                           "extra": []}
    for r, ans in enumerate(answers):
        got = {k: int(v) for k, v in ans["checksums"].items()}
        want = want_by_rank[r]
        out["compared"] += len(got)
        out["mismatched"] += [f"rank {r}: {n}" for n in got if got[n] != want[n]]
        out["missing"] += [f"rank {r}: {n}" for n in ans["missing"]]
        out["unreadable"] += [f"rank {r}: {n}" for n in ans["unreadable"]]
        out["extra"] += [f"rank {r}: {n}" for n in ans["extra"]]
    out["bit_exact"] = bool(out["compared"]) and not out["mismatched"] and not out["missing"]
    for k in ("mismatched", "missing", "unreadable", "extra"):
        out[f"num_{k}"] = len(out[k])
        out[k] = out[k][:10]
    return out


def logprob_check(llm: Any, module: Any, model_dir: str, *, dtype: str, device: str,
                  prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """``{max_abs_err, tolerance, ok}`` over the prompt tokens of a few fixed prompts.

    Tolerance: 2e-3 in float32 (vLLM and transformers agree to ~1e-5 there), 0.15 in bf16/fp16
    (different kernels round differently; wrong weights miss by whole units)."""
    import torch
    import transformers
    from vllm import SamplingParams

    config = transformers.AutoConfig.from_pretrained(model_dir)
    if prompts is None:
        vocab = int(config.vocab_size)
        prompts = [[(7 * i + 13 * j + 1) % vocab for j in range(12)] for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                        use_tqdm=False)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = hf.load_state_dict(module.state_dict(), strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"trainer module does not fit {config.architectures}: missing "
                         f"{sorted(set(missing) - allowed)[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf.eval()
    worst = 0.0
    with torch.no_grad():
        for p, o in zip(prompts, outs, strict=True):
            lp = hf(torch.tensor([p], device=device)).logits.float().log_softmax(-1)[0]
            for i in range(1, len(p)):
                got = o.prompt_logprobs[i][p[i]].logprob
                worst = max(worst, abs(got - float(lp[i - 1, p[i]])))
    del hf
    tol = 2e-3 if dtype == "float32" else 0.15
    return {"max_abs_err": worst, "tolerance": tol, "ok": worst <= tol}
