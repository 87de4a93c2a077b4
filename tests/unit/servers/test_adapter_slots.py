"""Versions of a LoRA adapter kept in slots (``serve-policy --adapter-slots N``;
``weightsync/servers/_adapter_slots.py``), through ``VersionedResponses`` and a real
``UpdateControl``. The engine is a stand-in for vLLM's ``collective_rpc`` into the workers'
endpoints that answers every call at once and records each start's adapter: what is tested
here is the server's choice of slots and who waits for whom; a real engine serving two slots
is tested in ``tests/integration/servers/test_policy_server_lora.py``."""

from __future__ import annotations

import asyncio
import json

import pytest

from weightsync.servers._adapter_slots import SEATED, SlotTable
from weightsync.servers.control import ServiceError, UpdateControl
from weightsync.servers.versioned import VersionedResponses

CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


class _Engine:
    """``collective_rpc`` of one worker: ``weightsync_call`` answered at once."""

    def __init__(self) -> None:
        self.version = 0
        self.adapters: list[dict] = []  # each start's lora_adapter, as the workers got it

    async def collective_rpc(self, method: str, timeout=None, args=()):
        assert method == "weightsync_call", method
        name, kwargs, _call_id, _slice = args
        if name == "start_weight_update":
            self.adapters.append(kwargs["start"]["lora_adapter"])
        if name == "finish_weight_update":
            self.version += 1
            return [{"ok": True, "result": self.version, "state": {"version": self.version}}]
        return [{"ok": True, "state": {"version": self.version}}]


def _control(slots: int, wait_s: float = 0.3) -> tuple[UpdateControl, list]:
    c = UpdateControl(_Engine(), wait_timeout_s=wait_s, default_training_mode=None,
                      adapter_slots=slots)
    c.scoped_by_model = True
    published: list[tuple[str, int]] = []
    c.adapter_published = lambda name, slot: published.append((name, slot))
    return c, published


async def _update(c: UpdateControl, uid: str, name: str = "policy") -> None:
    await c.start({"update_id": uid, "lora_adapter": {"name": name, "config": CONFIG}}, None,
                  None)
    await c.finish({"update_id": uid, "ok": True, "num_chunks": 0}, None)


class _Requests:
    """Never-ending requests through the middleware; ``seen``: the slots each was seated on."""

    def __init__(self, c: UpdateControl) -> None:
        self.c, self.seen, self.tasks = c, [], []

        async def app(scope, receive, send):
            self.seen.append(SEATED.get())
            await asyncio.Event().wait()

        self.asgi = VersionedResponses(app, control=c)

    async def start(self, model: str) -> asyncio.Future:
        body = json.dumps({"model": model, "prompt": "hi"}).encode()
        sent = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if sent:
                return sent.pop()
            await asyncio.Event().wait()

        async def send(message):
            pass

        n = len(self.seen)
        task = asyncio.ensure_future(self.asgi(
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
            receive, send))
        async with asyncio.timeout(1):
            while len(self.seen) == n:
                await asyncio.sleep(0.01)
        self.tasks.append(task)
        return task

    async def end(self, *tasks: asyncio.Future) -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_each_version_goes_into_the_next_slot_and_waits_only_for_that_slots_requests():
    async def go():
        c, published = _control(slots=2)
        requests = _Requests(c)
        await _update(c, "v1")  # slot 0
        on_v1 = await requests.start("policy")
        await c.start({"update_id": "v2", "lora_adapter": {"name": "policy", "config": CONFIG}},
                      None, None)  # slot 1: no wait for the request on slot 0
        during = await requests.start("policy")  # not held back: seated on slot 0 still
        await c.finish({"update_id": "v2", "ok": True, "num_chunks": 0}, None)
        on_v2 = await requests.start("policy")  # slot 1 from the landing on
        base = await requests.start("tiny-policy")
        with pytest.raises(ServiceError) as e:  # slot 0 again: its two requests still run
            await _update(c, "v3")
        await requests.end(on_v1, during)
        await _update(c, "v3")  # now it lands, in slot 0, beside the request on slot 1
        await requests.end(on_v2, base)
        return c, published, requests.seen, e.value

    c, published, seen, err = asyncio.run(go())
    assert [a.get("slot") for a in c.engine.adapters] == [0, 1, 0]  # a refused start never reaches them
    assert published == [("policy", 0), ("policy", 1), ("policy", 0)]
    # a name nothing was published for (the base model's here) is seated on slot 0, where a
    # first version of it would go; vLLM's lookup of the base model never reads it
    assert seen == [{"policy": 0}, {"policy": 0}, {"policy": 1}, {"tiny-policy": 0}]
    assert err.status == 503 and err.message.count("POST /v1/completions") == 2


