"""Property-based fuzzing of every HTTP route of the reward server and the policy server (the
shared session servers), with time checked too: 0 answers with a 5xx, 0 requests that take 10 s
or more, every rejection a 4xx whose body says what was wrong, the server alive afterwards and
serving exactly what transformers computes for its weights.

Hypothesis draws the requests: a route (every route each server serves: our control plane in
both dialects, ours and the Ludic/TRL trainers' (``{host, port, world_size}`` at the server's
exact group size, so the workers really start joining; the ``{metadata: [...]}`` batch;
``/batch_ready``), the reward server's ``/score``, vLLM's OpenAI routes on the policy server,
``/health`` and the rest, plus paths and methods that do not exist), headers (the right token,
none, a wrong one, a malformed one) and a body: a mutation of a valid body for that route (keys
dropped, values of the wrong type, out-of-range numbers, NaN, unknown keys, nested junk), any
JSON value, or bytes that are not JSON at all. Derandomized (the same ``REQUESTS`` requests every
run) and without a database, so CI draws exactly what ran here. They are drawn first, then sent
by ``WORKERS`` threads at once (the fuzz stays cheap in CI, and requests meet each other: a
join under way, an update holding the gate, model requests waiting for it).

What the fuzz changes so that it tests the servers, not its own long waits: a broadcast
``sync_info`` asks for at most 0.5 s of join and collective time (``/init_communicator`` answers
when the join ended, after the timeout the caller chose); a Ludic group's port is one of a few
free ports of this machine (the workers bind it and wait there for a trainer; a port in 1..9
would let a broadcast ``sync_info`` of the fuzz reach that store). A request that starts an
update is followed by ``/close_communicator`` so the update gate does not hold the fuzzed model
requests back for a minute.

Before: the server gets its base weights back (``restore``). After: it still serves
(``/health``), no update is open, and a score / completion equals transformers on the base
weights (fp32, 1e-4): no fuzzed request changed a weight (the version may have risen: a start
and a finish of zero chunks from two threads are a complete update that carries no tensor).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from weightsync.testing.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REQUESTS = int(os.environ.get("WEIGHTSYNC_FUZZ_REQUESTS", "5000"))
WORKERS = 8  # requests in flight at once
SLOW_S = 10.0  # no request may take this long
MAX_FAILURES = 20  # then the rest is not sent
TOL = 1e-4

# -- bodies -----------------------------------------------------------------------------------------

EXTREME = st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
                           10**30, -(10**30), 1e308, -0.0, 0.5, float("nan"), float("inf")])
NUMBERS = st.one_of(
    st.integers(min_value=-3, max_value=8),
    EXTREME,
    st.floats(allow_nan=True, allow_infinity=True),
)
TEXT = st.text(max_size=12)
JSON_LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


DEEP = [b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
        b'{"metadata": ' + b"[" * 40 + b"]" * 40 + b"}"]


def kin(value) -> st.SearchStrategy:
    """Something of ``value``'s kind (any int for an int, ...), including the extremes."""
    if isinstance(value, bool):
        return st.one_of(st.booleans(), EXTREME)
    if isinstance(value, (int, float)):
        return st.one_of(NUMBERS, EXTREME)
    if isinstance(value, str):
        return st.one_of(TEXT, st.just(value.upper()), st.just(value * 3), st.just(""))
    if isinstance(value, list):
        return st.lists(kin(value[0]) if value else JSON_ANY, max_size=4)
    return JSON_ANY


def _paths(value, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def near(draw, template: dict) -> dict:
    """``template`` with 0 to 3 targeted mutations: a value (anywhere in the tree) replaced by
    one of its kind or by any JSON, a key or item dropped, an unknown key added. Most bodies are
    one mutation away from valid, so the deep paths (a start that is accepted, a chunk that
    reaches the workers) are exercised, not only the first check."""
    value = json.loads(json.dumps(template))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        paths = _paths(value)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = value
        for p in path[:-1]:
            parent = parent[p]
        old = parent[path[-1]]
        op = draw(st.sampled_from(["kin", "kin", "any", "drop", "add"]))
        if op == "drop":
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(TEXT)] = draw(JSON_LEAF)
        else:
            parent[path[-1]] = draw(kin(old) if op != "any" else JSON_ANY)
    return value


