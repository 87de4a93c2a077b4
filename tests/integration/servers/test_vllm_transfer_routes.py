"""vLLM's own weight-transfer routes on ``serve-policy`` (``--weight-transfer-config``), driven
the way vLLM's trainer side drives them, through the server's update gate.

One real policy server (vLLM CPU, fp32, a tiny Llama) with ``--weight-transfer-config
'{"backend": "weightsync"}'``, an API key, and ``VLLM_SERVER_DEV_MODE=1`` (which makes vLLM
mount its raw versions of these routes: ours must replace them). The trainer is vLLM's own
``WeightTransferTrainerFactory`` with weightsync's backend over vLLM's
``HTTPVLLMWeightSyncClient`` (given the token, which vLLM's client does not send): it calls
``/init_weight_transfer_engine``, then per step ``/start_weight_update``, ``/update_weights``
(the start, the chunks, the finish of weightsync's own update) and ``/finish_weight_update``.
Asserted: the served version moves only at the finish, the served logprobs equal
transformers' at the pushed weights, a request in flight when an update starts finishes on the
old weights before any byte lands, the routes need the token, vLLM's raw dev-mode routes are
gone, and an update that fails leaves the last version served (refused before any byte) or the
weights marked torn (after vLLM accepted a part) until a complete update lands."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import requests
from _policy_ref import PROMPTS, TOL, Reference, check_against, served

pytestmark = pytest.mark.slow

STRATEGY = {"type": "broadcast", "backend": "gloo", "timeout_s": 60}
ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
          "/finish_weight_update", "/shutdown_weight_transfer_engine")
N_STREAM = 200  # a stream long enough to be in flight when the update starts
N_LONG = 600  # the same on the continue server's larger model


@pytest.fixture(scope="module")
def server(tiny_policy_model_dir, tmp_path_factory):
    from conftest import start_policy_server, stop_server

    log = str(tmp_path_factory.mktemp("vllm-routes") / "server.log")
    handle = start_policy_server(
        tiny_policy_model_dir, log, env={"VLLM_SERVER_DEV_MODE": "1"},
        extra=["--weight-transfer-config", '{"backend": "weightsync"}'])
    try:
        yield handle
    finally:
        stop_server(handle)


def _client(server, before=None):
    """vLLM's HTTP client with the server's token; ``before(path)`` runs before each call."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    class TokenClient(HTTPVLLMWeightSyncClient):
        def _post(self, path, json=None):
            if before is not None:
                before(path)
            r = requests.post(f"{self.base_url}/{path}", json=json, headers=server.headers,
                              timeout=self.timeout)
            r.raise_for_status()

        def reset_prefix_cache(self):
            self._post("reset_prefix_cache")

    return TokenClient(server.url, timeout=120)


def _trainer(client, model):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weightsync.vllm_backend import WeightSyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(strategy=STRATEGY, world_size=2, rank=0), client=client,
        source=ModuleSource(model))


def _state(server) -> dict:
    return httpx.get(server.url + "/runtime_version", timeout=10).json()


