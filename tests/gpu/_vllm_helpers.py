"""Helpers shared by the vLLM GPU tests: prompt logprobs and reward scores from vLLM and from
transformers (bf16, on the GPU), and a one-call sync through ``FanOutClient``."""

from __future__ import annotations

import asyncio
from typing import Any

EXT = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"
# a trainer's torch.distributed variables, kept from the engine processes it starts
TORCH_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
TEXTS = ["The model is helpful today.", "Question: name a colour. Answer: blue.",
         "Weights move from the trainer into the inference engine after every step."]


def close(got: list[float], want: list[float]) -> bool:
    """bf16 end to end: relative + absolute tolerance (wrong weights miss by whole units)."""
    return all(abs(a - b) <= 0.03 * abs(b) + 0.05 for a, b in zip(got, want, strict=True))


def close_scores(got: list[float], want: list[float]) -> bool:
    """Reward scores in bf16: the error scales with the largest score (a head with std 1 gives
    scores of ~10, and vLLM's kernels and transformers' round a small score of such a head ~0.08
    apart, seen on an H200), while other weights move scores by whole units."""
    tol = 0.02 * max(abs(b) for b in want) + 0.05
    return all(abs(a - b) <= tol for a, b in zip(got, want, strict=True))


def prompt_ids(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t).input_ids for t in TEXTS]


def vllm_prompt_logprobs(llm: Any, ids: list[list[int]]) -> list[float]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                        use_tqdm=False)
    return [o.prompt_logprobs[i][p[i]].logprob for p, o in zip(ids, outs, strict=True)
            for i in range(1, len(p))]


def hf_prompt_logprobs(model: Any, ids: list[list[int]]) -> list[float]:
    """transformers' log-probability of every prompt token after the first: ``model`` on its
    device, or a checkpoint directory (loaded in bf16 onto the current GPU)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for p in ids:
            lp = model(torch.tensor([p], device=device)).logits.float().log_softmax(-1)[0]
            out += [float(lp[i - 1, p[i]]) for i in range(1, len(p))]
    return out


def vllm_scores(llm: Any) -> list[float]:
    from vllm import PoolingParams

    outs = llm.encode(TEXTS, pooling_params=PoolingParams(task="classify", use_activation=False),
                      pooling_task="classify", use_tqdm=False)
    return [float(o.outputs.data.reshape(-1)[0]) for o in outs]


def hf_scores(model_dir: str) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(torch.bfloat16).cuda()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt").to("cuda")).logits[0, 0].float().item()
                for t in TEXTS]


def cuda_state(model_dir: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    return {k: v.to(torch.bfloat16).cuda()
            for k, v in load_file(f"{model_dir}/model.safetensors").items()}


def sync(llm: Any, state: dict[str, Any], strategy_cfg: dict, *, per_chunk: int = 4) -> Any:
    """One update of ``state`` into ``llm`` (a fresh sender, closed after); returns its stats."""
    from weightsync import WeightChunk, build_strategy
    from weightsync.clients import FanOutClient

    names = list(state)
    chunks = [WeightChunk(names[i:i + per_chunk], [state[n] for n in names[i:i + per_chunk]])
              for i in range(0, len(names), per_chunk)]

    async def go() -> Any:
        client = FanOutClient([llm], timeout_s=120)
        strategy = build_strategy({"timeout_s": 60, **strategy_cfg})
        info = await strategy.create_sync_info(None, client)
        sender = await strategy.create_sender(None, client, info)
        try:
            return await sender.send_chunks(chunks, client)
        finally:
            await sender.close()
            await client.close_weight_transfer()

    return asyncio.run(go())


def start_llm(model_dir: str, gpus: str, *, tp: int = 1, memory: float = 0.3,
              extension: str | None = None) -> Any:
    """An in-process ``LLM`` (bf16, eager) whose processes see only ``gpus`` (e.g. "2,3"), with
    the trainer's torch.distributed variables kept from them."""
    import os

    from vllm import LLM

    from weightsync.bench.vllm_engine import BENCH_EXTENSION, fit_memory_utilization, scoped_env

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    memory = min(fit_memory_utilization(int(g), memory) for g in gpus.split(","))
    with scoped_env(**dict.fromkeys(TORCH_DIST_ENV), CUDA_VISIBLE_DEVICES=gpus):
        return LLM(model=model_dir, dtype="bfloat16", tensor_parallel_size=tp, max_model_len=256,
                   gpu_memory_utilization=memory, enforce_eager=True,
                   worker_extension_cls=extension or BENCH_EXTENSION, seed=0)


def push_broadcast(url: str, model: Any, api_key: str) -> Any:
    """One push of ``model`` to the server at ``url`` through the front door (``broadcast``; the
    backend follows the tensors: NCCL for CUDA); returns the ``SyncStats``."""
    import weightsync as ws

    async def go():
        async with ws.connect([url], strategy="broadcast", api_key=api_key,
                              timeout_s=120) as sync:
            return await sync.push(model)

    return asyncio.run(go())
