"""The two server options that give the Ludic reference server's behaviour, against the default:

* ``--serve-during-updates``: ``/score`` keeps answering with the last complete weights while
  an update is received (staged), and the new version from its finish on; by default a score
  request waits for the update and runs on the new weights;
* versions taken as given (the servers' default; ``--allow-version-reset``, deprecated, still
  accepted for it): an update's version is published even when it is lower (a trainer that
  restarted its count); with ``--monotonic-versions`` that is a 409.

The server with our rules is the shared one (``--monotonic-versions``); the reference-mode
server is started here on the same tiny model and stopped at the end of the module.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

import weightsync as ws
from weightsync.types import WeightChunk

pytestmark = pytest.mark.slow

TEXTS = ["The model is helpful today.", "hi", "Question: what is 2 + 2? Answer: 4."]
STRATEGY = {"type": "broadcast", "backend": "gloo", "timeout_s": 60}
# one worker call per chunk (not the streamed update, one call for all of them): the engine can
# run the score between the two chunks
PER_CHUNK = {**STRATEGY, "stream": False}


@pytest.fixture(scope="module")
def reference_server(reward_server_launcher, tiny_reward_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("reference-mode") / "server.log")
    handle = reward_server_launcher(tiny_reward_model_dir, log,
                                    extra=["--serve-during-updates", "--allow-version-reset"])
    try:
        yield handle
    finally:
        reward_server_launcher.stop(handle)


def perturbed_weights(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    return {n: t + torch.randn(t.shape, generator=g) * 0.05 for n, t in base.items()}


async def scores(http: httpx.AsyncClient, url: str) -> tuple[list[float], int]:
    body = (await http.post(url + "/score", json={"input": TEXTS, "normalize": False})).json()
    return [d["score"] for d in body["data"]], body["version"]


async def score_while_an_update_pauses(server, params: dict[str, torch.Tensor]) -> dict:
    """Push ``params`` in two chunks with a pause after the first; score during the pause."""
    names = sorted(params)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    chunks = [WeightChunk(h, [params[n] for n in h]) for h in halves]
    manifest = [m for c in chunks for m in c.metas()]
    paused, resume = asyncio.Event(), asyncio.Event()

    async def stream():
        yield chunks[0]
        paused.set()  # the update started and took its first chunk
        await resume.wait()
        yield chunks[1]

    out: dict = {}
    async with httpx.AsyncClient(timeout=120) as http:
        out["before"] = await scores(http, server.url)
        async with ws.connect([server.url], strategy=PER_CHUNK, api_key=server.api_key) as sync:
            push = asyncio.ensure_future(sync.push_chunks(stream(), manifest,
                                                          training_mode="full"))
            await asyncio.wait_for(paused.wait(), 60)
            during = asyncio.ensure_future(scores(http, server.url))
            done, _ = await asyncio.wait({during}, timeout=5)
            out["answered_during"] = bool(done)
            resume.set()
            out["stats"] = await push
            out["during"] = await during
        out["after"] = await scores(http, server.url)
    return out


def test_scoring_goes_on_during_an_update_with_serve_during_updates(reference_server):
    """Reference mode: the answer comes during the update, from the last complete version
    (the staged tensors are not served), and the new version serves from the finish on."""
    new = perturbed_weights(reference_server.model_dir, seed=11)
    out = asyncio.run(score_while_an_update_pauses(reference_server, new))
    (old, v0), (during, v_during), (after, v_after) = out["before"], out["during"], out["after"]
    assert out["answered_during"]
    assert v_during == v0 and during == pytest.approx(old, abs=1e-6)
    assert out["stats"].versions == [v0 + 1] and v_after == v0 + 1
    assert max(abs(a - b) for a, b in zip(after, old, strict=True)) > 1e-3


def test_by_default_scoring_waits_for_the_update(reward_server):
    """The default: the request made during the update waits and runs on the new weights."""
    reward_server.restore()
    new = perturbed_weights(reward_server.model_dir, seed=12)
    out = asyncio.run(score_while_an_update_pauses(reward_server, new))
    (old, v0), (during, v_during), (after, v_after) = out["before"], out["during"], out["after"]
    assert not out["answered_during"]
    assert v_during == v_after == v0 + 1 and during == pytest.approx(after, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(after, old, strict=True)) > 1e-3
    reward_server.restore()


def test_allow_version_reset_takes_versions_as_given(reference_server, reward_server):
    """A trainer that restarted its count: the reference-mode server (the deprecated flag is
    still accepted) publishes the lower version; the shared server, with
    ``--monotonic-versions``, refuses it (409) and keeps its version."""
    from weightsync.errors import UpdateRefusedError

    params = perturbed_weights(reference_server.model_dir, seed=13)

    async def push(server, version):
        async with ws.connect([server.url], strategy=STRATEGY, api_key=server.api_key) as sync:
            return await sync.push(params, version=version, training_mode="full")

    high = int(httpx.get(reference_server.url + "/runtime_version").json()["version"]) + 5
    assert asyncio.run(push(reference_server, high)).versions == [high]
    assert asyncio.run(push(reference_server, 1)).versions == [1]
    body = httpx.post(reference_server.url + "/score", json={"input": "hi"}).json()
    assert body["version"] == 1

    v = int(httpx.get(reward_server.url + "/runtime_version").json()["version"])
    with pytest.raises(UpdateRefusedError, match="not newer"):
        asyncio.run(push(reward_server, 1))
    assert int(httpx.get(reward_server.url + "/runtime_version").json()["version"]) == v
