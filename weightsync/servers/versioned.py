"""Every model response of the policy server says which weight version produced it.

``VersionedResponses`` is an ASGI middleware put in front of vLLM's OpenAI app (callers:
``weightsync.servers.policy``, in the server process). For every request that may run the model
(every path except the control plane and the plain informational routes in ``UNGATED``):

* it holds the read side of the update gate (``UpdateControl.serving``) from the moment the
  request arrives until its last byte (a whole stream included) has been sent, so an update
  waits for it to finish and it never decodes across a weight change: all of its tokens come
  from the version it reports;
* with ``UpdateControl.scoped_by_model`` (the policy server with LoRA adapters) it first reads
  the JSON body of a request to a route that generates (``SALTED``) and holds the read side for
  the ``"model"`` it names: an adapter-only update of another adapter neither waits for it nor
  holds it back (``weightsync.servers._gate``). Such an update lands while other requests hold
  KV blocks, when vLLM refuses to reset its prefix cache, so these requests get the version
  salt described below too: the adapter's next request never reads KV its old version computed;
* it answers 503 (JSON ``{"detail": ...}``) while the weights are torn, or when an update holds
  the gate longer than the control's ``wait_timeout_s``;
* it adds ``x-weight-version: <v>`` to the response headers, and ``"weight_version": <v>`` as a
  top-level field to every successful JSON object body and to every ``data: {...}`` event of a
  server-sent-event stream (``data: [DONE]`` stays as it is). vLLM's OpenAI response objects
  and the ``openai`` client's models both accept extra fields (``resp.model_extra``).
* with ``in_flight="continue"`` (``UpdateControl``) the read side does not hold updates back:
  an update may land while the request runs, and its tokens from then on come from the new
  version. The request then gets ``"weight_version_spans": {vLLM request id: [[version, first
  token index], ...]}`` next to ``weight_version`` (the version it started on) in its JSON body,
  and in its SSE events from the flip on. Each request is given an ``X-Request-Id`` (vLLM names
  its engine requests after it) when it has none.
* with ``in_flight_kv="keep"`` as well (and with ``scoped_by_model``), the JSON body of a
  request to a route that generates
  (``SALTED``: completions, chat, responses, vLLM's token-in/token-out generate) gets
  ``cache_salt`` = the version it started on (after the client's own salt, if any): the
  prefix cache, not reset at such a flip, never gives a request KV of another version's
  requests.
"""

from __future__ import annotations

import codecs
import json
import uuid
from typing import Any

from weightsync.lora_adapter import slot_lora_name
from weightsync.servers._adapter_slots import SEATED
from weightsync.servers.control import ServiceError, UpdateControl

VERSION_HEADER = "x-weight-version"
VERSION_FIELD = "weight_version"
#: with ``in_flight="continue"``: the versions of a request's tokens when an update landed under
#: it, ``{vLLM request id: [[version, first token index], ...]}``
SPANS_FIELD = "weight_version_spans"

#: with ``in_flight_kv="keep"`` or ``scoped_by_model``: the routes whose JSON body gets the
#: request's prefix-cache salt
#: (vLLM's ``cache_salt``: ``UpdateControl.cache_salt_for``): the ones that generate (other
#: routes of vLLM's app, the pooling ones, are not salted: a policy server generates)
SALTED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate")

#: paths that never run the model: not gated, not tagged
UNGATED = (
    "/health", "/ping", "/metrics", "/version", "/v1/models", "/tokenize", "/detokenize",
    "/tokenizer_info", "/load", "/docs", "/redoc", "/openapi.json", "/server_info",
    "/is_sleeping",
)


