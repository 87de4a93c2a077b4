"""What the router decides before any server is asked: which routes it forwards, the version
pin, its configuration, and the server choice (least outstanding requests, versions). The
forwarding itself runs against real reward servers in tests/integration/reward_loop."""

from __future__ import annotations

import asyncio

import pytest

from weightsync.reward_loop.router import RewardRouter, RouterConfig, RouterError


def _router(**cfg):
    return RewardRouter(["http://a:1", "http://b:2/"], RouterConfig(**cfg))


def test_only_model_routes_are_forwarded():
    router = _router()
    for path in ("/update_param_batch", "/init_communicator", "/sleep", "/anything"):
        with pytest.raises(RouterError) as e:
            asyncio.run(router.forward("POST", path, b"{}", {}))
        assert e.value.status == 404 and "weightsync.connect" in e.value.message


def test_a_bad_version_pin_is_named():
    with pytest.raises(RouterError, match="x-weight-version: a weight version") as e:
        asyncio.run(_router().forward("POST", "/classify", b"{}", {"X-Weight-Version": "new"}))
    assert e.value.status == 400


def test_least_outstanding_then_fewest_served_and_versions():
    router = _router()
    a, b = router.servers
    assert b.url == "http://b:2"  # trailing slash dropped
    a.version = b.version = 3
    a.outstanding, b.outstanding = 2, 1
    assert router._pick(None, []) is b
    b.outstanding, b.served, a.outstanding = 2, 5, 2
    assert router._pick(None, []) is a  # tie on outstanding: fewer served
    assert router._pick(None, [a]) is b  # a retry goes elsewhere
    b.version = 4
    with pytest.raises(RouterError, match=r"http://a:1 at version 3, http://b:2 at version 4") as e:
        router._pick(None, [])
    assert e.value.status == 409
    b.healthy = False  # an unhealthy server's version does not count
    assert router._pick(None, []) is a
    with pytest.raises(RouterError, match="no healthy reward server") as e:
        router._pick(None, [a])
    assert e.value.status == 503
    mixed = _router(allow_mixed_versions=True)
    mixed.servers[0].version, mixed.servers[1].version = 3, 4
    assert mixed._pick(4, []) is mixed.servers[1]  # a pinned request: only version 4
    with pytest.raises(RouterError, match="at version 9"):
        mixed._pick(9, [])


@pytest.mark.parametrize(("cfg", "message"), [
    ({"max_retries": -1}, "max_retries: must be >= 0"),
    ({"health_check_interval_s": 0}, "health_check_interval_s: must be a positive"),
    ({"request_timeout_s": float("inf")}, "request_timeout_s: must be a positive"),
])
def test_bad_router_config_is_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        _router(**cfg)


def test_servers_listed_twice_or_none_are_refused():
    with pytest.raises(ValueError, match="listed twice"):
        RewardRouter(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at least one server"):
        RewardRouter([])
