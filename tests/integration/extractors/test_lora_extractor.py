"""``lora_merge`` extractor on real PEFT models (Qwen2 / Llama sequence classification).

Checked: merged weights equal PEFT's own ``merge_and_unload`` bit-for-bit under engine names
(no ``lora_A``/``lora_B``, the trained ``modules_to_save`` head as ``score.weight``); the default
mode changes nothing (training with syncs in between is bit-identical to training without);
``merge_and_reinit`` folds the adapters into the base, zeroes them, keeps the model's function,
keeps the adapter Parameter objects, and the optimizer helper drops their stale state; a full
sync into a real engine process lands the merged weights bit-exact; DoRA is refused clearly.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from weightsync import build_extractor
from weightsync.extractors.lora import reset_adapter_optimizer_state
from weightsync.naming import is_lora_param


def _peft_model(family: str = "qwen2", *, seed: int = 0, **lora_kw):
    import peft
    import transformers

    cfg_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[family]
    cls = {"qwen2": transformers.Qwen2ForSequenceClassification,
           "llama": transformers.LlamaForSequenceClassification}[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                        num_labels=1, pad_token_id=0))
    lcfg = dict(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear")
    lcfg.update(lora_kw)
    return peft.get_peft_model(model, peft.LoraConfig(**lcfg))


def _train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1, 128, (4, 10), generator=g)
        target = torch.randn(4, 1, generator=g)
        loss = ((model(input_ids=ids).logits - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _extract(ext, model, dtype=None) -> dict[str, torch.Tensor]:
    async def run():
        return {n: t for c in [c async for c in ext.extract_weights(model, dtype)]
                for n, t in zip(c.names, c.tensors, strict=True)}

    return asyncio.run(run())


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_merged_weights_equal_peft_merge_and_nothing_changes(family: str) -> None:
    model = _peft_model(family)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _train(model, opt, 3, seed=1)
    before = _snapshot(model)

    ext = build_extractor({"type": "lora_merge", "bucket_size_mb": 0.01})
    sent = _extract(ext, model)
    metas = ext.metadata(model)

    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(sent) == set(want), (set(sent) ^ set(want))
    assert not any(is_lora_param(n) or "base_layer" in n or "modules_to_save" in n for n in sent)
    for n in want:
        assert torch.equal(sent[n], want[n]), n
    assert [m.name for m in metas] == list(sent)
    assert torch.equal(sent["score.weight"],
                       model.base_model.model.score.modules_to_save["default"].weight)
    # the merged weights really differ from the base ones (training moved the adapters)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    after = _snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "extraction changed the model"


def test_training_with_syncs_is_bit_identical_to_training_without() -> None:
    ext = build_extractor({"type": "lora_merge"})
    runs = []
    for sync in (False, True):
        model = _peft_model(seed=3)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in range(3):
            _train(model, opt, 2, seed=10 + step)
            if sync:
                _extract(ext, model, torch.bfloat16)
        runs.append(_snapshot(model))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_merge_and_reinit_cycle_and_optimizer_helper() -> None:
    model = _peft_model(seed=4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    _train(model, opt, 3, seed=2)
    ids = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out_before = model(input_ids=ids).logits
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    adapter_ids = {id(p) for n, p in model.named_parameters() if is_lora_param(n)}

    ext = build_extractor({"type": "lora_merge", "merge_and_reinit": True})
    metas = ext.metadata(model)  # side-effect free
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters()
               if "lora_B" in n)
    sent = _extract(ext, model)
    assert [m.name for m in metas] == list(sent)
    for n in want:  # PEFT's safe merge and merge_and_unload: same arithmetic
        torch.testing.assert_close(sent[n], want[n], rtol=0, atol=1e-6)
    # the model now holds the merged base and fresh adapters: same function, B == 0
    for n, p in model.named_parameters():
        if "lora_B" in n:
            assert torch.count_nonzero(p) == 0, n
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, out_before, rtol=0, atol=1e-5)
    # same Parameter objects; their optimizer state is stale until reset
    reinit = ext.last_reinit_params
    assert reinit and {id(p) for p in reinit} == adapter_ids
    assert all(p in opt.state for p in reinit)
    assert reset_adapter_optimizer_state(opt, reinit) == len(reinit)
    assert not any(p in opt.state for p in reinit)
    assert model.base_model.model.score.modules_to_save["default"].weight in opt.state
    # the cycle goes on: train the fresh adapters, sync again (plain merged copy this time)
    _train(model, opt, 2, seed=5)
    again = _extract(build_extractor({"type": "lora_merge"}), model)
    want2 = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.equal(again[n], want2[n]) for n in want2)
    assert not torch.equal(again["model.layers.0.mlp.up_proj.weight"],
                           sent["model.layers.0.mlp.up_proj.weight"])


def test_only_trained_modules_sends_lora_targets_and_head() -> None:
    model = _peft_model(target_modules=["q_proj", "v_proj"])
    sent = _extract(build_extractor({"type": "lora_merge", "only_trained_modules": True}), model)
    assert sorted(sent) == sorted(
        [f"model.layers.{i}.self_attn.{m}.{k}" for i in range(2) for m in ("q_proj", "v_proj")
         for k in ("weight", "bias")] + ["score.weight"]
    )


def test_dora_is_refused_before_anything_changes() -> None:
    model = _peft_model(use_dora=True, target_modules=["q_proj"])
    before = _snapshot(model)
    for cfg in ({"type": "lora_merge"}, {"type": "lora_merge", "merge_and_reinit": True}):
        with pytest.raises(NotImplementedError, match="variant"):
            _extract(build_extractor(cfg), model)
    after = _snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow
def test_lora_sync_into_engine_process_is_bit_exact() -> None:
    """Merged weights through the real broadcast (gloo) strategy into a real engine process."""
    from weightsync import build_strategy
    from weightsync.clients import FanOutClient
    from weightsync.digest import tensor_digest
    from weightsync.local import LocalEngineProcess

    model = _peft_model(seed=6)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _train(model, opt, 2, seed=6)
    ext = build_extractor({"type": "lora_merge", "bucket_size_mb": 0.05})
    metas = ext.metadata(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()

    async def run():
        engine = LocalEngineProcess.spawn(
            "weightsync.local.modules:metas_module",
            {"metas": [m.to_dict() for m in metas], "fill": "zeros"}, name="lora-engine",
            num_threads=1,
        )
        sender = None
        try:
            client = FanOutClient([engine], timeout_s=60)
            strategy = build_strategy({"type": "broadcast", "backend": "gloo", "timeout_s": 60})
            info = await strategy.create_sync_info(strategy.cfg, client)
            sender = await strategy.create_sender(strategy.cfg, client, info)
            stats = await sender.send_chunks(ext.extract_weights(model), client, version=1,
                                             manifest=metas)
            return stats, await engine.call("state_digest")
        finally:
            if sender is not None:
                await sender.close()
            engine.stop()

    stats, digests = asyncio.run(run())
    assert stats.versions == [1] and stats.num_chunks > 1
    assert {n: d["digest"] for n, d in digests.items()} == {
        n: tensor_digest(t) for n, t in want.items()
    }
