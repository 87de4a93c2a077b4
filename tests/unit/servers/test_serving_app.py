"""``serve_app``, what both servers serve with: a real uvicorn server on 127.0.0.1.

Idle keep-alive connections: both servers keep one open ``--keep-alive-timeout-s`` (65 s
unless ``$VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` says otherwise), longer than clients keep idle
connections, so a client never reuses one the server is closing (uvicorn's own 5 s equals
httpx's idle expiry: a request sent on a connection idle for about 5 s raced the server's close
and got "Server disconnected without sending a response"); the two servers' own connections are
checked in ``tests/integration/servers/test_servers_keep_alive.py``. And the heap alive when
serving starts is frozen out of the garbage collector's sight."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time

import pytest

from weightsync.servers._serving import (
    KEEP_ALIVE_ENV,
    KEEP_ALIVE_TIMEOUT_S,
    add_server_arguments,
    default_keep_alive_s,
    serve_app,
)


async def _ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``serve_app`` on its own loop in a thread, until ``close``."""

    def __init__(self, keep_alive_s: float) -> None:
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        ready = threading.Event()

        async def main() -> None:
            herald = asyncio.ensure_future(self._when_listening(ready))
            try:
                await serve_app(_ok_app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", stop=self.stop, keep_alive_s=keep_alive_s)
            finally:
                herald.cancel()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       daemon=True)
        self.thread.start()
        assert ready.wait(30), "the server never listened"

    async def _when_listening(self, ready: threading.Event) -> None:
        while True:
            try:
                _r, w = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            w.close()
            ready.set()
            return

    def close(self) -> None:
        import gc

        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        gc.unfreeze()  # serve_app froze this test process's heap: give it back to the collector


def _twice_on_one_connection(port: int, idle_s: float) -> tuple[bool, str]:
    """GET / twice on one connection, ``idle_s`` apart: (the same socket served both, what the
    second request got)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/")
        first = conn.getresponse()
        assert first.status == 200 and first.read() == b"ok"
        sock = conn.sock
        time.sleep(idle_s)
        try:
            conn.request("GET", "/")
            second = conn.getresponse()
            return conn.sock is sock, f"{second.status} {second.read()!r}"
        except (http.client.RemoteDisconnected, ConnectionError) as e:
            return False, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def test_an_idle_connection_outlives_what_clients_keep_and_closes_at_the_limit():
    server = _Server(keep_alive_s=KEEP_ALIVE_TIMEOUT_S)
    try:  # longer idle than httpx (5 s) keeps a connection: still open, still answering
        assert _twice_on_one_connection(server.port, 5.5) == (True, "200 b'ok'")
    finally:
        server.close()
    short = _Server(keep_alive_s=0.5)
    try:  # the limit is the one given: past it the server has closed the connection
        same, what = _twice_on_one_connection(short.port, 1.5)
        assert not same and ("RemoteDisconnected" in what or "Error" in what), what
    finally:
        short.close()


def test_the_default_is_vllms_variable_when_set(monkeypatch):
    monkeypatch.delenv(KEEP_ALIVE_ENV, raising=False)
    assert default_keep_alive_s() == KEEP_ALIVE_TIMEOUT_S == 65.0
    monkeypatch.setenv(KEEP_ALIVE_ENV, "12")
    assert default_keep_alive_s() == 12.0
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(KEEP_ALIVE_ENV, bad)
        with pytest.raises(ValueError, match=KEEP_ALIVE_ENV):
            default_keep_alive_s()


def test_the_flag_takes_positive_seconds_only(capsys):
    import argparse

    from weightsync.servers.reward import RewardServerConfig

    p = argparse.ArgumentParser()
    add_server_arguments(p, RewardServerConfig(), open_routes="/score")
    assert p.parse_args(["--keep-alive-timeout-s", "2.5"]).keep_alive_timeout_s == 2.5
    assert p.parse_args([]).keep_alive_timeout_s is None  # the config's default decides
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--keep-alive-timeout-s", bad])
        assert "--keep-alive-timeout-s" in capsys.readouterr().err


def test_serve_app_refuses_a_non_positive_limit():
    with pytest.raises(ValueError, match="keep_alive_s"):
        asyncio.run(serve_app(_ok_app, host="127.0.0.1", port=_free_port(), log_level="warning",
                              lifespan="off", keep_alive_s=0))


def test_serving_freezes_the_heap_it_starts_with():
    """What is alive when serving starts (for a server: vLLM's engine client and app) is out of
    the collector's sight, so a full collection scans only what serving allocates."""
    import gc

    gc.unfreeze()
    keep = [[i] for i in range(10_000)]  # objects alive before serving
    server = _Server(keep_alive_s=KEEP_ALIVE_TIMEOUT_S)
    try:
        assert gc.get_freeze_count() >= len(keep)
    finally:
        server.close()
        gc.unfreeze()


def test_a_stalled_event_loop_is_logged(caplog):
    import logging

    from weightsync.servers._serving import watch_loop_stalls

    log = logging.getLogger("weightsync.test.stalls")

    async def run():
        watch = asyncio.ensure_future(watch_loop_stalls(log, warn_s=0.3, tick_s=0.05))
        await asyncio.sleep(0.2)  # the loop runs: nothing to say
        quiet = len(caplog.records)
        time.sleep(0.6)  # a handler that blocks the loop
        await asyncio.sleep(0.2)
        watch.cancel()
        return quiet

    with caplog.at_level(logging.WARNING, logger="weightsync.test.stalls"):
        quiet = asyncio.run(run())
    assert quiet <= 1  # a loaded machine may stall the loop by itself; the block always shows
    stalls = [float(r.getMessage().split("for ")[1].split("s")[0]) for r in caplog.records
              if "did not run for" in r.getMessage()]
    assert stalls and max(stalls) >= 0.5
