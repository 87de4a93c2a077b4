"""vLLM's weight-transfer routes on the policy server, without an engine: which routes are
removed and mounted, the token, bodies refused before any engine call, the version a finish
publishes, and how an engine's failure is answered."""

from types import SimpleNamespace

import pytest

from weightsync.errors import WeightMismatchError, error_to_text
from weightsync.servers._update_policy import UpdatePolicy
from weightsync.servers.vllm_transfer_routes import (
    RAW_PATHS,
    TRANSFER_PATHS,
    backend_of,
    install,
    mark_torn,
    published_version,
    service_error,
)

TOKEN = {"Authorization": "Bearer k"}


def _app_with_raw_routes():
    """An app carrying a route at every path vLLM's dev mode mounts raw, and one of its own."""
    from fastapi import FastAPI

    app = FastAPI()
    for path in (*RAW_PATHS, "/v1/models"):
        app.add_api_route(path, lambda: {"raw": True}, methods=["GET", "POST"])
    return app


def _installed(config):
    from fastapi.testclient import TestClient

    app = _app_with_raw_routes()
    control = SimpleNamespace(name="test", version=0, active_update=None)
    args = SimpleNamespace(weight_transfer_config=config)
    mounted = install(app, control, engine=None, args=args, api_key="k", max_body_bytes=1 << 10,
                      timeout_s=1.0)
    return mounted, TestClient(app)


def test_without_a_backend_the_raw_routes_are_removed_and_none_are_served():
    mounted, client = _installed(None)
    assert not mounted
    for path in RAW_PATHS:
        assert client.post(path, json={}).status_code == 404, path
    assert client.get("/v1/models").json() == {"raw": True}  # the rest of vLLM's app stays


def test_with_a_backend_ours_replace_them_behind_the_token():
    mounted, client = _installed({"backend": "nccl"})
    assert mounted
    for path in TRANSFER_PATHS:
        r = client.post(path, json={})
        assert r.status_code == 401, (path, r.text)
    assert client.get("/server_info").status_code == 401
    for path in set(RAW_PATHS) - set(TRANSFER_PATHS) - {"/server_info"}:
        assert client.post(path, json={}, headers=TOKEN).status_code == 404, path
    # refused before any engine call: no open update, unknown fields, a bad version type
    r = client.post("/update_weights", json={"update_info": {}}, headers=TOKEN)
    assert r.status_code == 409 and "/start_weight_update" in r.json()["detail"]
    r = client.post("/start_weight_update", json={"x": 1}, headers=TOKEN)
    assert r.status_code == 400 and "'x'" in r.json()["detail"]
    r = client.post("/finish_weight_update", json={"weight_version": [1]}, headers=TOKEN)
    assert r.status_code == 400 and "weight_version" in r.json()["detail"]
    r = client.post("/init_weight_transfer_engine", json={"init_info": 3}, headers=TOKEN)
    assert r.status_code == 400 and "init_info" in r.json()["detail"]


def test_backend_of_reads_vllms_config_object_or_dict():
    assert backend_of(SimpleNamespace(weight_transfer_config=None)) is None
    assert backend_of(SimpleNamespace()) is None
    assert backend_of(SimpleNamespace(
        weight_transfer_config=SimpleNamespace(backend="weightsync"))) == "weightsync"
    assert backend_of(SimpleNamespace(weight_transfer_config={"backend": "nccl"})) == "nccl"


@pytest.mark.parametrize(("given", "reset", "published"), [
    ("5", False, 5), (5, False, 5), ("3", False, None), ("2", False, None), ("2", True, 2),
    (None, False, None), ("step-7", False, None), ("", False, None)])
def test_the_version_a_finish_publishes(given, reset, published):
    control = SimpleNamespace(version=3, policy=UpdatePolicy(monotonic_versions=not reset))
    assert published_version(given, control) == published


def test_an_engine_failure_is_answered_with_its_type_or_500():
    typed = RuntimeError("worker 0: " + error_to_text(WeightMismatchError(
        ["model.norm.weight: shape [3] but target has [64]"])))
    err = service_error(typed, "vLLM's update_weights")
    assert err.status == 400 and err.error_type == "WeightMismatchError"
    assert err.offenders == ["model.norm.weight: shape [3] but target has [64]"]
    assert err.message.startswith("vLLM's update_weights: ")
    plain = service_error(RuntimeError("NCCL error"), "vLLM's update_weights")
    assert plain.status == 500 and plain.error_type is None and "NCCL error" in plain.message


def test_mark_torn_keeps_the_version_and_says_why():
    control = SimpleNamespace(version=4, worker_states=[{"version": 4, "state": "idle"}])
    mark_torn(control, "half loaded")
    assert control.worker_states == [{"version": 4, "state": "torn", "last_error": "half loaded"}]
    empty = SimpleNamespace(version=2, worker_states=[])
    mark_torn(empty, "why")
    assert empty.worker_states == [{"version": 2, "state": "torn", "last_error": "why"}]


def test_start_takes_is_checkpoint_format_only_where_vllms_start_does():
    from weightsync.servers.vllm_transfer_routes import start_kwargs

    async def newer() -> None: ...

    async def older(is_checkpoint_format: bool) -> None: ...

    assert start_kwargs(newer, None) == {} and start_kwargs(newer, False) == {}
    assert start_kwargs(older, None) == {"is_checkpoint_format": True}  # its route's default
    assert start_kwargs(older, False) == {"is_checkpoint_format": False}
