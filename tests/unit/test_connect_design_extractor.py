"""The front door with an extractor written from the interface design alone (a SkyRL-style
trainer's: ``_extract_raw_weights`` and nothing else, its config the trainer's ``DictConfig``):
given to ``ws.connect(..., extractor=)``, registered and named in a YAML file, async or not.
Each push extracts once (the manifest is read from the dict the chunks are cut from), the
engine then holds the trainer's model exactly, and a refused push keeps nothing.

Engines are real ``WeightUpdateEndpoint``s in this process (``torch_module`` loaders on real
modules); the transports are real (gloo broadcast between threads of this process, shared
memory for the IPC strategies).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

import weightsync as ws
from weightsync.errors import WeightMismatchError
from weightsync.loaders.torch_module import TorchModuleWeightLoader

SKYRL_CFG = OmegaConf.create({"generator": {"weight_sync_backend": "gloo"},
                              "trainer": {"placement": {"colocate_all": False}}})


class Policy(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.score = torch.nn.Linear(16, 1)


class SkyRLExtractor(ws.WeightExtractor):
    """What a SkyRL trainer writes from the design: ``_extract_raw_weights``, async."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls = 0

    async def _extract_raw_weights(self, model, generator_dtype):
        self.calls += 1
        return {n: p.detach().to(generator_dtype or p.dtype)
                for n, p in model.state_dict().items()}


class SyncSkyRLExtractor(SkyRLExtractor):
    """The same, not ``async``."""

    def _extract_raw_weights(self, model, generator_dtype):  # type: ignore[override]
        self.calls += 1
        return {n: p.detach() for n, p in model.state_dict().items()}


@ws.register_extractor("test_design_only")
class RegisteredExtractor(SkyRLExtractor):
    """Built by ``build_extractor`` from a YAML ``type:`` (its config: a plain dict)."""

    made: list[RegisteredExtractor] = []

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        RegisteredExtractor.made.append(self)


def _engine(seed: int = 0) -> tuple[Policy, ws.WeightUpdateEndpoint]:
    module = Policy(seed)
    return module, ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=module), name="eng0")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                 strict=True))


@pytest.mark.parametrize("strategy", [{"type": "broadcast", "backend": "gloo"},
                                      {"type": "broadcast", "backend": "gloo", "stream": False},
                                      "cuda_ipc", "packed_cuda_ipc"],
                         ids=["broadcast", "broadcast-per-chunk", "cuda_ipc", "packed_cuda_ipc"])
@pytest.mark.parametrize("cls", [SkyRLExtractor, SyncSkyRLExtractor], ids=["async", "sync"])
def test_a_design_only_extractor_syncs_the_engine_exactly_extracting_once_a_push(strategy, cls):
    engine, endpoint = _engine()
    trainer, ext = Policy(1), cls(SKYRL_CFG)

    async def go():
        async with ws.connect([endpoint], strategy, extractor=ext) as sync:
            for step in (1, 2):
                with torch.no_grad():
                    trainer.proj.weight.add_(0.5)  # a training step
                stats = await sync.push(trainer, version=step)
                assert stats.versions == [step] and stats.num_tensors == 5
                assert _same(engine, trainer)
                assert ext.calls == step  # one extraction a push: manifest and chunks
                assert ext._prepared is None  # nothing kept after the push

    asyncio.run(go())


def test_a_registered_design_only_extractor_named_in_yaml(tmp_path):
    engine, endpoint = _engine()
    trainer = Policy(2)
    path = tmp_path / "sync.yaml"
    path.write_text("extractor:\n  type: test_design_only\n")
    RegisteredExtractor.made.clear()

    async def go():
        async with ws.connect([endpoint], {"type": "broadcast", "backend": "gloo"},
                              extractor=str(path)) as sync:
            await sync.push(trainer, version=1)
            await sync.push(trainer, version=2)

    asyncio.run(go())
    assert _same(engine, trainer)
    (ext,) = RegisteredExtractor.made  # built once, kept across pushes
    assert ext.calls == 2 and not ext._group_by_module and not ext._batch_by_threshold
    built = ws.build_extractor({"type": "test_design_only"})
    assert isinstance(built, RegisteredExtractor) and built.cfg == {"type": "test_design_only"}


def test_a_refused_push_keeps_no_extraction_and_the_next_one_lands():
    engine, endpoint = _engine()
    trainer, ext = Policy(3), SkyRLExtractor(SKYRL_CFG)

    async def go():
        async with ws.connect([endpoint], {"type": "broadcast", "backend": "gloo"},
                              extractor=ext) as sync:
            with pytest.raises(WeightMismatchError):  # refused before any byte moves
                await sync.push(trainer, version=1, training_mode="head_only",
                                head_name_patterns=["no_such_head."])
            assert ext._prepared is None
            trainer.extra = torch.nn.Linear(2, 2)  # a tensor the engine does not have
            with pytest.raises(WeightMismatchError, match="extra.weight"):
                await sync.push(trainer, version=1)  # refused by the engine at the start
            assert ext._prepared is None
            del trainer.extra
            assert (await sync.push(trainer, version=1)).versions == [1]

    asyncio.run(go())
    assert _same(engine, trainer)


def test_on_a_rank_that_does_not_send_it_takes_the_role_connect_gives():
    """Its config (the trainer's) says nothing of ranks: connect's rank decides. An unsharded
    model is pushed by the sending rank alone, so here nothing is extracted."""
    ext = SkyRLExtractor(SKYRL_CFG)

    async def go():
        async with ws.connect([], "broadcast", extractor=ext, rank=1) as sync:
            assert await sync.push(Policy(0), version=1) is None

    asyncio.run(go())
    assert ext.is_sender is False and ext.calls == 0
    stated = ws.build_extractor({"type": "hf"})  # its config says is_sender: true
    with pytest.raises(ValueError, match="says is_sender=True but this rank"):
        asyncio.run(ws.connect([], "broadcast", extractor=stated, rank=1)._open())
