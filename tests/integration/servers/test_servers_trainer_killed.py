"""A trainer process SIGKILLed in the middle of a push, into both servers, over every strategy.

Real processes, real kills: ``_trainer_proc.py`` pushes weights into the shared reward or
policy server (session fixtures) and kills itself with ``os.kill(os.getpid(), SIGKILL)`` from
inside its chunk iterator, after yielding the first, a middle or the last chunk (the send
pipeline then has that chunk prepared and the one before possibly on the wire). Nothing in
weightsync is told; the server sees a sender that vanished (a broken gloo connection, or no
further call: its idle watchdog, 3 s here).

Afterwards, per ``docs/reliability.md``:

* the served version is still v;
* in place (the default): if no byte of the update reached the weights (killed after the first
  chunk was prepared, before it was sent), what is served equals v's weights exactly; otherwise
  the engine is torn and every model route answers 503 "incomplete" (never a mix);
* staged (``staged: true``): what is served equals v's weights exactly, wherever it died;
* the next full push, from another process (this test process: a new session, a new
  communicator and data-plane group), yields v + 1 and serves exactly the new weights.

"What is served" is checked against transformers on the same weights (reward scores; the
policy's prompt logprobs), fp32, within 1e-4.

Trainers killed before or while joining (``weightsync.bench.dead_join``) leave the server's
workers in a rendezvous that never completes: model requests and control routes must not wait
for it (``docs/reliability.md``, section 7).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from weightsync.testing.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "_trainer_proc.py")
BUCKET_MB = 0.05  # ~50 KB: the tiny models (~430 KB) go out in 8-10 chunks
IDLE_S = 3.0
TOL = 1e-4
TEXTS = ["The model is helpful today.", "hi", "def add(a, b):\n    return a + b"]
PROMPTS = ["The model is helpful", "Weights move from the trainer to"]
STRATEGIES = ["broadcast", "cuda_ipc", "packed_cuda_ipc"]
# (where it dies, staged?): in place at the first and a middle chunk, staged at the last one
CASES = [("first", False), ("middle", False), ("last", True)]


class Target:
    """One server, two weight sets (A = its base weights, B = a perturbed copy) and the outputs
    transformers gives for each, plus what the server serves now."""

    def __init__(self, kind: str, handle, tmp) -> None:
        from safetensors.torch import load_file, save_file

        self.kind, self.h = kind, handle
        base = load_file(os.path.join(handle.model_dir, "model.safetensors"))
        g = torch.Generator().manual_seed(7)
        other = {n: t + torch.randn(t.shape, generator=g) * (0.02 if t.dim() > 1 else 0.01)
                 for n, t in base.items()}
        self.weights = {"A": base, "B": other}
        self.files = {}
        for k, w in self.weights.items():
            self.files[k] = str(tmp / f"{kind}-{k}.safetensors")
            save_file(w, self.files[k])
        self.expected = {k: self._reference(w) for k, w in self.weights.items()}
        assert _diff(self.expected["A"], self.expected["B"]) > 100 * TOL  # A and B tell apart

    # -- transformers on given weights ----------------------------------------------------------
    def _reference(self, weights) -> list[float]:
        if self.kind == "reward":
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.h.model_dir)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.h.model_dir, dtype=torch.float32).eval()
            model.load_state_dict(weights, strict=False)
            with torch.no_grad():
                return [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in TEXTS]
        from _policy_ref import Reference

        ref = Reference(self.h.model_dir)
        ref.load(weights)
        return [lp for p in PROMPTS for lp in ref.logprobs(ref.ids(p))]

    # -- what the server serves -----------------------------------------------------------------
    def served(self) -> tuple[int, list[float] | str]:
        if self.kind == "reward":
            r = httpx.post(self.h.url + "/score", json={"input": TEXTS, "normalize": False},
                           timeout=60)
            if r.status_code != 200:
                return r.status_code, r.text
            return 200, [d["score"] for d in r.json()["data"]]
        out: list[float] = []
        for p in PROMPTS:
            r = httpx.post(self.h.url + "/v1/completions", timeout=60, json={
                "model": "tiny-policy", "prompt": p, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0, "return_token_ids": True})
            if r.status_code != 200:
                return r.status_code, r.text
            body = r.json()["choices"][0]
            ids = body["prompt_token_ids"]
            plp = body["prompt_logprobs"]
            out += [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
        return 200, out

    def state(self) -> dict:
        return httpx.get(self.h.url + "/runtime_version", timeout=10).json()

    def push(self, which: str, strategy: str, version: int):
        """A complete push from this process (a new session: a new communicator and group)."""
        import weightsync as ws

        cfg = {"type": strategy, "bucket_size_mb": BUCKET_MB, "timeout_s": 30}
        if strategy == "broadcast":
            cfg["backend"] = "gloo"

        async def go():
            async with ws.connect([self.h.url], strategy=cfg, api_key=self.h.api_key) as sync:
                return await sync.push(self.weights[which], version=version)

        return asyncio.run(go())


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def targets(reward_server, policy_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed-trainer")
    out = {"reward": Target("reward", reward_server, tmp),
           "policy": Target("policy", policy_server, tmp)}
    for t in out.values():  # start from A, whatever earlier tests left
        t.push("A", "broadcast", t.state()["version"] + 1)
        t.current = "A"
        code, got = t.served()
        assert code == 200 and _diff(got, t.expected["A"]) <= TOL, got
    return out


def _kill_trainer(t: Target, which: str, strategy: str, point: str, staged: bool, version: int):
    """Run the trainer until it kills itself at ``point``; returns (chunks, index it died at)."""
    n = _num_chunks(t.weights[which])
    at = {"first": 0, "middle": n // 2, "last": n - 1}[point]
    cmd = [sys.executable, TRAINER, t.h.url, t.files[which], "--api-key", t.h.api_key,
           "--strategy", strategy, "--version", str(version), "--bucket-mb", str(BUCKET_MB),
           "--die-after", str(at), "--idle-timeout-s", str(IDLE_S), "--timeout-s", "10"]
    if staged:
        cmd.append("--staged")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert f"CHUNKS {n}" in proc.stdout and f"DYING {at}" in proc.stdout, proc.stdout
    return n, at


def _num_chunks(weights) -> int:
    from weightsync.pipeline import make_chunks

    return len(list(make_chunks(weights.items(), bucket_size_mb=BUCKET_MB)))


#: the logger of the server's control plane (its lines say how an update started and ended;
#: the workers log lines of their own about the same update)
CONTROL = r"weightsync\.servers\.control"
#: after the kill, how long the server may still be taking the dead trainer's start call: a
#: request sent in full before the kill is still served (seen: a start handled after the kill
#: on a loaded 2-core CI box); no start logged by then: it never reached the server
START_GRACE_S = 5.0


def _log_size(t: Target) -> int:
    path = getattr(t.h.process, "log_path", None)
    return os.path.getsize(path) if path else 0


def _log_since(t: Target, offset: int) -> str | None:
    path = getattr(t.h.process, "log_path", None)
    if not path:
        return None  # a server started by hand (WEIGHTSYNC_TEST_*_SERVER): no log to read
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _settled(t: Target, since: int, version: int, timeout_s: float = IDLE_S + 20) -> dict:
    """The server's state once the dead trainer's update to ``version`` has ended (aborted by
    the server or refused), read from the server's log written after offset ``since``; when no
    start of it shows up within ``START_GRACE_S``, once nothing is in progress. The dead
    trainer's calls can reach the server after it died, so "nothing in progress" alone may be
    read before the update began. Adds ``"ended"``: the log line that ended it (or None)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        log = _log_since(t, since)
        ended = start = None
        if log is not None:
            start = re.search(rf"{CONTROL}[^\n]*: update (\w+) started: version {version - 1} -> "
                              rf"{version}\b", log)
            uid = start[1] if start else r"\w+"
            end = re.search(rf"{CONTROL}[^\n]*: update {uid} (?:aborted|refused|did not land)"
                            rf"[^\n]*", log)
            ended = end[0] if end else None
        state = t.state()
        if state["update_in_progress"] is None and (
                ended or log is None or (not start and time.monotonic() - t0 > START_GRACE_S)):
            return {**state, "ended": ended}
        assert time.monotonic() < deadline, f"the dead trainer's update never ended: {state}"
        time.sleep(0.2)


