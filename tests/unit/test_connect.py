"""The front door (``weightsync.connect``): strategy resolution, the backend from the device,
the extractor from the model's kind, fan-out to two engines, the blocking twin, the context
manager, training modes, and a session that stays usable after a refused push.

Engines are real ``WeightUpdateEndpoint``s in this process (``torch_module`` loaders on real
modules) reached through ``EndpointChannel``; the transports are real (gloo broadcast between
threads of this process, shared memory for the IPC strategies).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import weightsync as ws
from weightsync.config import resolve_strategy
from weightsync.errors import WeightMismatchError
from weightsync.extractors.auto import extractor_config_for, model_kind
from weightsync.loaders.torch_module import TorchModuleWeightLoader


class RewardNet(torch.nn.Module):
    """A backbone and a ``score`` head, named like an HF reward model."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = torch.nn.Linear(8, 16)
        self.score = torch.nn.Linear(16, 1)


def _engines(n: int = 1, seed: int = 0) -> tuple[list[RewardNet], list[ws.WeightUpdateEndpoint]]:
    modules = [RewardNet(seed) for _ in range(n)]
    return modules, [ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=m), name=f"eng{i}")
                     for i, m in enumerate(modules)]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                 strict=True))


# -- strategy resolution ----------------------------------------------------------------------------


def test_strategy_from_name_mapping_config_path_and_preset(tmp_path):
    assert resolve_strategy("broadcast") == {"type": "broadcast"}
    assert resolve_strategy("packed_cuda_ipc") == {"type": "packed_cuda_ipc"}
    m = {"type": "broadcast", "backend": "gloo", "bucket_size_mb": 8}
    assert resolve_strategy(m) == m and resolve_strategy(m) is not m
    cfg = resolve_strategy(ws.BroadcastConfig(backend="gloo", bucket_size_mb=4))
    assert (cfg["type"], cfg["backend"], cfg["bucket_size_mb"]) == ("broadcast", "gloo", 4)
    preset = resolve_strategy("broadcast_gloo")
    assert (preset["type"], preset["backend"]) == ("broadcast", "gloo")
    assert resolve_strategy(ws.load_config("cuda_ipc"))["type"] == "cuda_ipc"
    bare = tmp_path / "mine.yaml"
    bare.write_text("type: packed_cuda_ipc\nbucket_size_mb: 2\n")
    assert resolve_strategy(str(bare)) == {"type": "packed_cuda_ipc", "bucket_size_mb": 2}
    whole = tmp_path / "preset.yaml"
    whole.write_text("strategy:\n  type: broadcast\n  backend: gloo\nextractor:\n  type: hf\n")
    assert resolve_strategy(whole) == {"type": "broadcast", "backend": "gloo"}
    assert resolve_strategy(ws.build_strategy({"type": "cuda_ipc"}))["type"] == "cuda_ipc"
    with pytest.raises(ValueError, match=r"'pigeon': not a registered strategy \(broadcast.*preset"):
        resolve_strategy("pigeon")
    with pytest.raises(TypeError, match="strategy: expected a name"):
        resolve_strategy(3.5)


def test_extractor_given_by_name_preset_or_mapping():
    from weightsync.config import resolve_extractor

    assert resolve_extractor(None) is None
    assert resolve_extractor("lora_merge") == {"type": "lora_merge"}
    assert resolve_extractor("extractor_fsdp")["type"] == "fsdp"
    assert resolve_extractor({"extractor": {"type": "hf", "bucket_size_mb": 2}}) == {
        "type": "hf", "bucket_size_mb": 2}
    modules, eps = _engines()

    async def go():  # an explicit extractor wins over the model's kind: tiny buckets here
        async with ws.connect(eps, "packed_cuda_ipc",
                              extractor={"type": "hf", "bucket_size_mb": 0.0004}) as sync:
            return await sync.push(RewardNet(8), version=1)

    stats = asyncio.run(go())
    assert stats.num_chunks == 2 and _same(modules[0], RewardNet(8))


# -- the backend follows the tensors' device --------------------------------------------------------


def test_backend_is_picked_at_the_first_push_from_the_model():
    modules, eps = _engines()
    src = RewardNet(1)

    async def go():
        async with ws.connect(eps, "broadcast") as sync:
            assert sync.sender is None  # the backend is not known before the first push
            stats = await sync.push(src, version=1)
            return stats, sync.strategy.cfg.backend, sync.sender

    stats, backend, sender = asyncio.run(go())
    assert backend == "gloo" and sender is not None
    assert stats.versions == [1] and stats.engines == ["eng0"] and stats.num_tensors == 4
    assert _same(modules[0], src)


