"""``RewardModelPublisher`` on an FSDP2-sharded reward model, 2 real gloo ranks, real engines.

Every rank builds the same publishers and calls ``publish``; rank 0 sends (``comm`` =
broadcast/gloo into ``LocalEngineProcess``es), rank 1 only joins the gathers. Checked:
1. an engine that refuses the manifest (it lacks a parameter) makes rank 0 raise
   ``WeightMismatchError`` while rank 1 returns normally: rank 0 still ran its part of the
   gathers, so the ranks stay in lockstep;
2. right after, a FULL publish to a good engine lands the unsharded model bit-exact;
3. a HEAD_ONLY publish gathers and sends only the head.
"""

from __future__ import annotations

import json

import pytest
from _sharded_sync import spawn_gloo_ranks

pytestmark = pytest.mark.slow


def _model():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                   num_labels=1, pad_token_id=0)
    return transformers.Qwen2ForSequenceClassification(cfg)



async def _rank_async(rank: int, world: int, out_path: str) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.clients import FanOutClient
    from weightsync.digest import tensor_digest
    from weightsync.errors import WeightMismatchError
    from weightsync.local import LocalEngineProcess
    from weightsync.reward.publisher import RewardModelPublisher

    model = _model()
    names = list(model.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    engines, clients = [None, None], [None, None]
    if rank == 0:
        full_metas = [{"name": n, "dtype": "float32", "shape": list(t.shape)}
                      for n, t in _model().state_dict().items()]
        for i, metas in enumerate((full_metas, [m for m in full_metas if m["name"] != "model.norm.weight"])):
            engines[i] = LocalEngineProcess.spawn(
                "weightsync.local.modules:metas_module", {"metas": metas, "fill": "zeros"},
                name=f"engine-{'good' if i == 0 else 'bad'}", num_threads=1)
            clients[i] = FanOutClient([engines[i]], timeout_s=60)
    comm = {"type": "broadcast", "backend": "gloo", "timeout_s": 60}
    good = RewardModelPublisher(clients[0], comm, src_rank=0, bucket_size_mb=0.05, timeout_s=60)
    bad = RewardModelPublisher(clients[1], comm, src_rank=0, bucket_size_mb=0.05, timeout_s=60)
    report: dict = {}
    try:
        try:
            out = await bad.publish_async(model, training_mode="full", version=1)
            report["bad"] = "returned" if out is None else "sent"
        except WeightMismatchError as e:
            report["bad"] = f"refused: {e}"
        # rank 0's extraction never started (refused at start): it ran the gathers via drain()
        report["bad_runs_started"] = bad.last_extractor.runs_started
        sentinel = torch.tensor([float(rank + 1)])
        torch.distributed.all_reduce(sentinel)  # misaligned collectives would fail or hang here
        report["sentinel"] = float(sentinel)

        stats = await good.publish_async(model, training_mode="full", version=1)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            digests = await engines[0].call("state_digest")
            report["full_ok"] = all(digests[n]["digest"] == tensor_digest(full[n]) for n in names)
            report["full_versions"] = stats.versions

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids).logits.sum().backward()
        opt.step()
        stats = await good.publish_async(model, training_mode="head_only", version=2)
        head_metas = good.last_extractor.metadata(model)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        report["head_planned"] = [m.name for m in head_metas]
        if rank == 0:
            digests = await engines[0].call("state_digest")
            report["head_tensors"] = stats.num_tensors
            report["head_ok"] = digests["score.weight"]["digest"] == tensor_digest(full["score.weight"])
            report["backbone_stale"] = digests["model.norm.weight"]["digest"] != tensor_digest(
                full["model.norm.weight"])
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(report, f)
    finally:
        await good.close()
        await bad.close()
        for e in engines:
            if e is not None:
                e.stop()


def test_publisher_on_fsdp2_stays_in_lockstep_through_a_refusal(tmp_path) -> None:
    out = str(tmp_path / "report")
    spawn_gloo_ranks(_rank_async, out)
    r0 = json.loads((tmp_path / "report.0").read_text())
    r1 = json.loads((tmp_path / "report.1").read_text())
    assert r0["sentinel"] == r1["sentinel"] == 3.0
    assert r0["bad_runs_started"] == 0 and r1["bad_runs_started"] == 1
    assert r0["bad"].startswith("refused") and "model.norm.weight" in r0["bad"], r0["bad"]
    assert r1["bad"] == "returned"
    assert r0["full_ok"] and r0["full_versions"] == [1]
    assert r0["head_planned"] == r1["head_planned"] == ["score.weight"]
    assert r0["head_tensors"] == 1 and r0["head_ok"]
    assert r0["backbone_stale"]  # the backbone moved in training but was not sent (head_only)