@pytest.mark.parametrize("point,staged", CASES, ids=[f"{p}-{'staged' if s else 'in_place'}"
                                                     for p, s in CASES])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("server", ["reward", "policy"])
def test_trainer_sigkilled_mid_push(targets, server, strategy, point, staged):
    t = targets[server]
    v = t.state()["version"]
    old, new = t.current, ("B" if t.current == "A" else "A")
    t0 = time.monotonic()
    since = _log_size(t)
    n, at = _kill_trainer(t, new, strategy, point, staged, v + 1)
    assert n >= 6
    state = _settled(t, since, v + 1)
    settle_s = time.monotonic() - t0
    assert state["version"] == v, state
    code, got = t.served()
    # in place, killed after a middle chunk: the chunks before it were on their way, and
    # normally reached the weights (torn); if none did, the server says it serves v
    # unchanged, and what it serves must then be v's weights exactly
    unchanged = state["state"] == "ready"
    if staged or point == "first" or unchanged:
        # nothing of the update reached the weights: v's weights exactly
        assert state["state"] == "ready", state
        assert code == 200 and _diff(got, t.expected[old]) <= TOL, (code, got)
    else:
        # in place, after bytes landed: torn, refused with the reason, never a mix
        assert state["state"] == "torn", state
        assert code == 503 and "incomplete" in str(got), (code, got)
    # the next complete push from another process lands whole
    stats = t.push(new, strategy, v + 1)
    assert stats.versions == [v + 1]
    state = t.state()
    assert (state["version"], state["state"]) == (v + 1, "ready"), state
    code, got = t.served()
    assert code == 200 and _diff(got, t.expected[new]) <= TOL, (code, got)
    t.current = new
    print(f"{server}/{strategy}/{point}: died after chunk {at} of {n}; settled in "
          f"{settle_s:.1f}s, {'unchanged' if unchanged else 'torn'}")