def body_for(templates: list[dict]) -> st.SearchStrategy:
    """A body for a route: JSON near one of its valid shapes (most of the time), any JSON, or
    not JSON."""
    near_one = st.sampled_from(templates).flatmap(near).map(_json)
    return st.one_of(
        near_one, near_one, near_one, near_one,
        JSON_ANY.map(_json),
        st.binary(max_size=40).map(lambda b: ("raw", b)),
        st.sampled_from([b"", *DEEP]).map(lambda b: ("raw", b)),
    )


def _json(value) -> tuple[str, object]:
    return ("json", value)


# valid-looking bodies of our control plane (the fuzz mutates them)
MANIFEST = [{"name": "model.norm.weight", "dtype": "float32", "shape": [64]}]
CONTROL = {
    ("POST", "/init_communicator"): [
        {"strategy": {"type": "cuda_ipc", "timeout_s": 5}, "sync_info": {"type": "empty"},
         "rank_offset": 1},
        {"strategy": {"type": "broadcast", "backend": "gloo"},
         "sync_info": {"type": "torch_distributed", "master_addr": "127.0.0.1",
                       "master_port": 9, "world_size": 2, "join_timeout_s": 0.2,
                       "timeout_s": 0.2}},
        {"host": "127.0.0.1", "port": 9, "world_size": 2, "backend": "gloo"},
    ],
    ("POST", "/update_param_batch"): [
        {"metadata": {"type": "start", "update_id": "u", "manifest": MANIFEST,
                      "staged": True, "idle_timeout_s": 5}, "training_mode": "full"},
        {"metadata": {"type": "start", "update_id": "u", "version": 2**40, "manifest": None,
                      "head_name_patterns": ["score."], "extras": {"k": [1]}}},
        {"metadata": {"type": "cuda_ipc", "update_id": "u", "names": ["model.norm.weight"],
                      "dtypes": ["float32"], "shapes": [[64]], "chunk_index": 0,
                      "handles": [{"kind": "shm", "nbytes": 256, "name": "ws_x"}],
                      "checksums": [1]}, "communicator_id": 1},
        {"metadata": {"type": "packed_cuda_ipc", "update_id": "u", "names": ["a"],
                      "dtypes": ["bfloat16"], "shapes": [[2, 3]], "buffers": [
                          {"kind": "shm", "nbytes": 12, "name": "ws_y"}],
                      "buffer_index": [0], "offsets": [0]}},
        {"metadata": {"type": "broadcast", "update_id": "u", "names": ["a"],
                      "dtypes": ["float32"], "shapes": [[1]], "src_rank": 0}},
        {"metadata": {"type": "finish", "update_id": "u", "num_chunks": 1, "ok": True}},
        {"metadata": MANIFEST, "version": 3, "training_mode": "head_only"},
    ],
    ("POST", "/close_communicator"): [{"communicator_id": 1}, {}],
    ("POST", "/get_num_background_tasks"): [{}],
    ("POST", "/reset_prefix_cache"): [{}, {"junk": [1, 2]}],
    ("GET", "/runtime_version"): [{}],
    ("GET", "/get_world_size"): [{}],
    ("GET", "/health"): [{}],
}
REWARD = {
    ("POST", "/score"): [
        {"input": ["hi", "ok"], "normalize": False},
        {"model": "reward-model", "input": "a", "pooling_type": "last", "normalize": True,
         "return_hidden_states": False, "n_labels": 1},
        {"input": "a <|step|> b", "pooling_type": "step", "step_tag": "<|step|>"},
    ],
}
CHAT = [{"role": "user", "content": "hi"}]
POLICY = {
    ("POST", "/v1/completions"): [
        {"model": "tiny-policy", "prompt": "hi", "max_tokens": 2, "temperature": 0,
         "logprobs": 1, "stop": ["x"], "n": 1, "seed": 1, "echo": True},
        {"model": "tiny-policy", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True,
         "prompt_logprobs": 0, "return_token_ids": True},
    ],
    ("POST", "/v1/chat/completions"): [
        {"model": "tiny-policy", "messages": CHAT, "max_tokens": 2, "temperature": 0.5,
         "top_p": 0.9, "logprobs": True, "top_logprobs": 2},
        {"model": "tiny-policy", "messages": CHAT, "max_completion_tokens": 2, "stream": True,
         "stream_options": {"include_usage": True}},
    ],
    ("POST", "/v1/chat/completions/batch"): [{"model": "tiny-policy", "messages": [CHAT],
                                              "max_tokens": 2}],
    ("POST", "/v1/responses"): [{"model": "tiny-policy", "input": "hi", "max_output_tokens": 2}],
    ("GET", "/v1/responses/resp_x"): [{}],
    ("POST", "/v1/responses/resp_x/cancel"): [{}],
    ("POST", "/v1/messages"): [{"model": "tiny-policy", "max_tokens": 2, "messages": CHAT}],
    ("POST", "/v1/messages/count_tokens"): [{"model": "tiny-policy", "messages": CHAT}],
    ("POST", "/tokenize"): [{"model": "tiny-policy", "prompt": "hi"},
                            {"model": "tiny-policy", "messages": CHAT}],
    ("POST", "/detokenize"): [{"model": "tiny-policy", "tokens": [1, 2, 3]}],
    ("POST", "/invocations"): [{"model": "tiny-policy", "prompt": "hi", "max_tokens": 2}],
    ("POST", "/generative_scoring"): [{"model": "tiny-policy", "query": "q", "items": ["a"],
                                       "label_token_ids": [1, 2]}],
    ("POST", "/v1/systemone"): [{"state": {}, "questions": []}],
    ("POST", "/ping"): [{}],
    ("GET", "/ping"): [{}],
    ("GET", "/v1/models"): [{}],
    ("GET", "/load"): [{}],
    ("GET", "/version"): [{}],
    ("GET", "/kv_event_sources"): [{}],
    ("GET", "/metrics"): [{}],
    ("POST", "/scale_elastic_ep"): [{"new_data_parallel_size": 1, "drain_timeout": 1}],
    ("POST", "/is_scaling_elastic_ep"): [{}],
}
ODD_PATHS = ["/", "/nope", "/v1", "/score/x", "/update_param_batch/", "/batch_ready/",
             "/%2e%2e/etc/passwd", "/health?x=1", "/v1/completions/../health"]


