"""``VLLMWeightLoader`` in an offline ``LLM`` (generative tiny Qwen2) through the worker
extension and ``collective_rpc``: new weights arrive over a real gloo broadcast from this
process, and vLLM then generates what transformers generates with those weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _greedy import hf_greedy, vllm_greedy

from weightsync import WeightChunk, build_strategy
from weightsync.errors import WeightMismatchError

pytestmark = pytest.mark.slow

EXT = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("lm")
    base = build_tiny_causal_lm(root / "base", seed=0)
    new = build_tiny_causal_lm(root / "new", seed=5)
    llm = LLM(model=base, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, worker_extension_cls=EXT, seed=0)
    try:
        yield llm, base, new
    finally:
        shutdown_llm(llm)


def state_dict(model_dir):
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def chunks_of(sd, per):
    names = list(sd)
    return [WeightChunk(names[i:i + per], [sd[n] for n in names[i:i + per]])
            for i in range(0, len(names), per)]


def test_worker_extension_reports(lm):
    llm, base, _ = lm
    (state,) = llm.collective_rpc("weightsync_state")
    assert state["version"] == 0 and state["state"] == "idle" and state["world_size"] == 1
    assert state["load_mode"] == "reload"  # CPU: layer-wise reload
    (meta,) = llm.collective_rpc("weightsync_expected_metadata")
    names = {m["name"] for m in meta}
    assert names == set(state_dict(base)) and all(m["dtype"] == "float32" for m in meta)


def test_sync_into_generative_llm_matches_transformers(lm):
    from weightsync.clients import FanOutClient

    llm, base, new = lm
    before, _ = vllm_greedy(llm)
    assert before == hf_greedy(base)[0]
    want_tokens, want_lp = hf_greedy(new)
    assert want_tokens != before

    client = FanOutClient([llm])
    sd_new, sd_base = state_dict(new), state_dict(base)

    async def go():
        strategy = build_strategy({"type": "broadcast", "backend": "gloo",
                                   "master_addr": "127.0.0.1", "timeout_s": 60})
        info = await strategy.create_sync_info(None, client)
        sender = await strategy.create_sender(None, client, info)
        try:
            # 3 tensors per chunk: q/k/v and gate/up land in different chunks
            stats = await sender.send_chunks(chunks_of(sd_new, 3), client)
            got = vllm_greedy(llm)
            with pytest.raises(WeightMismatchError) as shape_err:
                await sender.send_chunks([WeightChunk(["model.norm.weight"], [torch.zeros(3)])], client)
            with pytest.raises(WeightMismatchError) as layer_err:
                q = "model.layers.1.self_attn.q_proj.weight"
                await sender.send_chunks([WeightChunk([q], [sd_base[q]])], client)
            after_bad = vllm_greedy(llm)[0]
            back = await sender.send_chunks(chunks_of(sd_base, 100), client)
            return stats, got, shape_err.value, layer_err.value, after_bad, back
        finally:
            await sender.close()
            await client.close_weight_transfer()

    stats, (tokens, logprobs), shape_err, layer_err, after_bad, back = asyncio.run(go())
    assert stats.versions == [1] and stats.num_chunks > 5
    assert tokens == want_tokens
    for got_lp, ref_lp in zip(logprobs, want_lp, strict=True):
        assert got_lp == pytest.approx(ref_lp, abs=1e-4)
    assert "shape [3] but target has [64]" in str(shape_err)
    assert any("qkv_proj" in o and "k_proj" in o for o in layer_err.offenders)
    assert after_bad == tokens  # refused updates changed nothing
    assert back.versions == [2] and vllm_greedy(llm)[0] == before
    (state,) = llm.collective_rpc("weightsync_state")
    assert state["version"] == 2 and state["state"] == "idle" and not state["has_receiver"]


def test_front_door_pushes_a_transformers_model_into_an_in_process_llm(lm):
    """``ws.connect(llm)``: the in-process engine is reached through its worker extension, the
    extractor follows the model (a plain HF causal LM: ``hf``, tied embedding sent once)."""
    from transformers import AutoModelForCausalLM

    import weightsync as ws

    llm, base, new = lm
    want_tokens, _ = hf_greedy(new)
    model = AutoModelForCausalLM.from_pretrained(new)

    async def go():
        async with ws.connect(llm, "packed_cuda_ipc") as sync:
            v0 = (await sync.status())[0]["version"]
            before = llm.collective_rpc("weightsync_state_digest")[0]
            stats = await sync.push(model, version=v0 + 1)
            tokens = vllm_greedy(llm)[0]
            pushed = llm.collective_rpc("weightsync_state_digest")[0]
            back = await sync.push(state_dict(base), version=v0 + 2)
            return v0, stats, tokens, back, (before, pushed)

    v0, stats, tokens, back, (before, pushed) = asyncio.run(go())
    assert stats.versions == [v0 + 1] and stats.engines == ["vLLM engine 0"]
    assert tokens == want_tokens
    assert back.versions == [v0 + 2] and vllm_greedy(llm)[0] == hf_greedy(base)[0]
    # the worker's digest of what it serves moved with the push and came back bit for bit (on
    # CPU the linear layers' weights live packed for oneDNN, outside the state dict: the
    # embedding shows it; the tiny models' norms are all ones in both)
    after = llm.collective_rpc("weightsync_state_digest")[0]
    assert set(before) == set(pushed) == set(after)
    assert before["model.embed_tokens.weight"] != pushed["model.embed_tokens.weight"]
    assert after == before


def test_reference_worker_methods_receive_a_trainer_batch(lm):
    """The Ludic worker extension's methods, driven as the reference server drives them
    (``collective_rpc("init_communicator" | "update_param_batch" | "close_communicator")``)
    while a trainer thread joins the group as its last rank and broadcasts every tensor."""
    import threading

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    from weightsync.testing.servers import free_port

    llm, base, new = lm
    sd_new, sd_base = state_dict(new), state_dict(base)
    (v0,) = llm.collective_rpc("weightsync_version")
    port = free_port()
    trainer: dict = {}

    def join() -> None:
        trainer["pg"] = stateless_init_torch_distributed_process_group(
            "127.0.0.1", port, 1, 2, backend="gloo")

    def broadcast(sd) -> None:
        for name in sorted(sd):
            trainer["pg"].broadcast(sd[name].contiguous(), root=1).wait()
        trainer["pg"].barrier().wait()

    def batch(sd):
        return [(n, str(sd[n].dtype), tuple(sd[n].shape)) for n in sorted(sd)]

    t = threading.Thread(target=join)
    t.start()
    llm.collective_rpc("init_communicator", args=("127.0.0.1", port, 2))
    t.join(60)
    try:
        t = threading.Thread(target=broadcast, args=(sd_new,))
        t.start()
        llm.collective_rpc("update_param_batch", args=(batch(sd_new),))
        t.join(60)
        assert vllm_greedy(llm)[0] == hf_greedy(new)[0]
        assert llm.collective_rpc("weightsync_version") == [v0 + 1]  # counts on

        wrong = dict(sd_base)
        wrong["model.norm.weight"] = torch.zeros(3)  # refused before any byte is loaded
        t = threading.Thread(target=broadcast, args=(wrong,))
        t.start()
        with pytest.raises(Exception, match="model.norm.weight"):
            llm.collective_rpc("update_param_batch", args=(batch(wrong),))
        t.join(60)  # the refused batch was still drained: the trainer is not left hanging
        assert not t.is_alive()
        assert vllm_greedy(llm)[0] == hf_greedy(new)[0]
        assert llm.collective_rpc("weightsync_version") == [v0 + 1]

        t = threading.Thread(target=broadcast, args=(sd_base,))
        t.start()
        llm.collective_rpc("update_param_batch", args=(batch(sd_base),))
        t.join(60)
        assert vllm_greedy(llm)[0] == hf_greedy(base)[0]
    finally:
        llm.collective_rpc("close_communicator")
        (state,) = llm.collective_rpc("weightsync_state")
        assert not state["has_receiver"]


def test_a_trainer_written_from_the_interface_design_syncs_the_engine(lm, tmp_path):
    """A trainer script using only what the interface design names: its strategy class, a
    design-style extractor (``async _extract_raw_weights`` -> dict, the flags set from a
    SkyRL-style config), ``create_sync_info`` / ``create_sender`` / ``send_chunks`` with that
    config, then one positional ``WeightChunk(names, tensors, dtypes, shapes)``. Afterwards vLLM
    (float32) generates what transformers generates with the trainer's weights."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.clients import FanOutClient

    llm, base, new = lm

    class FSDPWeightExtractorLike(ws.WeightExtractor):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self._group_by_module = True
            self._batch_by_threshold = hasattr(cfg.generator,
                                               "weight_transfer_threshold_cuda_ipc_GB")

        async def _extract_raw_weights(self, model, generator_dtype):
            return {n: p.detach().to(generator_dtype) for n, p in model.state_dict().items()
                    if n != "lm_head.weight" or not model.config.tie_word_embeddings}

    cfg = OmegaConf.create({"generator": {"weight_sync_backend": "gloo", "use_cuda_ipc": False,
                                          "weight_transfer_threshold_cuda_ipc_GB": 0.0001},
                            "trainer": {"placement": {"colocate_all": False}}})
    model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
    inference_client = FanOutClient([llm])

    async def go():
        transfer_strategy = (ws.CudaIpcTransferStrategy() if cfg.generator.use_cuda_ipc
                             else ws.BroadcastTransferStrategy())
        sync_info = await transfer_strategy.create_sync_info(cfg, inference_client)
        sender = await transfer_strategy.create_sender(cfg, inference_client, sync_info)
        try:
            extractor = FSDPWeightExtractorLike(cfg)
            await sender.send_chunks(extractor.extract_weights(model, torch.float32),
                                     inference_client)
            after_full = vllm_greedy(llm)[0]
            norm = model.model.norm.weight
            with torch.no_grad():  # a new final norm (a scale alone keeps every argmax)
                norm.copy_(torch.randn(norm.shape, generator=torch.Generator().manual_seed(9)))
            await sender.send_chunks([ws.WeightChunk(["model.norm.weight"], [norm.detach()],
                                                     [torch.float32], [tuple(norm.shape)])],
                                     inference_client)
            return after_full, vllm_greedy(llm)[0]
        finally:
            await sender.close()
            await inference_client.close_weight_transfer()

    after_full, after_norm = asyncio.run(go())
    assert after_full == hf_greedy(new)[0]
    import pathlib
    import shutil

    scaled = tmp_path / "scaled"  # what the trainer holds now, for transformers to run
    model.save_pretrained(scaled)
    for f in pathlib.Path(base).glob("*token*"):
        shutil.copy(f, scaled / f.name)
    assert after_norm == hf_greedy(str(scaled))[0] != after_full

    async def restore():  # the engine back to the base weights for the module's other tests
        async with ws.connect([llm], "broadcast") as sync:
            v = (await sync.status())[0]["version"]
            await sync.push(state_dict(base), version=v + 1)

    asyncio.run(restore())
    assert vllm_greedy(llm)[0] == hf_greedy(base)[0]