@pytest.mark.parametrize("server", ["reward", "policy"])
def test_trainer_stopped_mid_push_the_server_gives_up_in_time_and_takes_the_next_sender(
    targets, server
):
    """A stuck trainer (SIGSTOP: alive, holding its connections, silent): the server's workers
    give up within the trainer's timeouts (a collective's 3 s, or 3 s without a call), name the
    phase and the peer in the reason they report, and the next sender gets a new communicator and
    a complete sync without a restart."""
    t = targets[server]
    v = t.state()["version"]
    new = "B" if t.current == "A" else "A"
    n = _num_chunks(t.weights[new])
    cmd = [sys.executable, TRAINER, t.h.url, t.files[new], "--api-key", t.h.api_key,
           "--strategy", "broadcast", "--version", str(v + 1), "--bucket-mb", str(BUCKET_MB),
           "--die-after", str(n // 2), "--signal", "STOP", "--idle-timeout-s", str(IDLE_S),
           "--timeout-s", "3"]
    since = _log_size(t)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while f"DYING {n // 2}" not in (line := proc.stdout.readline()):
            assert line and time.monotonic() < deadline, "the trainer never reached its stop"
        t0 = time.monotonic()
        state = _settled(t, since, v + 1)
        gave_up_s = time.monotonic() - t0
        assert proc.poll() is None  # still there, stopped: a hung peer, not a dead one
    finally:
        proc.kill()
        proc.wait(10)
    assert gave_up_s < 3 + 3 + 5, gave_up_s
    assert state["version"] == v and state["state"] == "torn", state
    reason = state["reason"]
    # the phase (a chunk's broadcast or its go/no-go vote, or the wait for the next call) and
    # the peer: the sender
    assert "chunk" in reason and ("the sender (rank 0)" in reason
                                  or "no call from the sender" in reason), reason
    code, got = t.served()
    assert code == 503 and "incomplete" in str(got)
    assert t.push(new, "broadcast", v + 1).versions == [v + 1]
    code, got = t.served()
    assert code == 200 and _diff(got, t.expected[new]) <= TOL
    t.current = new
    print(f"{server}: stopped trainer given up after {gave_up_s:.1f}s: {reason[:200]}")


JOIN_WINDOW_S = 4.0  # how long the model requests run while the workers wait in a dead join
#: ... and the most any of them may take: one answers in ~10 ms, in ~0.3 s at this box's p99
#: under load; before, each waited for the join's timeout (--group-timeout-s, 120 s)
MODEL_REQUEST_MAX_S = 10.0


def _model_requests_while(t: Target, seconds: float) -> list[float]:
    """Model requests back to back for ``seconds``; -> each one's time (all must answer 200)."""
    took = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        code, got = t.served()
        took.append(time.monotonic() - t0)
        assert code == 200 and _diff(got, t.expected[t.current]) <= TOL, (code, got)
    return took


def _control_answers_at_once(t: Target) -> None:
    """Every control route answers while the join waits; an update is refused naming it."""
    auth = {"Authorization": f"Bearer {t.h.api_key}"}
    for method, path, body in [("GET", "/runtime_version", None), ("GET", "/get_world_size", None),
                               ("POST", "/reset_prefix_cache", {"junk": 1}),
                               ("POST", "/get_num_background_tasks", None)]:
        t0 = time.monotonic()
        r = httpx.request(method, t.h.url + path, json=body, headers=auth, timeout=30)
        assert r.status_code == 200 and time.monotonic() - t0 < MODEL_REQUEST_MAX_S, (path, r.text)
    r = httpx.post(t.h.url + "/update_param_batch", headers=auth, timeout=30,
                   json={"metadata": {"type": "start", "update_id": "during-join"}})
    assert r.status_code == 409 and "still joining" in r.json()["detail"], r.text


@pytest.mark.parametrize("server", ["reward", "policy"])
def test_a_trainer_killed_joining_holds_no_model_request(targets, server):
    """A Ludic/TRL trainer asks for a group and is SIGKILLed before it joins (the server's
    workers wait in the rendezvous, for the server's --group-timeout-s), then a sender of our
    dialect is SIGKILLed while the workers join its group. Neither holds the model requests (each
    answers within 10 s, against a whole join timeout, 120 s, before) or the control routes; a
    /close_communicator abandons the waiting join at once; the next sender pushes a complete
    update."""
    from weightsync.bench.dead_join import KilledLudicTrainer, killed_mid_join

    t = targets[server]
    v = t.state()["version"]
    KilledLudicTrainer(t.h.url, t.h.api_key, port=free_port()).start()
    took = _model_requests_while(t, JOIN_WINDOW_S)
    assert max(took) < MODEL_REQUEST_MAX_S, max(took)
    _control_answers_at_once(t)
    t0 = time.monotonic()
    r = httpx.post(t.h.url + "/close_communicator", headers={
        "Authorization": f"Bearer {t.h.api_key}"}, json={}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < MODEL_REQUEST_MAX_S, r.text

    assert "JOINING" in killed_mid_join(t.h.url, t.h.api_key)  # died inside the join
    took = _model_requests_while(t, 1.0)
    assert max(took) < MODEL_REQUEST_MAX_S, max(took)
    new = "B" if t.current == "A" else "A"
    assert t.push(new, "broadcast", v + 1).versions == [v + 1]
    code, got = t.served()
    assert code == 200 and _diff(got, t.expected[new]) <= TOL, (code, got)
    t.current = new