class VersionedResponses:
    """ASGI middleware; ``exempt``: extra path prefixes to leave alone (the control plane)."""

    def __init__(self, app: Any, *, control: UpdateControl, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.control = control
        self.exempt = tuple(UNGATED) + tuple(exempt)

    def _gated(self, path: str) -> bool:
        return not any(path == p or path.startswith(p + "/") for p in self.exempt)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not self._gated(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        body = None
        control = self.control
        if scope.get("path") in SALTED and (control.keep_kv or control.scoped_by_model
                                            or control.prompt_logprobs_alone):
            body = await _Body.read(receive)
        model = body.model() if body is not None and control.scoped_by_model else None
        alone = control.prompt_logprobs_alone and body is not None and body.asks_prompt_logprobs()
        serving = control.serving(
            "generate", f"{scope.get('method', '')} {scope.get('path', '')}", model, alone=alone)
        try:
            version = await serving.__aenter__()
        except ServiceError as e:
            await _send_error(send, e, self.control.version)
            return
        try:
            spans = None
            if body is not None:
                if control.keep_kv or control.scoped_by_model:
                    scope = body.salt(scope, version)
                receive = body.replay(receive)
            if control.in_flight == "continue":
                scope, request_id = _with_request_id(scope)
                since = control.flip_seq
                memo: list = [since, None]  # (flips seen, their spans): per event, no rescan

                def spans() -> dict | None:
                    if control.flip_seq != memo[0]:
                        memo[:] = [control.flip_seq,
                                   control.spans_for(request_id, since, version)]
                    return memo[1]
            tagger = _Tagger(send, version, spans, _slot_renamed(model))
            await self.app(scope, receive, tagger.send)
            await tagger.flush()
        finally:
            await serving.__aexit__(None, None, None)


class _Tagger:
    """Wraps ``send``: header on the response start; the version field into JSON bodies
    (buffered, ``content-length`` fixed) and into each SSE ``data:`` event (passed on event by
    event as they complete)."""

    def __init__(self, send: Any, version: int, spans: Any = None,
                 renamed: tuple[str, str] | None = None) -> None:
        self._send = send
        self.version = version
        self.spans = spans  # () -> weight_version_spans of this request, or None
        #: (the name vLLM knows an adapter's version slot by, the adapter's name): a body's
        #: ``"model"`` says the latter (``_adapter_slots``)
        self.renamed = renamed
        self._mode = "pass"  # "json" (buffer whole body), "sse" (per event), "pass"
        self._start: dict | None = None
        self._body = bytearray()
        self._pending = ""  # SSE text of an event not complete yet
        # bytes that are not UTF-8 pass through unchanged (surrogateescape both ways)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")

    async def send(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", [])
                       if k.lower() != VERSION_HEADER.encode()]
            headers.append((VERSION_HEADER.encode(), str(self.version).encode()))
            message = {**message, "headers": headers}
            ctype = _header(headers, b"content-type")
            ok = 200 <= int(message.get("status", 200)) < 300
            if ok and ctype.startswith("application/json"):
                self._mode, self._start = "json", message
                return
            if ok and ctype.startswith("text/event-stream"):
                self._mode = "sse"
            await self._send(message)
            return
        if kind != "http.response.body" or self._mode == "pass":
            await self._send(message)
            return
        more = bool(message.get("more_body", False))
        if self._mode == "json":
            self._body += message.get("body", b"")
            if not more:
                await self._send_json()
            return
        text = self._pending + self._utf8.decode(message.get("body", b""), final=not more)
        events = text.split("\n\n")
        self._pending = events.pop() if more else ""
        spans = self.spans() if self.spans is not None else None
        out = "".join(_tag_event(e, self.version, spans, self.renamed) + "\n\n"
                      for e in events if e)
        if out or not more:
            await self._send({**message, "body": out.encode("utf-8", "surrogateescape")})

    async def _send_json(self) -> None:
        body = bytes(self._body)
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            obj[VERSION_FIELD] = self.version
            _rename(obj, self.renamed)
            spans = self.spans() if self.spans is not None else None
            if spans:
                obj[SPANS_FIELD] = spans
            body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        start = self._start or {"type": "http.response.start", "status": 200, "headers": []}
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        self._start = None
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def flush(self) -> None:
        """After the app returned: a JSON start never followed by its last body part (the
        app raised mid-body) is dropped; an SSE remainder without its blank line is sent."""
        if self._mode == "sse" and self._pending:
            rest, self._pending = self._pending, ""
            spans = self.spans() if self.spans is not None else None
            await self._send({"type": "http.response.body",
                              "body": _tag_event(rest, self.version, spans, self.renamed).encode(
                                  "utf-8", "surrogateescape"),
                              "more_body": False})


def _tag_event(event: str, version: int, spans: dict | None = None,
               renamed: tuple[str, str] | None = None) -> str:
    """One SSE event: ``data: {json}`` lines get the version field (and the spans, once a flip
    happened under the request; and the adapter's name for its slot's, ``renamed``); anything
    else is kept."""
    lines = []
    for line in event.split("\n"):
        if line.startswith("data:"):
            payload = line[5:].strip()
            try:
                obj = json.loads(payload) if payload and payload != "[DONE]" else None
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                obj[VERSION_FIELD] = version
                _rename(obj, renamed)
                if spans:
                    obj[SPANS_FIELD] = spans
                line = "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        lines.append(line)
    return "\n".join(lines)


def _slot_renamed(model: str | None) -> tuple[str, str] | None:
    """For a request seated on a version slot of adapter ``model`` other than 0: (the name vLLM
    answers it under, ``model``); else None (``_adapter_slots.SEATED``)."""
    slot = (SEATED.get() or {}).get(model) if model else None
    return (slot_lora_name(model, slot), model) if slot else None


def _rename(obj: dict, renamed: tuple[str, str] | None) -> None:
    if renamed is not None and obj.get("model") == renamed[0]:
        obj["model"] = renamed[1]


def _with_request_id(scope: dict) -> tuple[dict, str]:
    """The request's ``X-Request-Id`` (vLLM names its engine requests after it), one made up
    when the client sent none."""
    headers = list(scope.get("headers", []))
    for k, v in headers:
        if k.lower() == b"x-request-id":
            return scope, v.decode("latin-1")
    request_id = f"ws{uuid.uuid4().hex}"
    headers.append((b"x-request-id", request_id.encode()))
    return {**scope, "headers": headers}, request_id


class _Body:
    """A request's body, read whole before the app sees it (the model it names decides which
    updates it waits for; with kept KV it gets its prefix-cache salt), then handed to the app
    as one message."""

    def __init__(self, raw: bytes, left: dict | None) -> None:
        self.raw = raw
        self.left = left  # the message that ended the read early (the client left), if any
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        self.data = data if isinstance(data, dict) else None

    @classmethod
    async def read(cls, receive: Any) -> _Body:
        chunks, left = [], None
        while True:
            message = await receive()
            if message.get("type") != "http.request":  # the client left: hand that on
                left = message
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        return cls(b"".join(chunks), left)

    def model(self) -> str | None:
        """The ``"model"`` a JSON object body names (None: none, or not a JSON object)."""
        model = self.data.get("model") if self.data is not None else None
        return model if isinstance(model, str) else None

    def asks_prompt_logprobs(self) -> bool:
        """Whether a JSON object body asks vLLM for prompt logprobs: ``prompt_logprobs`` (at the
        top, or in ``sampling_params`` as the token-in/token-out route takes it), or ``echo``
        with ``logprobs`` (completions) or ``top_logprobs`` (chat), as vLLM reads them."""
        d = self.data
        if d is None:
            return False
        if d.get("prompt_logprobs") is not None:
            return True
        if d.get("echo") and (d.get("logprobs") is not None or d.get("top_logprobs") is not None):
            return True
        params = d.get("sampling_params")
        return isinstance(params, dict) and params.get("prompt_logprobs") is not None

    def salt(self, scope: dict, version: int) -> dict:
        """Set ``cache_salt`` in a JSON object body (``UpdateControl.cache_salt_for``: the
        version the request started on, after any salt of its own); -> the scope with its
        ``content-length`` to match. A body that is not a JSON object goes on unchanged (vLLM
        answers it)."""
        if self.data is None:
            return scope
        self.data["cache_salt"] = UpdateControl.cache_salt_for(version, self.data.get("cache_salt"))
        self.raw = json.dumps(self.data).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(self.raw)).encode()))
        return {**scope, "headers": headers}

    def replay(self, receive: Any) -> Any:
        """A ``receive`` that gives the app the body (or the client's leaving), then the
        server's own messages."""
        pending = [self.left] if self.left is not None else [
            {"type": "http.request", "body": self.raw, "more_body": False}]

        async def replayed() -> dict:
            return pending.pop(0) if pending else await receive()

        return replayed


def _header(headers: list, name: bytes) -> str:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1").lower()
    return ""


async def _send_error(send: Any, e: ServiceError, version: int) -> None:
    body = json.dumps({"detail": e.message}).encode()
    await send({"type": "http.response.start", "status": e.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (VERSION_HEADER.encode(), str(version).encode()),
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
