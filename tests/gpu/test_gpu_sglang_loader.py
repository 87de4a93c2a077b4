"""``sglang`` loader against a real SGLang engine (marked ``gpu``; skipped where SGLang is not
importable or there is no GPU).

A tiny Llama (head size 64, bf16) served by ``sglang.Engine`` (its worker on the last GPU; the
trainer's end of the NCCL group below on GPU 0: NCCL refuses two ranks on one device):

1. through our strategies: a trainer pushes new weights with ``ws.connect`` (gloo ``broadcast``
   of CPU tensors) into a ``WeightUpdateEndpoint`` whose loader is the ``SGLangWeightLoader``;
   SGLang loads each chunk with ``update_weights_from_tensor``. Checked with SGLang's own
   ``get_weights_by_name``: the engine holds the pushed weights, and its greedy output changed;
2. through SGLang's own data plane: this process is rank 0 of an NCCL group that SGLang's
   worker joins (``join_update_group`` -> ``init_weights_update_group``) and broadcasts each
   tensor of a request while the loader asks SGLang to receive it
   (``receive_broadcast`` -> ``update_weights_from_distributed``).
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta

import pytest

pytestmark = pytest.mark.gpu

sglang = pytest.importorskip("sglang", reason="needs sglang (a GPU build)")


def _engine(model_dir: str):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # triton attention and torch sampling: the staged kernel package leaves FlashAttention-3 out
    # (scripts/stage_extras_gpu.sh), and neither choice changes what a weight update does
    return sglang.Engine(model_path=model_dir, dtype="bfloat16", mem_fraction_static=0.3,
                         disable_cuda_graph=True, random_seed=0, log_level="error",
                         attention_backend="triton", sampling_backend="pytorch",
                         base_gpu_id=torch.cuda.device_count() - 1)


def _norm(engine) -> list[float]:
    return [float(x) for x in engine.get_weights_by_name("model.norm.weight", truncate_size=100)]


def _greedy(engine) -> str:
    out = engine.generate("The model is", {"max_new_tokens": 8, "temperature": 0})
    return out["text"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    model_dir = build_tiny_causal_lm(tmp_path_factory.mktemp("sglang") / "model", family="llama",
                                     hidden_size=128, num_heads=2, num_kv_heads=1, seed=0)
    engine = _engine(model_dir)
    try:
        yield model_dir, engine
    finally:
        engine.shutdown()


def _trained(model_dir: str, seed: int):
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g)
            for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}


def test_push_through_our_strategy_lands_in_sglang(served) -> None:
    import torch

    import weightsync as ws
    from weightsync.loaders.sglang import SGLangWeightLoader

    model_dir, engine = served
    before = _greedy(engine)
    trained = _trained(model_dir, seed=1)
    loader = SGLangWeightLoader(engine=engine)
    assert loader.expected_metadata() is not None  # the checkpoint's names and shapes
    ep = ws.WeightUpdateEndpoint(loader, name="sglang")

    async def push():
        async with ws.connect([ep], {"type": "broadcast", "backend": "gloo",
                                     "bucket_size_mb": 0.25}) as sync:
            return await sync.push(trained, version=1)

    stats = asyncio.run(push())
    loader.close()
    assert stats.versions == [1] and stats.num_chunks >= 2
    want = trained["model.norm.weight"].to(torch.bfloat16).float()[:100]
    assert torch.equal(torch.tensor(_norm(engine)), want)
    assert _greedy(engine) != before


def test_sglang_data_plane_receives_the_broadcasts(served) -> None:
    import torch
    import torch.distributed as dist
    from sglang.srt.utils import init_custom_process_group

    from weightsync.loaders.sglang import SGLangWeightLoader
    from weightsync.strategies.broadcast import (
        BroadcastWeightUpdateRequest,
        TorchDistributedWeightSyncInfo,
    )
    from weightsync.testing.servers import free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the trainer's rank and SGLang's worker on different devices)")
    model_dir, engine = served
    trained = _trained(model_dir, seed=2)
    names = ["model.norm.weight", "model.embed_tokens.weight"]
    tensors = [trained[n].to(torch.bfloat16).to("cuda:0") for n in names]
    info = TorchDistributedWeightSyncInfo(master_addr="127.0.0.1", master_port=free_port(),
                                          world_size=2, group_name="ws-test", backend="nccl")
    loader = SGLangWeightLoader(engine=engine)

    async def run():
        joining = asyncio.ensure_future(loader.join_update_group(info, rank_offset=1))
        # the trainer's end, as SGLang's own tests make it
        group = await asyncio.to_thread(
            init_custom_process_group, backend="nccl",
            init_method=f"tcp://127.0.0.1:{info.master_port}", world_size=2, rank=0,
            group_name=info.group_name, timeout=timedelta(seconds=120))
        await joining
        req = BroadcastWeightUpdateRequest(names=names, dtypes=["bfloat16"] * 2,
                                           shapes=[list(t.shape) for t in tensors], packed=False)
        receiving = asyncio.ensure_future(loader.receive_broadcast(req))

        def send() -> None:
            torch.cuda.set_device(0)
            for t in tensors:
                dist.broadcast(t, src=0, group=group)
            torch.cuda.synchronize()

        await asyncio.to_thread(send)
        await receiving
        await loader.leave_update_group()
        dist.destroy_process_group(group)

    try:
        asyncio.run(run())
    finally:
        loader.close()
    assert torch.equal(torch.tensor(_norm(engine)), tensors[0].float().cpu()[:100])