def test_a_trainer_extractor_of_the_design_alone_syncs_vllm_through_connect(lm):
    """A SkyRL-style trainer whose extractor defines only the design's ``async
    _extract_raw_weights`` (no ``metadata``), given to ``ws.connect``: one push extracts once,
    the engine checks the manifest read from that dict, and vLLM (float32) then generates what
    transformers generates with the trainer's weights."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    import weightsync as ws

    llm, base, new = lm

    class SkyRLExtractor(ws.WeightExtractor):
        calls = 0

        async def _extract_raw_weights(self, model, generator_dtype):
            self.calls += 1
            return {n: p.detach().to(generator_dtype) for n, p in model.state_dict().items()
                    if n != "lm_head.weight" or not model.config.tie_word_embeddings}

    cfg = OmegaConf.create({"generator": {"weight_sync_backend": "gloo"},
                            "trainer": {"placement": {"colocate_all": False}}})
    model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
    ext = SkyRLExtractor(cfg)

    async def push(weights, extractor=None):
        async with ws.connect([llm], "broadcast", extractor=extractor) as sync:
            v = (await sync.status())[0]["version"]
            return await sync.push(weights, version=v + 1, dtype="float32")

    stats = asyncio.run(push(model, ext))
    assert ext.calls == 1 and stats.num_tensors == len(
        [n for n in state_dict(new) if n != "lm_head.weight" or not model.config.tie_word_embeddings])
    assert vllm_greedy(llm)[0] == hf_greedy(new)[0] != hf_greedy(base)[0]
    asyncio.run(push(state_dict(base)))  # the base weights back for the module's other tests
    assert vllm_greedy(llm)[0] == hf_greedy(base)[0]


# a prompt that fills whole KV blocks (so its prefix is cached) in the tiny tokenizer
LONG_PROMPT = "weights move from the trainer into the engine and back again " * 8  # 193 tokens


def _greedy_long(llm):
    from vllm import SamplingParams

    (out,) = llm.generate([LONG_PROMPT], SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _hf_greedy_long(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_a_push_into_an_in_process_llm_is_sent_from_the_loop_and_drops_the_old_cache(
        lm, tmp_path, trace_timeline):
    """Into a blocking ``LLM`` the driver sends the update's one call from the event loop's
    thread (no thread hop) and the prefix-cache reset right behind it: a prompt whose prefix
    was cached on the old weights is computed again on the new ones (no cached token, and
    transformers' greedy tokens with the new weights)."""
    import weightsync as ws
    from weightsync._runtime import trace

    llm, base, new = lm
    _greedy_long(llm)
    _, cached = _greedy_long(llm)
    assert cached > 0  # the prompt's prefix is in the cache (else the check below is vacuous)
    trace.flush()
    trace.configure(tmp_path)
    try:
        async def go():
            async with ws.connect(llm, {"type": "broadcast", "backend": "gloo"}) as sync:
                v0 = (await sync.status())[0]["version"]
                return v0, await sync.push(state_dict(new), version=v0 + 1)

        v0, stats = asyncio.run(go())
    finally:
        trace.configure(None)
        trace.flush()
    tokens, cached = _greedy_long(llm)
    assert stats.versions == [v0 + 1]
    assert cached == 0 and tokens == _hf_greedy_long(new)
    events = trace_timeline.read_events(str(tmp_path))
    mine = [e for e in events if e["label"].startswith("rpc.")]
    labels = [e["label"] for e in mine]
    assert "rpc.thread.begin" not in labels  # the call did not wait for a thread
    posts = [e for e in mine if e["label"] == "rpc.post"]
    assert [e["fields"]["method"] for e in posts] == ["apply_update"]
    assert posts[0]["thread"] == "MainThread"
    assert labels.index("rpc.post") < labels.index("rpc.answered") < labels.index("rpc.reset.end")
    asyncio.run(_push_back(llm, base))  # the module's engine serves the base weights again
    assert vllm_greedy(llm)[0] == hf_greedy(base)[0]


async def _push_back(llm, base):
    import weightsync as ws

    async with ws.connect(llm, {"type": "broadcast", "backend": "gloo"}) as sync:
        v = (await sync.status())[0]["version"]
        await sync.push(state_dict(base), version=v + 1)


def test_a_push_waiting_on_an_engine_core_that_dies_fails_naming_it(tmp_path):
    """The real fault: the ``LLM``'s engine-core process stops (SIGSTOP) while a push's call is
    on its way to it, then is killed (SIGKILL). The push fails within seconds with
    ``EngineDiedError`` naming the engine. (vLLM's blocking client never answers a call whose
    engine core died after it was sent: a caller blocked in a thread on it waits forever.)"""
    import os
    import signal
    import time

    from vllm import LLM

    import weightsync as ws
    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.errors import EngineDiedError
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    base = build_tiny_causal_lm(tmp_path / "base", seed=0)
    new = build_tiny_causal_lm(tmp_path / "new", seed=5)
    llm = LLM(model=base, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, worker_extension_cls=EXT, seed=0)
    core = llm.llm_engine.engine_core.resources.engine_manager.processes[0]

    async def go():
        async with ws.connect(llm, {"type": "broadcast", "backend": "gloo",
                                    "timeout_s": 120}) as sync:
            first = await sync.push(state_dict(new), version=1)
            os.kill(core.pid, signal.SIGSTOP)
            push = asyncio.ensure_future(sync.push(state_dict(base), version=2))
            await asyncio.sleep(1.0)
            waiting = not push.done()  # the call went out; the stopped core does not read it
            os.kill(core.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDiedError) as err:
                await push
            return first, waiting, time.monotonic() - t0, err.value

    try:
        first, waiting, seconds, err = asyncio.run(go())
    finally:
        shutdown_llm(llm)
    assert first.versions == [1] and waiting
    assert "vLLM engine 0" in str(err) and "died" in str(err), str(err)
    assert seconds < 15, seconds
