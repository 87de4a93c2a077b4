"""``VersionedResponses`` (the policy server's gate and version tags) around a small real ASGI
app, with a real ``UpdateControl`` (no engine needed: the gate and the version live in it)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from weightsync.servers.control import UpdateControl
from weightsync.servers.versioned import VersionedResponses


def make_app(release: asyncio.Event | None = None):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        return JSONResponse({"id": "x", "choices": [{"text": "é"}]})

    async def error(request):
        return JSONResponse({"error": "bad"}, status_code=400)

    async def stream(request):
        async def events():
            yield b'data: {"n": 1}\n\ndata: {"n"'  # an event split across body parts
            yield b': 2, "t": "\xc3'  # ... and a UTF-8 character split too
            yield b'\xa9"}\n\n'
            if release is not None:
                await release.wait()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/error", error, methods=["POST"]),
              Route("/v1/stream", stream, methods=["POST"]),
              Route("/health", health)]
    return Starlette(routes=routes)


def client(app, control):
    asgi = VersionedResponses(app, control=control, exempt=("/runtime_version",))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t")


def control(version=3, **kw) -> UpdateControl:
    c = UpdateControl(None, **kw)
    c.version = version
    return c


def test_json_bodies_and_headers_carry_the_version():
    async def go():
        async with client(make_app(), control(3)) as h:
            r = await h.post("/v1/completions")
            err = await h.post("/v1/error")
            health = await h.get("/health")
        return r, err, health

    r, err, health = asyncio.run(go())
    assert r.headers["x-weight-version"] == "3"
    assert r.json() == {"id": "x", "choices": [{"text": "é"}], "weight_version": 3}
    assert int(r.headers["content-length"]) == len(r.content)
    assert err.status_code == 400 and err.headers["x-weight-version"] == "3"
    assert err.json() == {"error": "bad"}  # errors keep their body
    assert "x-weight-version" not in health.headers and health.json() == {"status": "ok"}


def test_every_sse_event_is_tagged_even_when_split():
    async def go():
        async with client(make_app(), control(7)) as h:
            return await h.post("/v1/stream")

    r = asyncio.run(go())
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads == [{"n": 1, "weight_version": 7}, {"n": 2, "t": "é", "weight_version": 7}]
    assert r.headers["x-weight-version"] == "7"


def test_an_update_waits_for_a_stream_in_flight_and_new_requests_wait_for_the_update():
    async def go():
        release = asyncio.Event()
        c = control(1, wait_timeout_s=5)
        async with client(make_app(release), c) as h:
            stream = asyncio.ensure_future(h.post("/v1/stream"))
            while c.gate.readers == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(TimeoutError):  # the stream holds the read side
                await c.gate.acquire_write("u1", 0.2)
            release.set()
            first = await stream
            await c.gate.acquire_write("u1", 1)  # drained: the update may start
            c.version = 2
            late = asyncio.ensure_future(h.post("/v1/completions"))
            await asyncio.sleep(0.2)
            assert not late.done()  # new requests wait for the update
            c.gate.release_write("u1")
            return first, await late

    first, late = asyncio.run(go())
    assert all(json.loads(e[6:])["weight_version"] == 1
               for e in first.text.split("\n\n") if e.startswith("data: {"))
    assert late.json()["weight_version"] == 2


def test_torn_weights_and_long_updates_answer_503():
    async def go():
        c = control(4, wait_timeout_s=0.2)
        async with client(make_app(), c) as h:
            c.worker_states = [{"state": "torn", "version": 4, "last_error": "trainer died"}]
            torn = await h.post("/v1/completions")
            c.worker_states = [{"state": "idle", "version": 4}]
            await c.gate.acquire_write("u", 1)
            busy = await h.post("/v1/completions")
            c.gate.release_write("u")
            ok = await h.post("/v1/completions")
        return torn, busy, ok

    torn, busy, ok = asyncio.run(go())
    assert torn.status_code == 503 and "trainer died" in torn.json()["detail"]
    assert torn.headers["x-weight-version"] == "4"
    assert busy.status_code == 503 and "in progress" in busy.json()["detail"]
    assert ok.status_code == 200 and ok.json()["weight_version"] == 4


# -- in_flight="continue": requests are named, and an answer says where its version changed -----


def test_continue_mode_names_requests_and_adds_the_spans_of_a_flip_under_them():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from weightsync.servers.control import Flip

    c = control(3, in_flight="continue")
    seen: list[str] = []

    async def completions(request):
        rid = request.headers["x-request-id"]
        seen.append(rid)
        # an update lands while this request runs: 5 of its tokens came from version 3
        c.flip_seq += 1
        c.flips.append(Flip(c.flip_seq, 3, 4, {f"cmpl-{rid}-0": 5, f"cmpl-{rid}x-0": 9}, 0.01))
        return JSONResponse({"id": "x"})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    async def go():
        async with client(app, c) as h:
            mine = await h.post("/v1/completions", headers={"X-Request-Id": "abc"})
            made_up = await h.post("/v1/completions")
            return mine, made_up

    mine, made_up = asyncio.run(go())
    assert mine.json() == {"id": "x", "weight_version": 3,
                           "weight_version_spans": {"cmpl-abc-0": [[3, 0], [4, 5]]}}
    assert seen[0] == "abc" and seen[1].startswith("ws") and len(seen[1]) > 10
    assert made_up.json()["weight_version_spans"] == {f"cmpl-{seen[1]}-0": [[3, 0], [4, 5]]}


def test_spans_only_for_flips_after_the_request_started_and_modes_are_checked():
    from weightsync.servers.control import Flip

    c = control(3, in_flight="continue")
    assert c.serve_during_updates  # continuing needs the update staged beside the weights
    c.flips.append(Flip(1, 3, 4, {"cmpl-r-0": 2}, 0.0))
    c.flips.append(Flip(2, 4, 5, {"cmpl-r-0": 6}, 0.0))
    assert c.spans_for("r", 0, 3) == {"cmpl-r-0": [[3, 0], [4, 2], [5, 6]]}
    assert c.spans_for("r", 1, 4) == {"cmpl-r-0": [[4, 0], [5, 6]]}
    assert c.spans_for("r", 2, 5) is None and c.spans_for("q", 0, 3) is None
    with pytest.raises(ValueError, match=r"in_flight must be one of \['finish', 'continue'\]"):
        UpdateControl(None, in_flight="later")
    assert not control(3).serve_during_updates  # finish (the default) drains as before