@st.composite
def requests(draw, routes: dict, api_key: str) -> tuple[str, str, dict, tuple[str, object]]:
    kind = draw(st.sampled_from(["route", "route", "route", "route", "batch_ready", "odd"]))
    if kind == "batch_ready":
        method, path = "GET", "/batch_ready/" + urllib.parse.quote(draw(st.text(
            st.characters(blacklist_categories=("Cs",)), max_size=12)), safe="")
        body = ("raw", b"")
    elif kind == "odd":
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
        path = draw(st.sampled_from(ODD_PATHS + [p for _, p in routes]))
        body = draw(body_for([{}]))
    else:  # routes with several body shapes are drawn that much more often
        method, path, template = draw(st.sampled_from(
            [(m, p, t) for (m, p), ts in sorted(routes.items()) for t in ts]))
        body = draw(body_for([template]))
    auth = draw(st.sampled_from(["token", "token", "token", "none", "wrong", "x-api-key",
                                 "malformed"]))
    headers = {"token": {"Authorization": f"Bearer {api_key}"}, "none": {},
               "wrong": {"Authorization": "Bearer not-the-key"},
               "x-api-key": {"X-API-Key": api_key},
               "malformed": {"Authorization": draw(st.text(
                   st.characters(min_codepoint=33, max_codepoint=126), min_size=1,
                   max_size=20))}}[auth]
    return method, path, headers, body


def _send(http: httpx.Client, method: str, path: str, headers: dict, body) -> httpx.Response:
    kind, value = body
    if kind == "json":
        content = json.dumps(value, allow_nan=True).encode()
        headers = {**headers, "Content-Type": "application/json"}
    else:
        content = value
    return http.request(method, path, headers=headers, content=content if method != "GET" else None)


#: Ludic groups meet on these (free) ports; see the module docstring
LUDIC_PORTS = [free_port() for _ in range(3)]


