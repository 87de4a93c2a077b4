"""``HttpChannel``: an address where nothing ever answered is "no engine at that address"
(``EngineUnreachableError``, saying what to check); a server that answered and then went away
is an ``EngineDiedError``. Real sockets: a port nobody listens on, a real HTTP server stopped
between two calls."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest

from weightsync.clients import HttpChannel
from weightsync.errors import EngineDiedError, EngineUnreachableError
from weightsync.testing.servers import free_port


class _WorldSize(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"world_size": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_nothing_ever_listened_there():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        channel = HttpChannel(url, timeout_s=5)
        try:
            await channel.world_size()
        finally:
            await channel.aclose()

    with pytest.raises(EngineUnreachableError) as ei:
        asyncio.run(go())
    msg = str(ei.value)
    assert msg.startswith(f"no engine at {url}: nothing answers there")
    assert "check the URL and port" in msg and "weightsync serve-policy" in msg


def test_a_server_that_answered_and_left_is_dead():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WorldSize)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def go():
        channel = HttpChannel(url, timeout_s=5)
        try:
            assert await channel.world_size() == 1
            server.shutdown()
            server.server_close()  # the port now refuses connections
            await channel.world_size()
        finally:
            await channel.aclose()

    with pytest.raises(EngineDiedError) as ei:
        asyncio.run(go())
    assert not isinstance(ei.value, EngineUnreachableError)
    assert url + "/get_world_size" in str(ei.value)
