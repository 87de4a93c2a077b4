"""LoRA adapter-only updates into a real vLLM CPU engine (``enable_lora=True``, float32): a
PEFT policy pushes only its ``lora_A`` / ``lora_B`` through ``ws.connect(...,
extractor="lora_adapter").push(model)``; the engine installs them from memory as the new
version of adapter "policy"; requests that name it (``ws.lora_request("policy")``) are served
by the latest version and equal the merged model in transformers (same dtype); requests
without it keep the base weights. A bad adapter is refused before any byte moves, naming the
tensor or the setting, and the engine keeps serving the previous version."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _greedy import hf_greedy, vllm_greedy

import weightsync as ws
from weightsync.errors import UpdateRefusedError, WeightMismatchError

pytestmark = pytest.mark.slow

EXT = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    path = build_tiny_causal_lm(tmp_path_factory.mktemp("lora") / "base", seed=0)
    llm = LLM(model=path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, worker_extension_cls=EXT, seed=0, enable_lora=True,
              max_lora_rank=16, max_loras=2, max_cpu_loras=6)
    try:
        yield llm, path
    finally:
        shutdown_llm(llm)


def _policy(path: str, *, r: int = 8, seed: int = 1):
    """A PEFT policy on the served base, its adapter moved away from PEFT's zero init (B = 0
    would make the adapter a no-op, and every comparison trivially true)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS,
                                            lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, AutoTokenizer.from_pretrained(path)


def _merged(model):
    """transformers' reference: a merged copy (the trainer's model is left as it is)."""
    import copy

    return copy.deepcopy(model).merge_and_unload().eval()


def _train_step(model, tok) -> None:
    from weightsync.testing.tiny_models import corpus

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    batch = tok(corpus(8, seed=7), return_tensors="pt", padding=True, truncation=True,
                max_length=48)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    model(**batch, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def _close(a, b, atol=2e-3):
    return all(abs(x - y) <= atol for xs, ys in zip(a, b, strict=True)
               for x, y in zip(xs, ys, strict=True))


def _push_and_greedy(llm, model, name: str):
    """One adapter push of ``model`` under ``name`` through a session of its own, then vLLM's
    greedy tokens and logprobs for requests that name the adapter."""
    async def run():
        async with ws.connect([llm], "broadcast", extractor={"type": "lora_adapter",
                                                             "adapter_name": name}) as sync:
            await sync.push(model)
        return vllm_greedy(llm, lora_request=ws.lora_request(name))

    return asyncio.run(run())


def test_adapter_push_serves_the_merged_model_and_replaces_the_last_version(lm):
    llm, path = lm
    model, tok = _policy(path)
    base_tokens, _ = vllm_greedy(llm)
    assert base_tokens == hf_greedy(path)[0]
    full_bytes = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())

    async def run():
        async with ws.connect([llm], "broadcast", extractor="lora_adapter") as sync:
            first = await sync.push(model, version=1)
            got1 = vllm_greedy(llm, lora_request=ws.lora_request("policy"))
            base_after = vllm_greedy(llm)[0]
            _train_step(model, tok)  # a real step: the adapter moves, the base does not
            second = await sync.push(model, version=2)
            got2 = vllm_greedy(llm, lora_request=ws.lora_request("policy"))
            return first, second, got1, got2, base_after, await sync.status()

    first, second, got1, got2, base_after, status = asyncio.run(run())
    assert first.total_bytes < 0.2 * full_bytes  # only A and B travelled
    assert first.total_bytes == second.total_bytes > 0
    # version 1 was checked against the merged model of version 1 before the step
    assert base_after == base_tokens  # requests without the adapter keep the base weights
    want2 = hf_greedy(_merged(model), tok)
    assert got2[0] == want2[0] and _close(got2[1], want2[1])
    assert got2[0] != got1[0]  # the new version replaced the old (and no stale prefix KV)
    assert status[0]["version"] == 2


def test_first_version_equals_merged_transformers(lm):
    llm, path = lm
    model, tok = _policy(path, seed=3)
    want = hf_greedy(_merged(model), tok)

    tokens, logprobs = _push_and_greedy(llm, model, "other")
    assert tokens == want[0] and _close(logprobs, want[1])
    assert tokens != vllm_greedy(llm)[0]  # the adapter changes what is served


def test_bad_adapters_are_refused_before_any_byte_and_the_last_version_serves(lm, tmp_path):
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    llm, path = lm
    good, _ = _policy(path, seed=5)
    too_big, _ = _policy(path, r=32, seed=5)  # the engine's max_lora_rank is 16
    other = build_tiny_causal_lm(tmp_path / "wide", hidden_size=96, seed=0)
    wrong_shape, _ = _policy(other, seed=5)  # another model's adapter: other shapes

    async def run():
        async with ws.connect([llm], "broadcast",
                              extractor={"type": "lora_adapter", "adapter_name": "bad"}) as sync:
            await sync.push(good)
            before = vllm_greedy(llm, lora_request=ws.lora_request("bad"))
            with pytest.raises(UpdateRefusedError) as rank:
                await sync.push(too_big)
            with pytest.raises(WeightMismatchError) as shape:
                await sync.push(wrong_shape)
            after = vllm_greedy(llm, lora_request=ws.lora_request("bad"))
            return before, after, rank.value, shape.value, await sync.status()

    before, after, rank, shape, status = asyncio.run(run())
    assert "rank" in str(rank) and "32" in str(rank)
    text = str(shape)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in text
    assert "expected [8, 64]" in text
    assert after == before
    assert status[0]["state"] == "idle"