def _safe(value):
    """Keep the fuzz from waiting on itself (see the module docstring)."""
    if not isinstance(value, dict):
        return value
    port = value.get("port")
    if {"host", "port", "world_size"} <= set(value) and isinstance(port, int) and not isinstance(
            port, bool) and 0 < port < 65536:
        value = {**value, "port": LUDIC_PORTS[port % len(LUDIC_PORTS)]}
    info = value.get("sync_info")
    if isinstance(info, dict):
        info = dict(info)
        for key in ("join_timeout_s", "timeout_s"):
            v = info.get(key, 1.0)  # a dropped timeout means the default: tens of seconds
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (
                    math.isfinite(v) and v > 0.5):
                info[key] = 0.5
        value = {**value, "sync_info": info}
    return value


def _problem(r: httpx.Response) -> str:
    """What is wrong with an answer, or "" (no 5xx; an error says why, as JSON)."""
    if r.status_code >= 500:
        return "a 5xx"
    if r.status_code < 400:
        return ""
    try:
        body = r.json()
    except ValueError:
        return "an error without a JSON reason"
    reason = body.get("detail") if isinstance(body, dict) else None
    if reason is None and isinstance(body, dict) and isinstance(body.get("error"), dict):
        reason = body["error"].get("message")
    return "" if reason else "an error without a reason"


class Fuzzer:
    """Sends drawn requests from many threads; records every status, every request's time and
    every answer that breaks the rules."""

    def __init__(self, server, routes: dict) -> None:
        self.server = server
        self.routes = routes
        self.auth = {"Authorization": f"Bearer {server.api_key}"}
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.by_route: dict[str, dict[int, int]] = {}
        self.slowest: tuple[float, str] = (0.0, "")
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def http(self) -> httpx.Client:
        http = getattr(self._local, "http", None)
        if http is None:  # one connection per thread
            http = self._local.http = httpx.Client(base_url=self.server.url,
                                                   timeout=SLOW_S + 20)
        return http

    def send(self, method, path, headers, body) -> httpx.Response | None:
        """One request, timed and checked; None if it got no answer."""
        what = f"{method} {path} {str(body)[:300]}"
        t0 = time.monotonic()
        try:
            r = _send(self.http, method, path, headers, body)
        except httpx.HTTPError as e:
            r, problem = None, f"no answer ({type(e).__name__}: {e})"
        else:
            problem = _problem(r)
        seconds = time.monotonic() - t0
        with self._lock:
            self.sent += 1
            self.slowest = max(self.slowest, (seconds, what))
            if seconds >= SLOW_S:
                problem = problem or f"took {seconds:.1f}s"
            if r is not None:
                self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
                seen = self.by_route.setdefault(f"{method} {path.split('?')[0]}", {})
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
            if problem:
                text = "" if r is None else f" -> {r.status_code}: {r.text[:300]}"
                self.failures.append(f"{problem}: {what}{text}")
        return r

    def one(self, request) -> None:
        if len(self.failures) >= MAX_FAILURES:
            return  # the server is broken: the report has enough, do not wait on it any more
        method, path, headers, body = request
        if body[0] == "json":
            body = ("json", _safe(body[1]))
            self._prepare(path, body[1])
        self.send(method, path, headers, body)
        if path == "/update_param_batch":
            # an update started (or a Ludic batch): end it, so the gate does not hold the rest
            self.send("POST", "/close_communicator", self.auth, ("json", {}))

    def _prepare(self, path: str, body) -> None:
        """A chunk needs receivers and a running update to get past the first check: give it
        both (an IPC communicator and a start of its update id), so the fuzzed chunk reaches
        the workers' parsing and the endpoint (best effort: other threads change the state
        meanwhile)."""
        meta = body.get("metadata") if isinstance(body, dict) else None
        if path != "/update_param_batch" or not isinstance(meta, dict) or meta.get("type") in (
                "start", "finish", None):
            return
        kind = meta.get("type") if meta.get("type") in ("cuda_ipc", "packed_cuda_ipc") else (
            "cuda_ipc")
        self.send("POST", "/init_communicator", self.auth, ("json", {
            "strategy": {"type": kind}, "sync_info": {"type": "empty"}}))
        uid = meta.get("update_id") if isinstance(meta.get("update_id"), str) else "u"
        self.send("POST", "/update_param_batch", self.auth, ("json", {
            "metadata": {"type": "start", "update_id": uid}}))

    def run(self, requests: list) -> None:
        pool = ThreadPoolExecutor(WORKERS)
        try:
            list(pool.map(self.one, requests))
        finally:  # interrupted: requests not sent yet are dropped, not waited for
            pool.shutdown(cancel_futures=True)
        self.send("POST", "/close_communicator", self.auth, ("json", {}))

    def oversized(self) -> None:
        """One body past the 16 MiB limit: 413 with a reason, before the rest is read."""
        r = self.send("POST", "/update_param_batch", {**self.auth,
                                                      "Content-Type": "application/json"},
                      ("raw", b"{" + b" " * (17 << 20) + b"}"))
        assert r is not None and r.status_code == 413 and "limit" in r.json()["detail"]