def test_device_given_builds_the_sender_at_connect():
    _, eps = _engines()

    async def go():
        sync = await ws.connect(eps, {"type": "broadcast"}, device="cpu")
        try:
            return sync.sender is not None, sync.strategy.cfg.backend
        finally:
            await sync.close()

    assert asyncio.run(go()) == (True, "gloo")


# -- extractor from the model's kind ------------------------------------------------------------------


def test_extractor_follows_the_model_kind():
    plain = RewardNet(0)
    assert model_kind(plain) == "hf"
    assert extractor_config_for(plain)["type"] == "hf"
    head = extractor_config_for(plain, head_name_patterns=["score."])
    assert head["type"] == "hf_head" and head["head_name_patterns"] == ["score."]
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(RewardNet(0), LoraConfig(r=2, target_modules=["backbone"]))
    assert model_kind(peft) == "peft" and extractor_config_for(peft)["type"] == "lora_merge"
    assert extractor_config_for(peft, head_name_patterns=["score."])["name_patterns"] == ["score."]


def test_a_peft_model_goes_out_merged():
    import copy

    from peft import LoraConfig, get_peft_model

    modules, eps = _engines()
    peft = get_peft_model(RewardNet(3), LoraConfig(r=2, target_modules=["backbone"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)  # a non-zero adapter: the merged weight differs from the base
    merged = copy.deepcopy(peft).merge_and_unload().state_dict()  # what the engine must hold
    assert not torch.equal(merged["backbone.weight"], RewardNet(3).backbone.weight)

    async def go():
        async with ws.connect(eps, "packed_cuda_ipc") as sync:
            return await sync.push(peft, version=1)

    stats = asyncio.run(go())
    assert stats.num_tensors == 4
    for k, v in modules[0].state_dict().items():
        assert torch.allclose(v, merged[k], atol=1e-6), k


# -- fan-out, blocking twin, context manager -----------------------------------------------------------


def test_one_push_fans_out_to_two_engines_and_the_twin_blocks():
    modules, eps = _engines(2)
    src = RewardNet(5)
    with ws.connect_sync(eps, "packed_cuda_ipc") as sync:
        stats = sync.push(src, version=7)
        status = sync.status()
    assert stats.versions == [7, 7] and stats.engines == ["eng0", "eng1"]
    assert [s["version"] for s in status] == [7, 7]
    assert all(_same(m, src) for m in modules)
    assert sync.session.closed


def test_state_dicts_are_pushed_as_given_and_cast():
    modules, eps = _engines()
    sd = {k: v.to(torch.float64) for k, v in RewardNet(9).state_dict().items()}

    async def go():
        async with ws.connect(eps, "cuda_ipc") as sync:
            return await sync.push(sd, version=2, dtype="float32")

    stats = asyncio.run(go())
    assert stats.versions == [2]
    for k, v in modules[0].state_dict().items():
        assert torch.equal(v, sd[k].to(torch.float32)), k


# -- training modes ------------------------------------------------------------------------------------


def test_head_only_push_of_a_model_sends_only_the_head():
    modules, eps = _engines()
    before = {k: v.clone() for k, v in modules[0].state_dict().items()}
    src = RewardNet(4)

    async def go():
        async with ws.connect(eps, "broadcast") as sync:
            stats = await sync.push(src, version=1, training_mode="head_only")
            with pytest.raises(WeightMismatchError, match="backbone.weight: not a head parameter"):
                await sync.push(dict(src.state_dict()), version=2,
                                training_mode=ws.TrainingMode.HEAD_ONLY)
            return stats

    stats = asyncio.run(go())
    assert stats.num_tensors == 2
    got = modules[0].state_dict()
    assert torch.equal(got["score.weight"], src.score.weight)
    assert torch.equal(got["backbone.weight"], before["backbone.weight"])


# -- a refused push leaves the session usable -------------------------------------------------------------


def test_refused_push_keeps_the_group_and_the_next_push_lands():
    modules, eps = _engines()

    class Wider(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Linear(8, 17)
            self.score = torch.nn.Linear(17, 1)

    async def go():
        async with ws.connect(eps, "broadcast", device="cpu") as sync:
            sender = sync.sender
            with pytest.raises(WeightMismatchError, match=r"backbone.weight: shape \[17, 8\]"):
                await sync.push(Wider(), version=1)
            stats = await sync.push(RewardNet(6), version=1)
            return sender is sync.sender, stats, await sync.status()

    kept, stats, status = asyncio.run(go())
    assert kept and stats.versions == [1] and status[0]["state"] == "idle"
    assert _same(modules[0], RewardNet(6))


def test_a_closed_session_refuses_and_non_senders_do_nothing():
    modules, eps = _engines()
    before = {k: v.clone() for k, v in modules[0].state_dict().items()}

    async def go():
        sync = await ws.connect(eps, "broadcast", rank=1)  # not the sending rank
        assert sync.client is None and not sync.is_sender
        assert await sync.push(RewardNet(2), version=1) is None
        assert await sync.push(dict(RewardNet(2).state_dict())) is None
        await sync.close()
        with pytest.raises(RuntimeError, match="closed"):
            await sync.push(RewardNet(2))

    asyncio.run(go())
    assert all(torch.equal(v, before[k]) for k, v in modules[0].state_dict().items())


# -- chunks the caller made ----------------------------------------------------------------------------


def test_push_chunks_streams_made_chunks_under_their_manifest():
    """``push_chunks``: an async stream of chunks under a manifest, checked against the training
    mode before anything moves; a refusal keeps the group; only the sending rank may call it."""
    modules, eps = _engines()
    before = {k: v.clone() for k, v in modules[0].state_dict().items()}
    src = RewardNet(8).state_dict()
    made = [ws.WeightChunk(["backbone.weight", "backbone.bias"],
                           [src["backbone.weight"], src["backbone.bias"]]),
            ws.WeightChunk(["score.weight", "score.bias"], [src["score.weight"], src["score.bias"]])]
    manifest = [m for c in made for m in c.metas()]

    async def stream():
        for c in made:
            yield c

    async def go():
        async with ws.connect(eps, "broadcast") as sync:
            with pytest.raises(WeightMismatchError, match="backbone.weight: not a head parameter"):
                await sync.push_chunks(stream(), manifest, version=1, training_mode="head_only")
            assert modules[0].state_dict()["score.weight"].equal(before["score.weight"])
            assert sync.sender is None  # refused before the sender was built: nothing moved
            stats = await sync.push_chunks(stream(), manifest, version=1, device="cpu")
            kept = sync.sender
            stats2 = await sync.push_chunks(made[1:], made[1].metas(), version=2,
                                            training_mode="head_only")
            assert sync.sender is kept
        other = await ws.connect(eps, "broadcast", rank=1)
        with pytest.raises(RuntimeError, match="rank 1 is not the sending rank"):
            await other.push_chunks(stream(), manifest)
        await other.close()
        return stats, stats2

    stats, stats2 = asyncio.run(go())
    assert stats.versions == [1] and stats.num_chunks == 2 and stats.num_tensors == 4
    assert stats2.versions == [2] and stats2.num_tensors == 2
    assert _same(modules[0], RewardNet(8))


def test_one_extractor_per_model_is_kept_across_pushes_and_a_changed_model_is_seen():
    modules, eps = _engines()
    src = RewardNet(1)

    async def go():
        async with ws.connect(eps, "broadcast", device="cpu") as sync:
            await sync.push(src, version=1)
            first = sync._extractor[1]
            with torch.no_grad():
                src.score.weight.mul_(3)  # a training step: same tensors, new values
            await sync.push(src, version=2)
            kept = sync._extractor[1] is first
            assert _same(modules[0], src)
            other = RewardNet(2)
            await sync.push(other, version=3)
            return kept, sync._extractor[1] is not first

    kept, rebuilt = asyncio.run(go())
    assert kept and rebuilt and _same(modules[0], RewardNet(2))


def test_an_unchanged_model_is_pushed_from_its_held_chunks_without_a_new_extraction(
        monkeypatch):
    import weightsync.extractors.auto as auto

    kinds = []  # the model's kind is found again only when the held update does not hold
    real_kind = auto.model_kind
    monkeypatch.setattr(auto, "model_kind", lambda m: (kinds.append(1), real_kind(m))[1])
    modules, eps = _engines()
    src = RewardNet(1)
    passes = []

    async def go():
        async with ws.connect(eps, "broadcast", device="cpu") as sync:
            await sync.push(src, version=1)  # the first push extracts
            ext = sync._extractor[1]
            extract = ext.extract_weights

            def counted(*a, **kw):
                passes.append(1)
                return extract(*a, **kw)

            ext.extract_weights = counted
            held = ext.held_update
            asked = []
            ext.held_update = lambda *a, **kw: (asked.append(1), held(*a, **kw))[1]
            with torch.no_grad():
                src.score.weight.add_(1)  # a training step in place: the same tensors
            await sync.push(src, version=2)
            assert _same(modules[0], src) and not passes  # today's values, from held views
            src.score.weight = torch.nn.Parameter(src.score.weight.detach() * 2)  # replaced
            await sync.push(src, version=3)
            assert _same(modules[0], src) and len(passes) == 1  # extracted anew
            assert len(asked) == 2  # once a push: a changed model is not walked twice
            await sync.push(src, version=4)
            assert len(passes) == 1 and len(asked) == 3  # held again

    asyncio.run(go())
    # found when the extractor was built (twice: to key it, to configure it) and once for the
    # push after the tensor was replaced (the kept extractor fits); never for a held update
    assert len(kinds) == 3
