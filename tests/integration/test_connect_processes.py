"""The front door with real processes: a sharded (FSDP2) trainer on 2 gloo ranks pushing in
lockstep (only rank 0 reaches the engine; the extractor picked from the model, or one written
from the interface design alone), and an engine killed between pushes (the session drops its
group, says which engine is gone, and a new connection without it works)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from _sharded_sync import batch, spawn_gloo_ranks, tiny_qwen2

import weightsync as ws

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _DesignFSDPExtractor(ws.WeightExtractor):
    """A SkyRL FSDP extractor written from the interface design: only
    ``_extract_raw_weights``, gathering every DTensor with ``full_tensor()``."""

    calls = 0

    async def _extract_raw_weights(self, model, generator_dtype):
        self.calls += 1
        return {name: p.full_tensor() if hasattr(p, "full_tensor") else p
                for name, p in model.state_dict().items()
                if name != "lm_head.weight"}  # tied to the embedding


async def _fsdp_rank(rank: int, world: int, out: str) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import weightsync as ws
    from weightsync.digest import state_digest
    from weightsync.extractors.auto import model_kind
    from weightsync.local import LocalEngineProcess

    model = tiny_qwen2()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report: dict = {"rank": rank, "kind": model_kind(model), "stats": [], "equal": []}
    extractor = _DesignFSDPExtractor(None) if out.endswith("design.json") else None
    engine = None
    if rank == 0:
        metas = ws.build_extractor({"type": "fsdp"}).metadata(model)
        engine = LocalEngineProcess.spawn(
            "weightsync.local.modules:metas_module",
            {"metas": [m.to_dict() for m in metas], "fill": "zeros"}, name="engine0",
            num_threads=1,
        )
    try:
        # every rank: the same call; rank 1 is not the sender and reaches no engine
        async with ws.connect([engine] if engine else [], "broadcast", rank=rank,
                              extractor=extractor) as sync:
            report["is_sender"] = sync.is_sender
            for step in (1, 2):
                ids = batch(rank, step)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
                stats = await sync.push(model, version=step)  # lockstep gathers on both ranks
                report["stats"].append(None if stats is None else stats.versions)
                report["extractions"] = getattr(extractor, "calls", None)
                if rank == 0:
                    got = await engine.call("state_digest")
                    want = state_digest({n: full[n] for n in got})
                    report["equal"].append(got == want)
    finally:
        if engine is not None:
            engine.stop()
        with open(out.replace(".json", f".rank{rank}.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("mode", ["auto", "design"])
def test_sharded_ranks_push_in_lockstep_and_only_rank0_reaches_the_engine(tmp_path, mode):
    out = str(tmp_path / f"fsdp-{mode}.json")
    spawn_gloo_ranks(_fsdp_rank, out)
    r0, r1 = (json.loads(Path(out.replace(".json", f".rank{r}.json")).read_text()) for r in (0, 1))
    assert r0["kind"] == r1["kind"] == "fsdp"
    assert (r0["is_sender"], r1["is_sender"]) == (True, False)
    assert r0["stats"] == [[1], [2]] and r1["stats"] == [None, None]
    assert r0["equal"] == [True, True]  # bit-exact: what the engine holds is the full model
    if mode == "design":  # every rank ran its gathers, once a push
        assert r0["extractions"] == r1["extractions"] == 2


def test_a_dead_engine_drops_the_group_and_a_new_connection_without_it_works():
    import torch

    import weightsync as ws
    from weightsync.digest import module_digest
    from weightsync.errors import EngineDiedError
    from weightsync.local import LocalEngineProcess
    from weightsync.local.modules import qwen2_module

    factory, shape = "weightsync.local.modules:qwen2_module", {"size": "tiny", "dtype": "float32"}
    engines = [LocalEngineProcess.spawn(factory, {**shape, "fill": "zeros"}, name=f"engine{i}")
               for i in range(2)]
    trainer = qwen2_module(**shape, seed=1)
    # join_timeout_s: the second push's group cannot form without engine1; engine0 has joined
    # it and leaves only at its join timeout (a rank cannot be pulled out of gloo's rendezvous),
    # so the reconnect below waits that long for engine0 (the default, 120 s, would too)
    strategy = {"type": "broadcast", "backend": "gloo", "timeout_s": 10, "join_timeout_s": 15}

    async def go():
        sync = await ws.connect(engines, strategy)
        try:
            assert (await sync.push(trainer, version=1)).versions == [1, 1]
            engines[1].kill()
            t0 = time.monotonic()
            with pytest.raises(EngineDiedError, match="engine1"):
                await sync.push(trainer, version=2)
            assert time.monotonic() - t0 < 10  # seen at once (EOF), not after a timeout
            assert sync.sender is None  # the group is gone: the next push builds a new one
            with pytest.raises(EngineDiedError, match="engine1"):
                await sync.push(trainer, version=2)  # ... which needs every engine: reconnect
        finally:
            await sync.close()
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(2)
        async with ws.connect(engines[:1], strategy, timeout_s=60) as sync:
            stats = await sync.push(trainer, version=3)
        assert stats.versions == [3]
        assert await engines[0].call("state_digest") == module_digest(trainer)

    try:
        asyncio.run(go())
    finally:
        for e in engines:
            e.kill()


async def _fsdp_ipc_rank(rank: int, world: int, out: str) -> None:
    """Every rank: ``ws.connect(..., "cuda_ipc")`` (shared memory on CPU) and ``push`` of an
    FSDP2 model; the engine has 2 workers, the shape of a TP=2 engine on the trainer's GPUs.
    The extractor: picked from the model (``auto``, ``off``), an ``fsdp`` extractor object
    given to connect (``given``), or one written from the interface design alone, its
    ``_extract_raw_weights`` gathering with ``full_tensor()`` (``design``)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import weightsync as ws
    from weightsync.digest import state_digest
    from weightsync.local import LocalEngineProcess

    strategy = {"type": "cuda_ipc", "timeout_s": 60, "bucket_size_mb": 0.05}
    mode = out.rsplit("-", 1)[1].removesuffix(".json")
    if mode == "off":
        strategy["every_rank"] = False
    extractor = None
    if mode == "given":
        extractor = ws.build_extractor({"type": "fsdp", "bucket_size_mb": 0.05})
    elif mode == "design":
        extractor = _DesignFSDPExtractor(None)
    model = tiny_qwen2()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report: dict = {"rank": rank, "stats": [], "equal": []}
    engine = None
    if rank == 0:
        metas = ws.build_extractor({"type": "fsdp"}).metadata(model)
        engine = LocalEngineProcess.spawn(
            "weightsync.local.modules:metas_module",
            {"metas": [m.to_dict() for m in metas], "fill": "zeros"}, name="engine0",
            num_threads=1, world_size=2)
    try:
        async with ws.connect([engine] if engine else [], strategy, rank=rank,
                              extractor=extractor) as sync:
            for step in (1, 2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * step)
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
                stats = await sync.push(model, version=step)
                report["stats"].append(None if stats is None else stats.versions)
                report["every_rank"] = sync.every_rank
                report["extractions"] = getattr(extractor, "calls", None)
                if rank == 0:
                    got = [await engine.call("state_digest", worker=w) for w in (0, 1)]
                    want = state_digest({n: full[n] for n in got[0]})
                    report["equal"].append([g == want for g in got])
                    report["replica"] = [(await engine.call("get_state", worker=w))[
                        "last_replica"] for w in (0, 1)]
    finally:
        if engine is not None:
            engine.stop()
        with open(out.replace(".json", f".rank{rank}.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("mode", ["auto", "off", "given", "design"])
def test_ipc_from_a_sharded_trainer_sends_every_ranks_copy_unless_told_not_to(tmp_path, mode):
    """The interface design's layout for sharded trainers: with an IPC strategy every rank
    keeps its gathered copy and sends handles to it (rank 0 gathers them and talks to the
    engine); engine worker i reads training rank i's copy, whether the extractor was picked
    from the model, given to connect, or written from the design alone (which then gathers
    once a push on every rank). ``every_rank: false`` keeps the rank-0-only path."""
    out = str(tmp_path / f"fsdp-ipc-{mode}.json")
    spawn_gloo_ranks(_fsdp_ipc_rank, out)
    r0, r1 = (json.loads(Path(out.replace(".json", f".rank{r}.json")).read_text()) for r in (0, 1))
    assert r0["stats"] == [[1], [2]] and r1["stats"] == [None, None]
    assert r0["equal"] == [[True, True], [True, True]]
    if mode != "off":
        assert r0["every_rank"] is r1["every_rank"] is True
        assert r0["replica"] == [0, 1]  # worker 1 read training rank 1's copy
        if mode == "design":
            assert r0["extractions"] == r1["extractions"] == 2  # once a push, every rank
    else:
        assert r0["every_rank"] is r1["every_rank"] is False
        assert r0["replica"] == [0, 0]
