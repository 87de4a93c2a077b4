"""LocalEngineProcess (and FanOutClient over it): a real child process serving JSON over a socket."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from weightsync import WeightSyncError
from weightsync.clients import FanOutClient
from weightsync.digest import tensor_digest
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_metas, qwen2_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FACTORY = "weightsync.local.modules:qwen2_module"
TINY = {"size": "tiny", "dtype": "bfloat16", "seed": 5}


@pytest.fixture(scope="module")
def engine():
    e = LocalEngineProcess.spawn(FACTORY, TINY, name="eng-a")
    yield e
    e.stop()


def test_ping_version_world_size(engine):
    async def run():
        pong = await engine.call("ping")
        assert pong["pid"] == engine.pids[0] and pong["name"] == "eng-a"
        assert await engine.call("get_version") == 0
        assert await engine.call("get_world_size") == 1
        assert (await engine.call("get_state"))["state"] == "idle"

    asyncio.run(run())


def test_state_digest_matches_the_module_built_here(engine):
    local = qwen2_module(**TINY).state_dict()
    got = asyncio.run(engine.call("state_digest"))
    assert set(got) == {m.name for m in qwen2_metas("tiny")}
    for n, t in local.items():
        assert got[n] == {"digest": tensor_digest(t), "dtype": "bfloat16", "shape": list(t.shape)}


def test_save_state_dict_round_trips(engine, tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "w.safetensors")
    out = asyncio.run(engine.call("save_state_dict", path=path))
    assert out["num_tensors"] == len(qwen2_metas("tiny"))
    saved = load_file(path)
    for n, t in qwen2_module(**TINY).state_dict().items():
        assert torch.equal(saved[n], t)


def test_errors_come_back_as_weightsync_errors_naming_the_engine(engine):
    with pytest.raises(WeightSyncError, match=r"eng-a.*unknown endpoint method 'nope'"):
        asyncio.run(engine.call("nope"))
    # the engine still serves after an error
    assert asyncio.run(engine.call("get_version")) == 0
    with pytest.raises(WeightSyncError, match="eng-a.*no receiver"):
        asyncio.run(engine.call("update_named_weights", request={"type": "broadcast"}))


def test_bad_factory_is_reported_at_spawn():
    with pytest.raises(ValueError, match="pkg.mod:fn"):
        LocalEngineProcess.spawn("no_colon_here")
    with pytest.raises(WeightSyncError, match=r"failed to start.*unknown Qwen2 size 'huge'"):
        LocalEngineProcess.spawn(FACTORY, {"size": "huge"}, name="bad")
    with pytest.raises(TypeError):
        LocalEngineProcess.spawn(FACTORY, {"x": object()})  # kwargs must be JSON-safe


def test_dead_engine_fails_fast_and_is_named():
    a = LocalEngineProcess.spawn(FACTORY, TINY, name="victim")
    b = LocalEngineProcess.spawn(FACTORY, TINY, name="bystander")
    try:
        client = FanOutClient([a, b], timeout_s=60)
        assert asyncio.run(client.versions()) == [0, 0]
        os.kill(a.pids[0], signal.SIGKILL)  # dies behind our back: seen through EOF
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"victim.*(died|gone).*SIGKILL"):
            asyncio.run(client.versions())
        assert time.monotonic() - t0 < 5  # EOF, not a timeout
        with pytest.raises(WeightSyncError, match="victim"):
            asyncio.run(a.call("ping"))
        assert asyncio.run(b.call("get_version")) == 0
    finally:
        a.kill()
        b.stop()


def test_client_rejects_duplicate_names(engine):
    with pytest.raises(ValueError, match="unique"):
        FanOutClient([engine, engine])
    assert FanOutClient.rank_offsets([1, 2, 1]) == [1, 2, 4]
