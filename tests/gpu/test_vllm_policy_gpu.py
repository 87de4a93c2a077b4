"""A generative vLLM 0.26 engine on the GPU fed by ``cuda_ipc`` and ``packed_cuda_ipc`` from this
process on the same GPU (trainer and engine colocated), eager and with CUDA graphs.

The engine starts on the base weights; each sync pushes the other model; afterwards the prompt
logprobs vLLM serves equal transformers' (bf16) for the pushed model and differ from the
previous ones. With CUDA graphs (``enforce_eager=False``) the graphs were captured on the base
weights, so matching the new model shows that the captured graphs compute with the weights
``load_weights`` copied in."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]

from _vllm_helpers import (  # noqa: E402
    EXT,
    close,
    cuda_state,
    hf_prompt_logprobs,
    prompt_ids,
    sync,
    vllm_prompt_logprobs,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("gpu-lm")
    return build_tiny_causal_lm(root / "base", seed=0), build_tiny_causal_lm(root / "new", seed=5)


@pytest.fixture(scope="module", params=["eager", "cuda_graphs"])
def engine(request, models):
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is live in this process
    from vllm import LLM

    from weightsync._runtime.vllm_compat import shutdown_llm

    base, _ = models
    llm = LLM(model=base, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.2,
              enforce_eager=request.param == "eager", worker_extension_cls=EXT, seed=0)
    try:
        yield llm, request.param
    finally:
        shutdown_llm(llm)


@pytest.mark.parametrize("strategy", ["cuda_ipc", "packed_cuda_ipc"])
def test_colocated_ipc_into_generative_engine(engine, models, strategy):
    llm, mode = engine
    base, new = models
    ids = prompt_ids(base)
    (state,) = llm.collective_rpc("weightsync_state")
    assert state["load_mode"] == "direct"
    # alternate: whichever model the engine does not hold now is pushed
    target, other = (new, base) if state["version"] % 2 == 0 else (base, new)
    before = vllm_prompt_logprobs(llm, ids)
    assert close(before, hf_prompt_logprobs(other, ids)), mode
    stats = sync(llm, cuda_state(target), {"type": strategy})
    after = vllm_prompt_logprobs(llm, ids)
    assert stats.versions == [state["version"] + 1]
    assert close(after, hf_prompt_logprobs(target, ids)), (mode, after)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 0.5
