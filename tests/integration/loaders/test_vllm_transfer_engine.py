"""weightsync as a backend of vLLM's own weight-transfer API, on a real vLLM CPU engine.

The engine is an offline ``LLM`` started the way vLLM's RL examples start one, with
``weight_transfer_config={"backend": "weightsync"}`` (no worker extension: weightsync's vLLM
plugin registered the backend in the engine's processes). The trainer side is vLLM's own:
``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=ModuleSource(model))``
then ``send_weights()``, which drives the ``LLM``'s ``init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``; the bytes move over a
gloo broadcast. After each update vLLM generates what transformers generates with the trainer's
weights (float32: same tokens, logprobs within 1e-4); a bad update is refused before any byte
moves with weightsync's typed error and the engine keeps serving the last weights."""

from __future__ import annotations

import pytest
import torch
from _greedy import PROMPTS, hf_greedy, vllm_greedy

from weightsync.errors import DeltaBaseMismatchError, WeightMismatchError

pytestmark = pytest.mark.slow

STRATEGY = {"type": "broadcast", "backend": "gloo", "timeout_s": 60}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("native")
    base = build_tiny_causal_lm(root / "base", seed=0)
    new = build_tiny_causal_lm(root / "new", seed=5)
    llm = LLM(model=base, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, seed=0, weight_transfer_config={"backend": "weightsync"})
    try:
        yield llm, base, new
    finally:
        shutdown_llm(llm)


def _matches(llm, model, tok) -> None:
    tokens, logprobs = vllm_greedy(llm)
    want_tokens, want_lp = hf_greedy(model, tok)
    assert tokens == want_tokens
    for got, ref in zip(logprobs, want_lp, strict=True):
        assert got == pytest.approx(ref, abs=1e-4)


def test_vllm_native_api_moves_weights_over_weightsync(lm):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weightsync.vllm_backend import LLMWeightSyncClient, WeightSyncTrainerInitInfo

    llm, base, new = lm
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(new).eval()
    assert vllm_greedy(llm)[0] != hf_greedy(model, tok)[0]

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(strategy=STRATEGY, world_size=2, delta=True, rank=0),
        client=LLMWeightSyncClient(llm), source=ModuleSource(model))
    try:
        stats = engine.send_weights()
        assert stats.versions == [1] and stats.delta["base_version"] is None
        assert llm.get_weight_version() == "1"
        _matches(llm, model, tok)

        with torch.no_grad():  # a trainer step: a few weights move
            model.model.norm.weight.add_(0.25)
            model.lm_head.weight[:4].mul_(1.5)
        small = engine.send_weights()
        assert small.delta["base_version"] == 1 and small.versions == [2]
        assert small.total_bytes < stats.total_bytes / 10  # two tensors changed, sparsely
        _matches(llm, model, tok)

        # a source whose shape the engine does not serve: refused before any byte moves,
        # with weightsync's typed error, and the engine serves version 2 unchanged
        before = vllm_greedy(llm)
        bad = engine.source
        engine.source = [*bad, ("model.norm.weight", torch.zeros(3))]
        with pytest.raises(WeightMismatchError, match="model.norm.weight"):
            engine.send_weights()
        engine.source = bad
        assert vllm_greedy(llm) == before and llm.get_weight_version() == "2"

        with torch.no_grad():
            model.model.norm.weight.sub_(0.25)
        again = engine.send_weights(version=engine.version + 1)
        assert again.versions == [4] and not again.delta["fallback"]
        _matches(llm, model, tok)
    finally:
        engine.shutdown()


def test_vllms_finish_closes_an_update_the_trainer_left_open(lm):
    """vLLM's own ``finish_weight_update`` after a start without weightsync's finish: the
    update is closed as aborted and vLLM's update state is reset (the next update works)."""
    import weightsync as ws
    from weightsync.types import TensorMeta

    llm, base, _ = lm
    before = vllm_greedy(llm)
    start = ws.WeightUpdateStart(update_id="left-open", version=None,
                                 manifest=[TensorMeta("model.norm.weight", "float32", [64])])
    llm.start_weight_update()
    llm.update_weights({"update_info": {"method": "start_weight_update",
                                        "kwargs": {"start": start.to_dict()}}})
    llm.finish_weight_update()
    assert vllm_greedy(llm) == before  # nothing landed; the engine serves what it served
    llm.start_weight_update()  # vLLM's state was reset: a new update may start
    with pytest.raises(Exception, match=DeltaBaseMismatchError.__name__):
        llm.update_weights({"update_info": {"method": "start_weight_update", "kwargs": {
            "start": {**start.to_dict(), "update_id": "d", "manifest": [
                {"name": "model.norm.weight#delta.pos", "dtype": "int16", "shape": [1]},
                {"name": "model.norm.weight#delta.val", "dtype": "int8", "shape": [1]}],
                "delta": {"base_version": 99, "targets": [
                    ["model.norm.weight", "float32", [64], "gaps+bitdiff", 1, 0, None]]}}}}})


def test_vllm_servers_own_http_routes_move_weights_over_weightsync(lm, tmp_path):
    """vLLM's OpenAI server in dev mode (``--weight-transfer-config '{"backend":
    "weightsync"}'``), driven through vLLM's ``HTTPVLLMWeightSyncClient`` (its routes
    ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
    ``/finish_weight_update``); completions then equal transformers'; a refusal comes back as
    weightsync's typed error out of the route's JSON answer."""
    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from weightsync.testing.servers import ServerProcess
    from weightsync.vllm_backend import WeightSyncTrainerInitInfo

    _, base, new = lm
    server = ServerProcess(
        base, module="vllm.entrypoints.openai.api_server", scratch_dir=str(tmp_path),
        env={"VLLM_SERVER_DEV_MODE": "1"},
        extra_args=["--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
                    "--kv-cache-memory-bytes", str(64 << 20),
                    "--weight-transfer-config", '{"backend": "weightsync"}'])
    server.start_healthy()
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(new).eval()
    engine = None
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(strategy=STRATEGY, world_size=2, rank=0),
            client=HTTPVLLMWeightSyncClient(server.url), source=ModuleSource(model))
        stats = engine.send_weights()
        assert stats.versions == [1]
        assert requests.get(f"{server.url}/weight_info", timeout=10).json() == {
            "weight_version": "1"}
        answers = [requests.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": base, "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True}).json() for p in PROMPTS]
        tokens = [[int(t.removeprefix("token_id:")) for t in a["choices"][0]["logprobs"]["tokens"]]
                  for a in answers]
        assert tokens == hf_greedy(model, tok)[0]

        engine.source = [*ModuleSource(model), ("model.norm.weight", torch.zeros(3))]
        with pytest.raises(WeightMismatchError, match="model.norm.weight"):
            engine.send_weights()
    finally:
        if engine is not None:
            engine.shutdown()
        server.stop()