def test_routes_need_the_token_and_replace_vllms_raw_dev_routes(server):
    for path in ROUTES:
        r = httpx.post(server.url + path, json={}, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
    assert httpx.get(server.url + "/server_info", timeout=30).status_code == 401
    info = httpx.get(server.url + "/server_info?config_format=json", headers=server.headers,
                     timeout=60)
    assert info.status_code == 200 and "vllm_config" in info.json()
    # dev-mode routes that would change weights or resume a paused scheduler beside the gate
    for path in ("/collective_rpc", "/start_draft_weight_update", "/weight_checker", "/resume"):
        assert httpx.post(server.url + path, json={}, headers=server.headers,
                          timeout=30).status_code == 404, path
    # TRL reads the workers' count here (the trainer joins as one more rank)
    assert httpx.get(server.url + "/get_world_size", headers=server.headers,
                     timeout=10).json() == {"world_size": 1}
    r = httpx.post(server.url + "/update_weights", json={"update_info": {}},
                   headers=server.headers, timeout=30)
    assert r.status_code == 409 and "/start_weight_update" in r.json()["detail"]
    r = httpx.post(server.url + "/shutdown_weight_transfer_engine", json={},
                   headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text


def test_a_start_finish_pair_holds_requests_and_moves_the_version(server):
    """No bytes: the update still runs through the gate; a request sent meanwhile waits and is
    answered by the version the finish published."""
    v0 = _state(server)["version"]
    r = httpx.post(server.url + "/start_weight_update", json={}, headers=server.headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    assert _state(server) | {"update_in_progress": None} == {
        "version": v0, "state": "updating", "update_in_progress": None}
    for path, body in (("/start_weight_update", {}), ("/shutdown_weight_transfer_engine", {}),
                       ("/init_weight_transfer_engine", {"init_info": {}})):
        r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
        assert r.status_code == 409 and "/finish_weight_update" in r.json()["detail"], path
    answer: dict = {}
    waiting = threading.Thread(target=lambda: answer.update(r=served(server, PROMPTS[0])[1]))
    waiting.start()
    waiting.join(3.0)
    assert waiting.is_alive() and not answer  # held at the gate
    r = httpx.post(server.url + "/finish_weight_update", json={}, headers=server.headers,
                   timeout=60)
    assert r.status_code == 200 and r.json()["version"] == v0 + 1, r.text
    waiting.join(60)
    assert int(answer["r"].headers["x-weight-version"]) == v0 + 1
    assert _state(server) == {"version": v0 + 1, "state": "ready", "update_in_progress": None}


def test_a_trainer_pushes_step_after_step_and_the_version_moves_only_at_finish(server):
    ref = Reference(server.model_dir)
    seen: list[tuple[str, dict]] = []
    trainer = _trainer(_client(server, lambda path: seen.append((path, _state(server)))),
                       ref.model)
    try:
        for step in range(3):
            v = _state(server)["version"]
            ref.perturb(seed=40 + step)
            seen.clear()
            trainer.send_weights(version=v + 1)
            calls = [path for path, _ in seen]
            assert calls[0] == "start_weight_update" and "update_weights" in calls
            finish = calls.index("finish_weight_update")
            # every call up to vLLM's finish (weightsync's own finish included) saw v
            assert all(state["version"] == v for _, state in seen[:finish + 1])
            assert all(state["state"] == "updating" for _, state in seen[1:finish + 1])
            assert _state(server)["version"] == v + 1
            for p in PROMPTS:
                assert check_against(server, ref, p) == v + 1
    finally:
        trainer.shutdown()


def _stream(server, out: dict, started: threading.Event, spans: bool = False,
            n: int = N_STREAM) -> None:
    body = {"model": "tiny-policy", "prompt": PROMPTS[1], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "logprobs": 0}
    tokens, lps = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        out["version"] = int(r.headers["x-weight-version"])
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if spans and "weight_version_spans" in event:
                out["spans"] = event["weight_version_spans"]
            choice = event["choices"][0]
            out.setdefault("prompt_ids", choice.get("prompt_token_ids"))
            tokens += choice.get("token_ids") or []
            lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
            started.set()
    out.update(tokens=tokens, lps=lps, ended=time.monotonic())
    started.set()


def test_a_request_in_flight_finishes_on_the_old_weights_before_bytes_land(server):
    old, new = Reference(server.model_dir), Reference(server.model_dir)
    start_sent: list[float] = []
    armed = threading.Event()

    def before(path: str) -> None:
        if armed.is_set() and path == "start_weight_update" and not start_sent:
            start_sent.append(time.monotonic())

    trainer = _trainer(_client(server, before), new.model)
    try:
        v = _state(server)["version"]
        trainer.send_weights(version=v + 1)  # both references now hold what the server serves
        new.perturb(seed=60)
        out: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=_stream, args=(server, out, started))
        reader.start()
        assert started.wait(120)
        armed.set()
        trainer.send_weights(version=v + 2)  # waits for the stream (drain), then moves bytes
        reader.join(300)
        # all of the stream's tokens came from the old weights: none landed while it ran
        assert out["version"] == v + 1 and len(out["tokens"]) == N_STREAM
        assert start_sent[0] < out["ended"]  # the update started under the stream
        ids = out["prompt_ids"] + out["tokens"]
        want = old.logprobs(ids)[len(out["prompt_ids"]) - 1:]
        assert max(abs(a - b) for a, b in zip(out["lps"], want, strict=True)) <= TOL
        assert check_against(server, new, PROMPTS[0]) == v + 2
    finally:
        trainer.shutdown()


def test_a_failed_update_leaves_the_last_version_or_torn_weights(server):
    import torch
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.errors import WeightMismatchError
    from weightsync.types import TensorMeta, WeightUpdateStart

    ref = Reference(server.model_dir)
    trainer = _trainer(_client(server), ref.model)
    try:
        v = _state(server)["version"]
        trainer.send_weights(version=v + 1)
        before, _ = served(server, PROMPTS[0])
        # refused before any byte (the manifest): the version and the weights stay
        trainer.source = [*ModuleSource(ref.model), ("model.norm.weight", torch.zeros(3))]
        with pytest.raises(WeightMismatchError, match="model.norm.weight"):
            trainer.send_weights(version=v + 2)
        trainer.source = ModuleSource(ref.model)
        assert _state(server) == {"version": v + 1, "state": "ready", "update_in_progress": None}
        assert served(server, PROMPTS[0])[0]["choices"] == before["choices"]

        # vLLM accepted a part (the start of weightsync's update), then a call failed: torn
        post = lambda path, body: httpx.post(server.url + path, json=body,  # noqa: E731
                                             headers=server.headers, timeout=60)
        assert post("/start_weight_update", {}).status_code == 200
        start = WeightUpdateStart(update_id="part", version=v + 2, manifest=[
            TensorMeta("model.norm.weight", "float32", list(ref.model.model.norm.weight.shape))])
        assert post("/update_weights", {"update_info": {
            "method": "start_weight_update", "kwargs": {"start": start.to_dict()}}}
        ).status_code == 200
        r = post("/update_weights", {"update_info": {
            "method": "update_named_weights", "kwargs": {"request": {"type": "nonsense"}}}})
        assert r.status_code >= 400
        state = _state(server)
        assert state["version"] == v + 1 and state["state"] == "torn", state
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny-policy", "prompt": PROMPTS[0], "max_tokens": 2})
        assert r.status_code == 503 and "incomplete" in r.text
        assert post("/finish_weight_update", {}).status_code == 409  # it is over

        trainer.send_weights(version=v + 3)  # a complete update heals the weights
        assert _state(server)["state"] == "ready"
        assert check_against(server, ref, PROMPTS[2]) == v + 3
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def continue_server(tmp_path_factory):
    """A model of hidden size 512 (4 layers): its stream lasts long enough to be in flight
    when the update starts."""
    from conftest import start_policy_server, stop_server

    from weightsync.testing.tiny_models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("vllm-routes-continue")
    model_dir = build_tiny_causal_lm(root / "model", family="llama", hidden_size=512,
                                     num_layers=4, num_heads=4, num_kv_heads=2,
                                     max_position_embeddings=1024, tie_word_embeddings=True)
    handle = start_policy_server(
        model_dir, str(root / "server.log"), extra=[
            "--max-model-len", "1024", "--weight-transfer-config", '{"backend": "weightsync"}',
            "--in-flight-requests", "continue"])
    try:
        yield handle
    finally:
        stop_server(handle)


def test_with_continue_a_request_in_flight_goes_on_with_the_new_weights(continue_server):
    """``--in-flight-requests continue``: the stream is not drained; it stands still while the
    bytes land and goes on with the new weights after the finish, and says where."""
    server = continue_server
    old, new = Reference(server.model_dir), Reference(server.model_dir)
    trainer = _trainer(_client(server), new.model)
    try:
        v = _state(server)["version"]
        trainer.send_weights(version=v + 1)
        new.perturb(seed=70)
        out: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=_stream, args=(server, out, started, True, N_LONG))
        reader.start()
        assert started.wait(120)
        trainer.send_weights(version=v + 2)
        reader.join(300)
        assert out["version"] == v + 1 and len(out["tokens"]) == N_LONG
        assert "spans" in out, "the stream ended before the update started"
        (spans,) = out["spans"].values()
        assert spans[0] == [v + 1, 0] and spans[1][0] == v + 2
        k = spans[1][1]
        assert 0 < k < N_LONG  # the update landed under the stream, which went on
        n = len(out["prompt_ids"])
        ids = out["prompt_ids"] + out["tokens"]
        got = out["lps"]
        want = old.logprobs(ids)[n - 1:n - 1 + k] + new.logprobs(ids)[n - 1 + k:]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL
        assert check_against(server, new, PROMPTS[0]) == v + 2
    finally:
        trainer.shutdown()