def _slot(llm, name: str) -> dict:
    from weightsync.lora_adapter import adapter_id

    return llm.collective_rpc("weightsync_lora_slot", args=(adapter_id(name),))[0]


def _digest(llm, name: str) -> dict:
    from weightsync.lora_adapter import adapter_id

    return llm.collective_rpc("weightsync_lora_digest", args=(adapter_id(name),))[0]


def test_later_versions_are_written_where_vllm_holds_the_adapter_bit_equal_to_its_own_build(lm):
    """The first version is built by vLLM; the next ones of the same adapter (same config,
    names, shapes) are written into the tensors vLLM holds and, where the adapter is active,
    into its slot: the first time vLLM's own set_lora is recorded, then its copies replayed. The result is compared with vLLM building and activating the same tensors
    under another name: the same LoRAModel tensors, the same slot contents, the same tokens
    (= the merged model in transformers); the engine copies from the views its receiver lends
    for the update's one call (the broadcast's staging, or through cuda_ipc the sender's own
    memory). A push of another rank is built by vLLM again."""
    llm, path = lm
    model, tok = _policy(path, seed=11)

    async def run():
        hows = []
        async with ws.connect([llm], "broadcast", extractor={"type": "lora_adapter",
                                                             "adapter_name": "fast"}) as sync:
            for v in (1, 2, 3):
                if v > 1:
                    _train_step(model, tok)
                await sync.push(model)  # the next version (earlier tests moved the engine's)
                hows.append(_slot(llm, "fast")["installed"])
                if v == 1:
                    vllm_greedy(llm, lora_request=ws.lora_request("fast"))  # now active
            got = vllm_greedy(llm, lora_request=ws.lora_request("fast"))
        return hows, got

    hows, got = asyncio.run(run())
    fresh = _push_and_greedy(llm, model, "fresh")  # the same tensors, built and activated by vLLM
    # the streamed broadcast lends the update's last chunk (its staging views) too
    assert hows == ["built", "rewritten from lent views, slot recorded",
                    "rewritten from lent views, slot replayed"]
    assert _digest(llm, "fast") == _digest(llm, "fresh")  # what vLLM holds, bit for bit
    fast_slot, fresh_slot = _slot(llm, "fast"), _slot(llm, "fresh")
    assert fast_slot["slot"] != fresh_slot["slot"]  # both active, side by side
    assert fast_slot["digest"] == fresh_slot["digest"]  # the replayed slot = vLLM's activation
    want = hf_greedy(_merged(model), tok)
    assert got[0] == fresh[0] == want[0] and _close(got[1], want[1])

    # the next versions through cuda_ipc (shared memory on a CPU engine): the update is one
    # call, so the engine keeps the views the sender lends it and copies them straight where
    # vLLM holds the adapter (no inbox between); bit-equal again
    async def through_ipc():
        hows = []
        async with ws.connect([llm], "cuda_ipc", extractor={"type": "lora_adapter",
                                                            "adapter_name": "fast"}) as sync:
            for _ in range(2):
                _train_step(model, tok)
                await sync.push(model)
                hows.append(_slot(llm, "fast")["installed"])
        return hows

    assert asyncio.run(through_ipc()) == ["rewritten from lent views, slot replayed"] * 2
    _push_and_greedy(llm, model, "fresh")
    assert _digest(llm, "fast") == _digest(llm, "fresh")
    assert _slot(llm, "fast")["digest"] == _slot(llm, "fresh")["digest"]
    want = hf_greedy(_merged(model), tok)
    assert vllm_greedy(llm, lora_request=ws.lora_request("fast"))[0] == want[0]

    # before a sleep the engine frees the buffers adapter updates arrive in; the next version
    # is built by vLLM again (and still equals the merged model)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if "lora_" in n)
    assert llm.collective_rpc("weightsync_release_staging")[0] >= adapter_bytes

    again = _push_and_greedy(llm, model, "fast")
    assert _slot(llm, "fast")["installed"] == "built"
    assert again[0] == want[0]

    other_rank, _ = _policy(path, r=4, seed=11)
    tokens, logprobs = _push_and_greedy(llm, other_rank, "fast")
    assert _slot(llm, "fast")["installed"] == "built"  # another key: vLLM builds it
    want = hf_greedy(_merged(other_rank), tok)
    assert tokens == want[0] and _close(logprobs, want[1])


def test_an_engine_full_of_pushed_adapters_refuses_one_more(lm):
    """Adapters pushed from memory are never evicted (no file to reload them from): the
    engine keeps ``max_cpu_loras`` of them and refuses a new name beyond that, at start; a name
    it holds still takes new versions."""
    llm, path = lm
    model, _ = _policy(path, seed=9)

    async def push(name: str):
        async with ws.connect([llm], "broadcast",
                              extractor={"type": "lora_adapter", "adapter_name": name}) as sync:
            return await sync.push(model)

    async def run():
        # the earlier tests' adapters, and one more up to 6
        for name in ("policy", "other", "bad", "fast", "fresh", "d"):
            await push(name)
        with pytest.raises(UpdateRefusedError) as full:
            await push("e")
        return full.value

    full = asyncio.run(run())
    assert "max_cpu_loras=6" in str(full)
    assert vllm_greedy(llm, lora_request=ws.lora_request("d"))[0] == vllm_greedy(
        llm, lora_request=ws.lora_request("policy"))[0]  # same adapter pushed under both names
