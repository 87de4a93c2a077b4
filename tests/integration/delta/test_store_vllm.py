"""Delta pushes into a real vLLM CPU engine serving bf16 (an offline ``LLM`` with the worker
extension; CPU loads in layer-wise reload mode, so the engine rebuilds every tensor on its own
copy of the base and reloads it).

The trainer is a transformers causal LM fine-tuned for real (AdamW on a next-token loss over
text, from float32 masters of a bf16 checkpoint), pushed with ``dtype=bfloat16``. Exactness is
checked two ways: every rebuilt tensor's checksum against the trainer's (``checksum: true``,
in the worker), and vLLM's outputs after the deltas equal its outputs after a full push of the
same weights, token for token and logprob for logprob. They also agree with transformers
(bf16; its kernels differ from vLLM's, so the first greedy token, where no near tie has
appeared yet)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _greedy import PROMPTS, vllm_greedy

import weightsync as ws

pytestmark = pytest.mark.slow

EXT = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    path = build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "base", seed=0)
    llm = LLM(model=path, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, worker_extension_cls=EXT, seed=0)
    try:
        yield llm, path
    finally:
        shutdown_llm(llm)


def _trainer(path: str, lr: float = 1e-5):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # float32 masters of the bf16 weights the engine serves
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, AutoTokenizer.from_pretrained(path), torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.0)


def _step(model, tok, opt, step: int) -> None:
    from weightsync.testing.tiny_models import corpus

    texts = corpus(8, seed=100 + step)
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=64)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    model(**batch, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def hf_first_tokens(model, tok, n=1):
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    tokens = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = bf16.generate(ids, max_new_tokens=n, do_sample=False,
                                pad_token_id=tok.pad_token_id)
        tokens.append(out[0, ids.shape[1]:].tolist())
    return tokens


def first_tokens(outputs):
    return [t[:1] for t in outputs[0]]


def test_delta_pushes_into_vllm_are_exact_and_small(lm):
    llm, path = lm
    model, tok, opt = _trainer(path)
    strategy = {"type": "broadcast", "backend": "gloo", "checksum": True, "timeout_s": 60}

    async def go():
        async with ws.connect(llm, strategy, delta=True) as sync:
            v0 = (await sync.status())[0]["version"]
            first = await sync.push(model, version=v0 + 1, dtype=torch.bfloat16)
            deltas = []
            for step in range(1, 4):
                _step(model, tok, opt, step)
                deltas.append(await sync.push(model, version=v0 + 1 + step, dtype=torch.bfloat16))
            after_delta = vllm_greedy(llm)
            state = (await sync.status())[0]
            full = await sync.push(model, version=v0 + 5, dtype=torch.bfloat16, delta=False)
            return first, deltas, after_delta, state, full, vllm_greedy(llm)

    first, deltas, after_delta, state, full, after_full = asyncio.run(go())
    assert first.delta["base_version"] is None
    for d in deltas:
        assert not d.delta["fallback"] and d.delta["full_bytes"] == first.total_bytes
        assert d.total_bytes < 0.5 * first.total_bytes
    assert state["delta"]["shadow_bytes"] == first.total_bytes  # reload mode: a copy of all
    assert full.delta is None and full.total_bytes == first.total_bytes
    assert after_delta == after_full  # the same weights, bit for bit: the same logprobs
    assert first_tokens(after_delta) == hf_first_tokens(model, tok)


def test_an_engine_that_missed_a_version_gets_a_full_update(lm):
    llm, path = lm
    model, tok, opt = _trainer(path)
    other, _, _ = _trainer(path)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)

    async def go():
        async with ws.connect(llm, "packed_cuda_ipc", delta=True) as sync:
            v0 = (await sync.status())[0]["version"]
            await sync.push(model, version=v0 + 1, dtype=torch.bfloat16)
            _step(model, tok, opt, 1)
            intruder = await ws.connect(llm, "packed_cuda_ipc")  # another trainer, same engine
            await intruder.push(other, version=v0 + 5, dtype=torch.bfloat16)
            assert (await sync.status())[0]["delta"] is None  # the engine's base is gone
            fallback = await sync.push(model, version=v0 + 6, dtype=torch.bfloat16)
            _step(model, tok, opt, 2)
            again = await sync.push(model, version=v0 + 7, dtype=torch.bfloat16)
            after_delta = vllm_greedy(llm)
            await sync.push(model, version=v0 + 8, dtype=torch.bfloat16, delta=False)
            return fallback, again, after_delta, vllm_greedy(llm)

    fallback, again, after_delta, after_full = asyncio.run(go())
    assert fallback.delta["fallback"] and fallback.total_bytes == fallback.delta["full_bytes"]
    assert fallback.versions == [fallback.delta["base_version"] + 5]
    assert not again.delta["fallback"] and again.total_bytes < fallback.total_bytes / 2
    assert after_delta == after_full
    assert first_tokens(after_delta) == hf_first_tokens(model, tok)