def _draw(routes: dict, api_key: str) -> list:
    """``REQUESTS`` requests, the same ones every run."""
    drawn: list = []

    @settings(max_examples=REQUESTS, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(requests(routes, api_key))
    def collect(request):
        drawn.append(request)

    collect()
    return drawn


def _report(what: str, fuzzer: Fuzzer, seconds: float) -> None:
    print(f"{what}: {fuzzer.sent} requests in {seconds:.0f}s ({WORKERS} at a time), slowest "
          f"{fuzzer.slowest[0]:.2f}s ({fuzzer.slowest[1][:120]}), statuses "
          f"{dict(sorted(fuzzer.statuses.items()))}")
    for route, statuses in sorted(fuzzer.by_route.items()):
        if route.split()[1] in {p for _, p in fuzzer.routes}:
            print(f"  {route}: {dict(sorted(statuses.items()))}")


def _fuzz(server, routes: dict, what: str, probe, expected: list[float]) -> None:
    """Fuzz ``server`` on ``routes`` (it serves its base weights: ``expected`` is what
    transformers gives for ``probe``); afterwards ``probe(http)`` must still equal it and the
    server must still serve."""
    server.restore()
    http = httpx.Client(base_url=server.url, timeout=60)
    version = http.get("/runtime_version").json()["version"]
    assert probe(http) == pytest.approx(expected, abs=TOL)
    drawn = _draw(routes, server.api_key)
    fuzzer = Fuzzer(server, routes)
    t0 = time.monotonic()
    fuzzer.run(drawn)
    fuzzer.oversized()
    _report(what, fuzzer, time.monotonic() - t0)
    assert not fuzzer.failures, (f"{len(fuzzer.failures)} of {fuzzer.sent} requests broke the "
                                 f"rules; the first ones:\n" + "\n".join(fuzzer.failures[:10]))
    assert fuzzer.sent >= REQUESTS, fuzzer.sent
    assert {200, 400, 401, 404, 409} <= set(fuzzer.statuses)  # every kind of answer was seen
    state = http.get("/runtime_version").json()
    assert state["update_in_progress"] is None and state["state"] == "ready", state
    # versions only rise; one may have: a fuzzed start and a fuzzed finish of zero chunks, sent
    # by two threads, make a complete update that carries no tensor (the weights stay the same)
    assert state["version"] >= version, state
    assert http.get("/health").status_code == 200
    assert probe(http) == pytest.approx(expected, abs=TOL)  # right after: transformers' answer


TEXTS = ["The model is helpful.", "hi"]
PROMPT = "The model is helpful"


def _scores(http: httpx.Client) -> list[float]:
    r = http.post("/score", json={"input": TEXTS, "normalize": False})
    assert r.status_code == 200, r.text
    return [d["score"] for d in r.json()["data"]]


def _reference_scores(model_dir: str) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in TEXTS]


def _prompt_logprobs(http: httpx.Client) -> list[float]:
    r = http.post("/v1/completions", json={
        "model": "tiny-policy", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, plp = choice["prompt_token_ids"], choice["prompt_logprobs"]
    return [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def test_fuzz_reward_server(reward_server):
    _fuzz(reward_server, {**CONTROL, **REWARD}, "reward server", _scores,
          _reference_scores(reward_server.model_dir))


def test_fuzz_policy_server(policy_server):
    from _policy_ref import Reference

    ref = Reference(policy_server.model_dir)
    _fuzz(policy_server, {**CONTROL, **POLICY}, "policy server", _prompt_logprobs,
          ref.logprobs(ref.ids(PROMPT)))