def test_with_one_slot_the_adapter_is_rewritten_and_its_requests_hold_the_update():
    async def go():
        c, published = _control(slots=1)
        requests = _Requests(c)
        await _update(c, "v1")
        running = await requests.start("policy")
        with pytest.raises(ServiceError):
            await _update(c, "v2")
        await requests.end(running)
        await _update(c, "v2")
        return c, published, requests.seen

    c, published, seen = asyncio.run(go())
    assert all("slot" not in a for a in c.engine.adapters)  # the wire as before
    assert published == [("policy", 0), ("policy", 0)]
    assert seen == [None]


def test_the_slot_table_answers_each_request_its_seated_slot():
    table = SlotTable({"file-adapter": "F"})
    table.publish("policy", 0, "P0", "policy listed (0)")
    table.publish("policy", 1, "P1", "policy listed (1)")

    def lookup(seated):
        token = SEATED.set(seated)
        try:
            return table["policy"], table.get("policy"), "policy" in table
        finally:
            SEATED.reset(token)

    assert lookup(None) == ("P1", "P1", True)  # the latest
    assert lookup({"policy": 0}) == ("P0", "P0", True)
    assert lookup({"other": 0}) == ("P1", "P1", True)
    # /v1/models: each name once, under the name itself (a slot's request has its own name)
    assert sorted(table.values()) == ["F", "policy listed (1)"]
    table["policy"] = "loaded by vLLM's own route"  # a file adapter of the same name
    assert table.slots == {} and lookup({"policy": 0})[0] == "loaded by vLLM's own route"
    assert sorted(table.values()) == ["F", "loaded by vLLM's own route"]
    del table["policy"]  # vLLM's unload route
    token = SEATED.set({"policy": 0})
    try:
        assert table.get("policy") is None and "policy" not in table
    finally:
        SEATED.reset(token)


def test_a_slots_request_answers_under_the_adapters_name():
    """vLLM answers a request of slot 1 under the slot's own name (``policy@slot1``: vLLM tells
    LoRA requests apart by name); the client sees the adapter's name, in a JSON body and in
    every event of a stream."""

    async def go():
        c, _ = _control(slots=2)
        await _update(c, "v1")
        await _update(c, "v2")  # slot 1 serves

        async def app(scope, receive, send):
            stream = scope["path"] == "/v1/completions"
            ctype = b"text/event-stream" if stream else b"application/json"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", ctype)]})
            body = {"model": "policy@slot1", "choices": []}
            text = (f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n" if stream
                    else json.dumps(body))
            await send({"type": "http.response.body", "body": text.encode()})

        asgi = VersionedResponses(app, control=c)
        got = {}
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = json.dumps({"model": "policy", "prompt": "hi"}).encode()
            sent = [{"type": "http.request", "body": body, "more_body": False}]
            out: list[dict] = []

            async def receive(sent=sent):
                return sent.pop()

            async def send(message, out=out):
                out.append(message)

            await asgi({"type": "http", "method": "POST", "path": path, "headers": []},
                       receive, send)
            got[path] = b"".join(m.get("body", b"") for m in out).decode()
        return got

    got = asyncio.run(go())
    assert '"model":"policy"' in got["/v1/completions"] and "@slot" not in str(got), got
    assert json.loads(got["/v1/chat/completions"])["model"] == "policy"


def test_slots_and_continuing_requests_are_refused_together():
    with pytest.raises(ValueError, match="adapter_slots > 1 keeps each request"):
        UpdateControl(None, adapter_slots=2, in_flight="continue")
    with pytest.raises(ValueError, match="adapter_slots must be an int >= 1"):
        UpdateControl(None, adapter_slots=0)
