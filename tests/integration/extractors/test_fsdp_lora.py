"""FSDP2-sharded PEFT LoRA reward model, 2 real gloo ranks: the ``fsdp`` extractor gathers each
LoRA layer's base weight together with its adapters and sends the merged weight.

Checked on the sending rank against an independent path: the full state gathered by torch
(``get_model_state_dict``) loaded into an unsharded twin, merged by PEFT's ``merge_and_unload``;
bit-exact, engine names (no ``lora_A``/``base_layer``/``modules_to_save``), head as
``score.weight``, and through the publisher in LORA mode (HEAD_ONLY sends only the head).
"""

from __future__ import annotations

import json

import pytest
from _sharded_sync import spawn_gloo_ranks

pytestmark = pytest.mark.slow


def _peft_model():
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                   num_labels=1, pad_token_id=0)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    return peft.get_peft_model(model, peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear"))



async def _rank_async(rank: int, world: int, out_path: str) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import build_extractor
    from weightsync.digest import tensor_digest
    from weightsync.reward.publisher import RewardModelPublisher

    model = _peft_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(1, 128, (2, 8), generator=g)
        model(input_ids=ids).logits.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    ext = build_extractor({"type": "fsdp", "bucket_size_mb": 0.05})
    got = {}
    async for chunk in ext.extract_weights(model):
        got.update({n: tensor_digest(t) for n, t in zip(chunk.names, chunk.tensors, strict=True)})
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    # the publisher picks the same path for LORA and HEAD_ONLY (metadata only: nothing sent)
    pub = RewardModelPublisher(None, src_rank=0)
    lora_names = [m.name for m in pub.metadata(model, "lora")]
    head_names = [m.name for m in pub.metadata(model, "head_only")]
    try:
        pub.metadata(model, "full")
        full_mode = "accepted"
    except ValueError as e:
        full_mode = str(e)

    if rank == 0:
        twin = _peft_model()
        missing, unexpected = twin.load_state_dict(full, strict=False)
        assert not unexpected, unexpected
        want = {n: tensor_digest(t) for n, t in twin.merge_and_unload().state_dict().items()}
        with open(out_path, "w") as f:
            json.dump({"got": got, "want": want, "peak": ext.memory.peak_bytes,
                       "lora_names": lora_names, "head_names": head_names,
                       "full_mode": full_mode, "missing": missing}, f)
    else:
        assert got == {}


def test_fsdp2_peft_lora_merged_bit_exact(tmp_path) -> None:
    out = str(tmp_path / "report.json")
    spawn_gloo_ranks(_rank_async, out)
    with open(out) as f:
        r = json.load(f)
    assert r["missing"] == []
    assert sorted(r["got"]) == sorted(r["want"])
    assert not any("lora" in n or "base_layer" in n or "modules_to_save" in n for n in r["got"])
    bad = sorted(n for n in r["want"] if r["got"][n] != r["want"][n])
    assert bad == [], bad
    assert r["peak"] > 0
    assert sorted(r["lora_names"]) == sorted(r["want"])
    assert r["head_names"] == ["score.weight"]
    assert "has active LoRA adapters" in r["full_mode"]
