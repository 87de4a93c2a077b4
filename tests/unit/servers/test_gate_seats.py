"""The update gate's seats (``weightsync.servers._gate``), through ``VersionedResponses`` and a real
``UpdateControl`` (no engine: a drain that times out answers before any worker call)."""

from __future__ import annotations

import asyncio
import json

import pytest

from weightsync.servers.control import ServiceError, UpdateControl
from weightsync.servers.versioned import VersionedResponses


async def _hanging_app(scope, receive, send):  # a generation that never ends
    await asyncio.Event().wait()


async def _asgi_request(asgi, path: str) -> None:
    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        pass

    await asgi({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)


async def _requests_in_flight(c: UpdateControl, path: str, n: int = 1) -> list[asyncio.Future]:
    """``n`` never-ending requests to ``path`` through the middleware, each holding a seat."""
    asgi = VersionedResponses(_hanging_app, control=c)
    tasks = [asyncio.ensure_future(_asgi_request(asgi, path)) for _ in range(n)]
    while c.gate.readers < n:
        await asyncio.sleep(0.01)
    return tasks


def test_a_request_cancelled_anywhere_gives_its_seat_back():
    """Cancelled once, and again while it unwinds (what a cancel scope does): the seat is
    released, so the next update does not wait for a request that no longer exists."""

    async def go():
        c = UpdateControl(None, wait_timeout_s=5)
        tasks = await _requests_in_flight(c, "/v1/completions", 3)
        for t in tasks:
            t.cancel()
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        readers = c.gate.readers
        await c.gate.acquire_write("u1", 0.5)  # TimeoutError if a seat leaked
        return readers, c.gate.writer

    assert asyncio.run(go()) == (0, "u1")


def test_an_update_that_cannot_drain_names_the_requests_in_flight():
    async def go():
        c = UpdateControl(None, wait_timeout_s=0.3)
        (task,) = await _requests_in_flight(c, "/v1/chat/completions")
        try:
            with pytest.raises(ServiceError) as e:
                await c.start({"update_id": "u1"}, None, 1)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # the failed start left nothing behind: the next one gets the gate
        await c.gate.acquire_write("u2", 0.5)
        return e.value

    err = asyncio.run(go())
    assert err.status == 503
    assert "did not drain in 0.3s" in err.message
    assert "POST /v1/chat/completions for 0s" in err.message


def test_a_waiting_update_holds_new_requests_back_and_the_first_waiter_wins():
    async def go():
        c = UpdateControl(None, wait_timeout_s=5)
        (first,) = await _requests_in_flight(c, "/v1/completions")
        writer = asyncio.ensure_future(c.gate.acquire_write("u1", 5))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(c.gate.acquire_read(5, "late"))
        await asyncio.sleep(0.05)
        held_back = not late.done() and not writer.done()
        first.cancel()  # the request in flight ends: the update goes first, then the late one
        await writer
        writer_first = not late.done()
        c.gate.release_write("u1")
        token = await asyncio.wait_for(late, 1)
        c.gate.release_read(token)
        return held_back, writer_first, c.gate.readers

    assert asyncio.run(go()) == (True, True, 0)


# -- scopes: a LoRA adapter-only update and the requests of other models ----------------------


async def _asgi_request_with(asgi, body: dict | bytes, path: str = "/v1/completions",
                             sent: list | None = None) -> None:
    """A request with ``body`` (a dict: as JSON) whose app never ends; the messages it was sent
    go to ``sent`` (a 503 answer, for one)."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    left = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if left:
            return left.pop()
        await asyncio.Event().wait()

    async def send(message):
        if sent is not None:
            sent.append(message)

    await asgi({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)


def _body_for(model: str | None) -> dict | bytes:
    """A request body that names ``model`` (None: a body that is not JSON)."""
    return b"not json" if model is None else {"model": model, "prompt": "hi"}


async def _asgi_request_for(asgi, model: str | None) -> None:
    await _asgi_request_with(asgi, _body_for(model))


async def _scoped_requests(c: UpdateControl, *models: str | None) -> list[asyncio.Future]:
    asgi = VersionedResponses(_hanging_app, control=c)
    n = c.gate.readers + len(models)
    tasks = [asyncio.ensure_future(_asgi_request_for(asgi, m)) for m in models]
    while c.gate.readers < n:
        await asyncio.sleep(0.01)
    return tasks


async def _seated_within(c: UpdateControl, body: dict | bytes, seconds: float) -> bool:
    """Whether a new request with ``body`` gets its seat within ``seconds`` (then it ends)."""
    before = c.gate.readers
    task = asyncio.ensure_future(_asgi_request_with(VersionedResponses(_hanging_app, control=c),
                                                    body))
    try:
        async with asyncio.timeout(seconds):
            while c.gate.readers == before:
                await asyncio.sleep(0.01)
        return True
    except TimeoutError:
        return False
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_an_adapter_update_neither_waits_for_nor_holds_back_other_models_requests():
    """With ``scoped_by_model`` (the policy server with LoRA): an update of adapter "policy"
    gets the gate while a base-model request runs, and new base-model requests get in while it
    holds the gate; requests for "policy", or whose model the middleware cannot read, wait for
    it. An update of the weights still waits for the base-model request."""

    async def go():
        c = UpdateControl(None, wait_timeout_s=5)
        c.scoped_by_model = True
        base = await _scoped_requests(c, "tiny-policy")
        await c.gate.acquire_write("adapter-1", 0.5, adapter="policy")  # TimeoutError if it waited
        got = {m: await _seated_within(c, _body_for(m), 0.3)
               for m in ("tiny-policy", "other", "policy", None)}
        c.gate.release_write("adapter-1")
        with pytest.raises(TimeoutError):
            await c.gate.acquire_write("weights-1", 0.3)  # the base request is still in flight
        for t in base:
            t.cancel()
        await asyncio.gather(*base, return_exceptions=True)
        await c.gate.acquire_write("weights-2", 0.5)
        return got

    assert asyncio.run(go()) == {"tiny-policy": True, "other": True, "policy": False, None: False}


def test_an_adapter_update_that_cannot_drain_names_only_the_requests_of_its_adapter():
    async def go():
        c = UpdateControl(None, wait_timeout_s=0.3)
        c.scoped_by_model = True
        tasks = await _scoped_requests(c, "tiny-policy", "policy")
        try:
            with pytest.raises(ServiceError) as e:
                await c.start({"update_id": "u1", "lora_adapter": {"name": "policy"}}, None, 1)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return e.value

    err = asyncio.run(go())
    assert err.status == 503 and "did not drain in 0.3s" in err.message
    assert err.message.count("POST /v1/completions for 0s") == 1  # the adapter's, not the base's


def test_without_scopes_every_request_holds_an_adapter_update_back():
    """A server without LoRA (``scoped_by_model`` False) reads no body: an adapter update, were
    one sent, would wait for every request as an update of the weights does."""

    async def go():
        c = UpdateControl(None, wait_timeout_s=5)
        tasks = await _scoped_requests(c, "tiny-policy")
        try:
            with pytest.raises(TimeoutError):
                await c.gate.acquire_write("adapter-1", 0.3, adapter="policy")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(go())


# -- requests that run alone (prompt logprobs on a server that cannot batch them) -----------------


def test_a_request_that_runs_alone_waits_for_the_others_and_holds_new_ones_back():
    """A reader that runs alone gets its seat once the readers in flight left; readers that come
    while it waits or runs wait for it (no starvation under steady load), then get in."""

    async def go():
        c = UpdateControl(None, wait_timeout_s=5)
        first = await _requests_in_flight(c, "/v1/completions", 2)
        solo = asyncio.ensure_future(c.gate.acquire_read(5, "solo", alone=True))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(c.gate.acquire_read(5, "late"))
        await asyncio.sleep(0.05)
        waited = (not solo.done(), not late.done(), c.gate.alone_busy)
        first[0].cancel()
        await asyncio.sleep(0.05)
        still = not solo.done()  # one request is still in flight
        first[1].cancel()
        token = await asyncio.wait_for(solo, 1)
        await asyncio.sleep(0.05)
        late_held = not late.done()  # the solo request runs: the late one waits
        c.gate.release_read(token)
        late_token = await asyncio.wait_for(late, 1)
        c.gate.release_read(late_token)
        await asyncio.gather(*first, return_exceptions=True)
        return waited, still, late_held, c.gate.readers, c.gate.alone_busy

    assert asyncio.run(go()) == ((True, True, True), True, True, 0, False)


def test_the_middleware_runs_prompt_logprobs_requests_alone_and_says_so_when_it_cannot():
    """With ``prompt_logprobs_alone`` (the policy server's guard) a request that asks for prompt
    logprobs, in any of the ways vLLM reads them, waits for the requests in flight; one that
    does not gets in beside them; a solo request that cannot get in answers 503 saying why.
    Without the guard the same request gets in at once."""
    asks = [{"prompt": "hi", "prompt_logprobs": 0},
            {"prompt": "hi", "echo": True, "logprobs": 1},
            {"messages": [], "echo": True, "top_logprobs": 2},
            {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}}]
    plain = [{"prompt": "hi", "logprobs": 1}, {"prompt": "hi", "echo": True},
             {"prompt": "hi", "prompt_logprobs": None}]

    async def go():
        c = UpdateControl(None, wait_timeout_s=0.3)
        c.prompt_logprobs_alone = True
        running = [asyncio.ensure_future(_asgi_request_with(
            VersionedResponses(_hanging_app, control=c), {"prompt": "a long one"}))]
        while c.gate.readers < 1:
            await asyncio.sleep(0.01)
        got = [await _seated_within(c, b, 0.2) for b in asks + plain]
        sent: list[dict] = []
        await _asgi_request_with(VersionedResponses(_hanging_app, control=c), asks[0], sent=sent)
        c.prompt_logprobs_alone = False
        unguarded = await _seated_within(c, asks[0], 0.2)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return got, sent, unguarded

    got, sent, unguarded = asyncio.run(go())
    assert got == [False] * len(asks) + [True] * len(plain)
    assert sent[0]["status"] == 503
    detail = json.loads(sent[1]["body"])["detail"]
    assert "runs alone (it asks for prompt logprobs)" in detail and "POST /v1/completions" in detail
    assert unguarded
