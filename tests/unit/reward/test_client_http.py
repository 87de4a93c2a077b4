"""The reward client's retries and background-task poll (``weightsync.reward.client_http``).

A 5xx answer and a server still busy with background tasks cannot be caused on demand on the
real reward server, so a stand-in HTTP server (stdlib, real sockets on 127.0.0.1) answers from a
script of (status, body) per path; a connection error is caused for real (a port nobody listens
on until a server starts there).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from weightsync.errors import WeightSyncError
from weightsync.reward.client_http import request_with_retries, wait_background_tasks


class StandIn:
    """Answers ``script[path]`` in turn (the last entry repeats); counts requests per path."""

    def __init__(self, script: dict[str, list[tuple[int, dict]]], port: int = 0) -> None:
        self.script, self.hits = script, {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = outer.hits.get(self.path, 0)
                outer.hits[self.path] = n + 1
                answers = outer.script.get(self.path, [(404, {"detail": "no route"})])
                status, body = answers[min(n, len(answers) - 1)]
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer()

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self._answer()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _run(coro):
    async def go():
        async with httpx.AsyncClient() as http:
            return await coro(http)

    return asyncio.run(go())


def test_a_5xx_is_retried_with_backoff_and_bounded():
    s = StandIn({"/score": [(500, {}), (503, {}), (200, {"ok": 1})]})
    try:
        t0 = time.monotonic()
        r = _run(lambda h: request_with_retries(h, "POST", s.url + "/score", max_retries=3,
                                                backoff_s=0.1, json={}))
        assert r.status_code == 200 and s.hits["/score"] == 3
        assert time.monotonic() - t0 >= 0.1 + 0.2  # backoff doubled between the tries
        s.hits.clear()
        r = _run(lambda h: request_with_retries(h, "POST", s.url + "/score", max_retries=1,
                                                backoff_s=0.01, json={}))
        assert r.status_code == 503 and s.hits["/score"] == 2  # bounded: the last answer
        s.script["/bad"] = [(400, {})]
        r = _run(lambda h: request_with_retries(h, "GET", s.url + "/bad", max_retries=3,
                                                backoff_s=0.01))
        assert r.status_code == 400 and s.hits["/bad"] == 1  # the caller's fault: not retried
    finally:
        s.close()


def test_a_connection_error_is_retried_until_the_server_is_up():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/runtime_version"
    with pytest.raises(httpx.ConnectError):
        _run(lambda h: request_with_retries(h, "GET", url, max_retries=0, backoff_s=0.01))
    started: list[StandIn] = []
    timer = threading.Timer(0.3, lambda: started.append(
        StandIn({"/runtime_version": [(200, {"version": 4})]}, port=port)))
    timer.start()
    try:
        r = _run(lambda h: request_with_retries(h, "GET", url, max_retries=5, backoff_s=0.1))
        assert r.json() == {"version": 4}
    finally:
        timer.join()
        for s in started:
            s.close()


def test_background_tasks_are_polled_until_zero_and_bounded():
    s = StandIn({"/get_num_background_tasks": [(200, {"num_background_tasks": 2}),
                                               (200, {"num_background_tasks": 1}),
                                               (200, {"num_background_tasks": 0})]})
    try:
        assert _run(lambda h: wait_background_tasks(h, s.url, timeout_s=10,
                                                    interval_s=0.01)) == 3
        s.script["/get_num_background_tasks"] = [(200, {"num_background_tasks": 1})]
        with pytest.raises(WeightSyncError, match=r"1 background task\(s\) still running 0.2s"):
            _run(lambda h: wait_background_tasks(h, s.url, timeout_s=0.2, interval_s=0.05))
        del s.script["/get_num_background_tasks"]  # a server without the route: nothing to wait
        assert _run(lambda h: wait_background_tasks(h, s.url, timeout_s=1)) == 0
    finally:
        s.close()


def test_the_client_scores_through_a_transient_5xx():
    from weightsync.reward.client import VLLMRewardClient

    body = {"model": "rm", "data": [{"index": 0, "score": 0.75}], "usage": {"prompt_tokens": 2}}
    s = StandIn({"/health": [(200, {"status": "ok", "type": "reward_model"})],
                 "/score": [(502, {"detail": "bad gateway"}), (200, body)]})
    try:
        c = VLLMRewardClient(port=int(s.url.rsplit(":", 1)[1]), retry_backoff_s=0.05)
        try:
            assert c.score_batch_sync(["hi"]) == [0.75] and s.hits["/score"] == 2
        finally:
            c.close_sync()
        once = VLLMRewardClient(port=int(s.url.rsplit(":", 1)[1]), max_retries=0)
        s.hits["/score"] = 0
        try:
            with pytest.raises(Exception, match="bad gateway"):
                once.score_batch_sync(["hi"])
            assert s.hits["/score"] == 1
        finally:
            once.close_sync()
    finally:
        s.close()
