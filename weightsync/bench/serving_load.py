"""Model requests while weights change: concurrent scoring and generation clients against the
reward and the policy server, every answer recorded with the version that produced it.

Callers (in the trainer's / test's process): ``benchmarks/bench_load_during_syncs.py``
(latency p50 / p99 with and without syncs) and
``tests/integration/servers/test_servers_load_during_syncs.py`` (no failed request, every
answer's version matches the weights that produced it). Each client is a thread with its own
HTTP connection that sends one request after the other until stopped:

* a scorer: ``POST /score`` of fixed texts (raw logits) on the reward server; the version is the
  body's ``version``;
* a generator: ``POST /v1/completions`` of a fixed prompt (greedy, ``max_tokens`` tokens, the
  prompt's logprobs) on the policy server; the version is the ``x-weight-version`` header, which
  must equal the body's ``weight_version``.

A request that does not answer 200 (or raises) is recorded with its status and error, never
retried: the caller counts failures.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

SCORE_TEXTS = ["The model is helpful today.", "hi", "def add(a, b):\n    return a + b"]
PROMPT = "The model is helpful"


@dataclass
class Outcome:
    """One request: which client, when it started (monotonic), how long it took, what came."""

    kind: str  # "score" or "generate"
    client: int
    started: float
    seconds: float
    status: int
    version: int | None = None
    values: list[float] = field(default_factory=list)  # scores, or the prompt's logprobs
    tokens: list[int] = field(default_factory=list)  # generated token ids
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def score_once(http: Any, client: int, texts: list[str]) -> Outcome:
    t0 = time.monotonic()
    try:
        r = http.post("/score", json={"input": texts, "normalize": False})
        out = Outcome("score", client, t0, time.monotonic() - t0, r.status_code)
        if r.status_code != 200:
            out.error = r.text[:300]
            return out
        body = r.json()
        out.version = int(body["version"])
        out.values = [float(d["score"]) for d in body["data"]]
        return out
    except Exception as e:  # noqa: BLE001 - a failed request is an outcome, counted by the caller
        return Outcome("score", client, t0, time.monotonic() - t0, 0,
                       error=f"{type(e).__name__}: {e}")


def generate_once(http: Any, client: int, prompt: str, max_tokens: int,
                  model: str = "tiny-policy") -> Outcome:
    t0 = time.monotonic()
    try:
        r = http.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "prompt_logprobs": 0, "return_token_ids": True, "ignore_eos": True})
        out = Outcome("generate", client, t0, time.monotonic() - t0, r.status_code)
        if r.status_code != 200:
            out.error = r.text[:300]
            return out
        body = r.json()
        header = r.headers.get("x-weight-version")
        out.version = int(header) if header is not None else None
        if body.get("weight_version") != out.version:
            out.error = (f"x-weight-version {header} but the body says "
                         f"{body.get('weight_version')}")
        choice = body["choices"][0]
        ids, plp = choice["prompt_token_ids"], choice["prompt_logprobs"]
        out.values = [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
        out.tokens = list(choice.get("token_ids") or [])
        return out
    except Exception as e:  # noqa: BLE001
        return Outcome("generate", client, t0, time.monotonic() - t0, 0,
                       error=f"{type(e).__name__}: {e}")


class LoadRunner:
    """``scorers`` threads on ``reward_url`` and ``generators`` threads on ``policy_url``, each
    sending requests back to back from ``start()`` until ``stop()``, which returns every
    outcome in start order."""

    def __init__(
        self, *, reward_url: str | None = None, policy_url: str | None = None,
        scorers: int = 4, generators: int = 4, texts: list[str] | None = None,
        prompt: str = PROMPT, max_tokens: int = 4, model: str = "tiny-policy",
        timeout_s: float = 300.0,
    ) -> None:
        self.reward_url, self.policy_url = reward_url, policy_url
        self.scorers = scorers if reward_url else 0
        self.generators = generators if policy_url else 0
        self.texts = list(texts or SCORE_TEXTS)
        self.prompt, self.max_tokens, self.model = prompt, max_tokens, model
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._outcomes: list[Outcome] = []
        self._lock = threading.Lock()

    def start(self) -> LoadRunner:
        for i in range(self.scorers):
            self._spawn("score", i)
        for i in range(self.generators):
            self._spawn("generate", i)
        return self

    def _spawn(self, kind: str, i: int) -> None:
        t = threading.Thread(target=self._loop, args=(kind, i), name=f"load-{kind}-{i}",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def _loop(self, kind: str, i: int) -> None:
        import httpx

        url = self.reward_url if kind == "score" else self.policy_url
        with httpx.Client(base_url=url, timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                if kind == "score":
                    out = score_once(http, i, self.texts)
                else:
                    out = generate_once(http, i, self.prompt, self.max_tokens, self.model)
                with self._lock:
                    self._outcomes.append(out)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        with self._lock:
            return sorted(self._outcomes, key=lambda o: o.started)


def latency_summary(outcomes: list[Outcome]) -> dict[str, float]:
    """``{n, failed, p50_ms, p99_ms, max_ms, rps}`` of the answered requests."""
    ok = sorted(o.seconds for o in outcomes if o.ok)
    if not ok:
        return {"n": 0, "failed": len(outcomes), "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0,
                "rps": 0.0}
    span = (max(o.started + o.seconds for o in outcomes) - min(o.started for o in outcomes))
    return {
        "n": len(ok), "failed": sum(not o.ok for o in outcomes),
        "p50_ms": 1000 * statistics.median(ok),
        "p99_ms": 1000 * ok[min(len(ok) - 1, int(round(0.99 * (len(ok) - 1))))],
        "max_ms": 1000 * ok[-1],
        "rps": len(ok) / span if span > 0 else 0.0,
    }
