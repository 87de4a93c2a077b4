"""A 3-label reward model (Llama family) behind the reward server: scores are lists, equal to
transformers, activation is a softmax on request; a HEAD_ONLY sync moves them as transformers
says; with ``--tok-pooling-type STEP`` vLLM's step pooler returns a 3-vector per step tag.
Its own server (module scope), shut down when the module ends."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from weightsync.reward import RewardModelTrainingMode, ScoringRequest

pytestmark = pytest.mark.slow

TEXTS = ["The answer is clear and polite.", "no", "Weights move from the trainer into the engine."]


@pytest.fixture(scope="module")
def server3(tmp_path_factory, reward_server_launcher):
    from weightsync.testing.tiny_models import build_tiny_reward_model

    root = tmp_path_factory.mktemp("rm3")
    model_dir = build_tiny_reward_model(root / "model", family="llama", num_labels=3, seed=3)
    handle = reward_server_launcher(model_dir, str(root / "server.log"),
                                    extra=["--tok-pooling-type", "STEP"])
    try:
        yield handle
    finally:
        reward_server_launcher.stop(handle)


def hf_logits(model_dir, texts, head=None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    if head is not None:
        model.score.weight.data.copy_(head)
    with torch.no_grad():
        batched = model(**tok(texts, padding=True, return_tensors="pt")).logits
        single = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in texts])
    assert torch.allclose(batched, single, atol=1e-5)
    return single


def test_three_labels_match_transformers(server3):
    ref = hf_logits(server3.model_dir, TEXTS)
    body = httpx.post(server3.url + "/score", json={"input": TEXTS, "normalize": False}).json()
    scores = torch.tensor([d["score"] for d in body["data"]])
    assert scores.shape == (3, 3)
    assert (scores - ref).abs().max() <= 1e-4
    single = httpx.post(server3.url + "/score", json={"input": TEXTS[1], "normalize": False}).json()["data"][0]["score"]
    assert isinstance(single, list) and len(single) == 3
    assert (torch.tensor(single) - ref[1]).abs().max() <= 1e-4
    act = httpx.post(server3.url + "/score", json={"input": TEXTS}).json()
    probs = torch.tensor([d["score"] for d in act["data"]])
    assert (probs - ref.softmax(-1)).abs().max() <= 1e-5


def test_three_labels_head_only_sync(server3):
    g = torch.Generator().manual_seed(0)
    head = torch.randn(3, 64, generator=g)

    async def go():
        async with server3.client() as c:
            v0 = await c.get_model_version()
            await c.sync_weights_async({"score.weight": head},
                                       training_mode=RewardModelTrainingMode.HEAD_ONLY)
            resp, _ = await c.score(ScoringRequest(inputs=TEXTS, normalize=False))
            return v0, c.last_sync_stats.versions, resp

    v0, served, resp = asyncio.run(go())
    assert served == [v0 + 1] and resp.version == v0 + 1 and resp.n_labels == 3
    ref = hf_logits(server3.model_dir, TEXTS, head=head)
    assert (torch.tensor(resp.scores) - ref).abs().max() <= 1e-4


def test_three_labels_step_pooling_by_vllm(server3):
    """The server's token pooler is vLLM's STEP: the request's tag goes to vLLM
    (``PoolingParams.step_tag_id``), which keeps the tag positions; each is a 3-vector equal to
    transformers' head output there (for a head this test syncs first)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from weightsync.testing.tiny_models import STEP_TOKEN

    head = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))

    async def sync_head():
        async with server3.client() as c:
            await c.sync_weights_async({"score.weight": head},
                                       training_mode=RewardModelTrainingMode.HEAD_ONLY)

    asyncio.run(sync_head())
    text = f"First step.{STEP_TOKEN}\nSecond step.{STEP_TOKEN}"
    body = httpx.post(server3.url + "/score", json={
        "input": [text, "none"], "pooling_type": "step", "step_tag": STEP_TOKEN,
        "normalize": False, "n_labels": 3}).json()
    assert body["pooling_type"] == "step", body
    steps, empty = (d["score"] for d in body["data"])
    assert empty == [] and len(steps) == 2 and all(len(v) == 3 for v in steps)
    tok = AutoTokenizer.from_pretrained(server3.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(server3.model_dir).eval()
    model.score.weight.data.copy_(head)
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        per_token = model.score(model.model(**enc).last_hidden_state)[0]
    at_tags = per_token[enc.input_ids[0] == tok.convert_tokens_to_ids(STEP_TOKEN)]
    assert (torch.tensor(steps) - at_tags).abs().max() <= 1e-4


def test_ready_line_then_sigterm_to_the_main_process_stops_without_leaks(server3):
    """Last in this module (it stops the module's server). The server said once, in a line of
    its own, where it is and what it needs; ``kill PID`` (SIGTERM to the main process alone,
    as a process manager sends it) stops it and vLLM's engine processes, which release their
    shared memory: no resource-tracker leak warning, no traceback."""
    import os
    import signal
    import time
    from pathlib import Path

    log = Path(server3.process.log_path)
    ready = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("weightsync reward server ready")]
    assert ready == [
        f"weightsync reward server ready on {server3.url}: model {server3.model_dir} (weight "
        f"version 0); dtype float32, the server's default on cpu (--dtype sets it); POST /score "
        f"and /get_reward (3 label(s)), vLLM's /classify, /pooling, "
        f"/v1/score, /v1/models; control plane /init_communicator, "
        f"/update_param_batch, /close_communicator, token required (--api-key); update timeout "
        f"600 s, request/update wait 60 s"]
    pid = server3.process.pid
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # the main process left (reaped here)
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the server outlived SIGTERM:\n" + log.read_text()[-3000:])
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)  # the rest of its group: vLLM's engine core and worker
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("vLLM's processes outlived the server:\n" + log.read_text()[-3000:])
    after = log.read_text(errors="replace").split(ready[0], 1)[1]
    assert "leaked" not in after and "resource_tracker" not in after, after[-3000:]
    assert "Traceback" not in after, after[-3000:]
