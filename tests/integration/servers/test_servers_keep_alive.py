"""Both servers keep an idle keep-alive connection open longer than clients keep one (httpx: 5
s), so a client that reuses one after a pause gets an answer, not "Server disconnected without
sending a response" (which uvicorn's own 5 s limit gave a load-test client under load)."""

from __future__ import annotations

import http.client
import json
import time

import pytest

pytestmark = pytest.mark.slow

IDLE_S = 5.5  # longer than httpx's idle expiry and uvicorn's default limit (both 5 s)


def _post_twice_idle(port: int, path: str, body: dict, api_key: str) -> list[int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    statuses = []
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        r.read()
        statuses.append(r.status)
        sock = conn.sock
        time.sleep(IDLE_S)
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        r.read()
        statuses.append(r.status)
        assert conn.sock is sock, "the second request needed a new connection"
    finally:
        conn.close()
    return statuses


def test_policy_server_answers_on_a_connection_idle_past_five_seconds(policy_server):
    assert _post_twice_idle(policy_server.port, "/v1/completions", {
        "model": "tiny-policy", "prompt": "hello", "max_tokens": 1, "temperature": 0,
    }, policy_server.api_key) == [200, 200]


def test_reward_server_answers_on_a_connection_idle_past_five_seconds(reward_server):
    assert _post_twice_idle(reward_server.port, "/score", {"input": ["a b c"]},
                            reward_server.api_key) == [200, 200]
