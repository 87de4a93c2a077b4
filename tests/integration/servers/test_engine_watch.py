"""vLLM's engine core SIGKILLed under a running server (``weightsync.servers._engine_watch``):
the server says so everywhere and exits non-zero within seconds, as ``vllm serve`` does.

Real servers (vLLM CPU, tiny models), real kills: the engine core is found as a child process of
the server (``VLLM::EngineCore``) and killed with SIGKILL. Three cases, one server start each:

* the policy server with completions in flight (two streamed, two not): they get vLLM's own
  500 "EngineCore encountered an issue" (in the stream, once it started);
* the reward server idle: nothing runs into the dead engine, the watch alone finds it; what
  arrives before the server is gone (``/score``, a control route) gets 503 naming the death;
* the policy server in the middle of an update from ``ws.connect(...)``, a chunk call of it
  waiting in the engine (the engine core is SIGSTOPped first, so the call is surely in flight
  when it dies) and a completion waiting behind the update: the push raises
  ``EngineDiedError`` naming the dead engine core long before its timeout, the completion gets
  vLLM's 500.

Each case also polls ``/runtime_version`` and ``/health`` from before the kill until the server
stops answering: once the engine core is dead (the kernel says so), no answer says ``ready``;
answers are 503 with ``state: "engine_dead"``. The server's exit code is 1, and its log has one
line naming the engine core's pid and exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from weightsync.errors import EngineDiedError
from weightsync.testing.servers import PolicyServerProcess, RewardServerProcess, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SMALL = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
         "--log-level", "info"]
POLICY = [*SMALL, "--served-model-name", "tiny-policy", "--seed", "0", "--no-warmup"]
REWARD = [*SMALL, "--no-warmup"]
#: the most a server may take from its engine core's death to its exit (it checks every 0.5 s;
#: the rest is a loaded 2-core machine)
EXIT_WITHIN_S = 15.0
DEAD_TEXT = "vLLM's engine core died"
VLLM_DEAD_TEXT = "EngineCore encountered an issue"
LONG = {"model": "tiny-policy", "prompt": "Once upon a time", "max_tokens": 200,
        "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from weightsync.testing.tiny_models import build_tiny_causal_lm, build_tiny_reward_model

    root = tmp_path_factory.mktemp("engine-watch")
    return {"policy": build_tiny_causal_lm(root / "policy", family="llama",
                                           tie_word_embeddings=True, seed=0),
            "reward": build_tiny_reward_model(root / "reward", seed=0)}


@contextlib.contextmanager
def _server(cls: type[ServerProcess], model: str, args: list[str], log_path: str):
    server = cls(model, extra_args=args, log_path=log_path).start_healthy(timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


def _engine_core(server: ServerProcess) -> psutil.Process:
    cores = [c for c in psutil.Process(server.pid).children(recursive=True)
             if "EngineCore" in c.name()]
    assert len(cores) == 1, cores
    return cores[0]


def _kill(core: psutil.Process) -> float:
    """SIGKILL ``core``; -> the moment the kernel has it dead: gone, or a zombie whose threads
    have all exited (its main thread turns zombie first, and its parent can only reap it, or
    see it dead, once the last one is gone)."""
    core.send_signal(signal.SIGKILL)
    while True:
        try:
            if (core.status() == psutil.STATUS_ZOMBIE
                    and len(os.listdir(f"/proc/{core.pid}/task")) <= 1):
                break
        except (psutil.NoSuchProcess, FileNotFoundError):
            break
        time.sleep(0.002)
    return time.monotonic()


class Poller:
    """Threads that ask ``paths`` (``(method, path)``) over and over until the server stops
    answering, each answer kept as ``(path, sent at, status, JSON body or text)``."""

    def __init__(self, url: str, paths: list[tuple[str, str]]) -> None:
        self.url = url
        self.answers: list[tuple[str, float, int, object]] = []
        self._threads = [threading.Thread(target=self._ask, args=p, daemon=True) for p in paths]
        self._gone = threading.Event()

    def __enter__(self) -> Poller:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._gone.set()
        for t in self._threads:
            t.join(30)

    def _ask(self, method: str, path: str) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._gone.is_set():
                sent = time.monotonic()
                try:
                    r = http.request(method, self.url + path, json={} if method == "POST" else None)
                except httpx.ConnectError:
                    if self._gone.is_set() or self.answers:  # not answering any more
                        return
                    continue
                except httpx.HTTPError:  # a connection the stopping server closed
                    continue
                try:
                    body: object = r.json()
                except ValueError:
                    body = r.text
                self.answers.append((path, sent, r.status_code, body))
                time.sleep(0.01)

    def wait_answered(self, n_paths: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len({a[0] for a in self.answers}) < n_paths:
            assert time.monotonic() < deadline, self.answers[-5:]
            time.sleep(0.05)

    def after(self, t_dead: float) -> list[tuple[str, int, object]]:
        """The answers to what was sent after ``t_dead`` (each with its delay after it)."""
        return [(p, status, body, round(sent - t_dead, 4)) for p, sent, status, body
                in self.answers if sent > t_dead]


def _assert_dead_answers(answers: list[tuple]) -> None:
    """Every answer ``(path, status, body, ...)`` given after the death says the engine is
    dead: ``/runtime_version`` 503 ``engine_dead`` (never ``ready``), ``/health`` 503, our
    other routes 503 naming it."""
    for answer in answers:
        path, status, body = answer[:3]
        assert status == 503, answer
        assert isinstance(body, dict), answer
        if path == "/runtime_version":
            assert body["state"] == "engine_dead", body
            assert set(body) >= {"version", "update_in_progress", "reason"}, body
            assert DEAD_TEXT in body["reason"], body
        elif path == "/health":
            assert body["status"] == "error" and DEAD_TEXT in body["detail"], body
        else:
            assert body["error_type"] == "EngineDiedError" and DEAD_TEXT in body["detail"], body


def _assert_exits_loudly(server: ServerProcess, core_pid: int, t_dead: float, what: str) -> None:
    code = psutil.Process(server.pid).wait(timeout=EXIT_WITHIN_S + 30)
    took = time.monotonic() - t_dead
    log = server.log_tail(20000)
    assert code == 1, (code, log[-3000:])
    assert took < EXIT_WITHIN_S, (took, log[-3000:])
    line = (f"{what}: {DEAD_TEXT} (pid {core_pid}, exit code -9 (SIGKILL)); the server stops "
            f"(exit code 1)")
    assert line in log, log[-3000:]


def _complete(url: str, body: dict, out: dict, key: str, started: threading.Event) -> None:
    """One completion (streamed when ``body`` says so): ``out[key] = (status, text)``."""
    with httpx.Client(timeout=120) as http:
        if not body.get("stream"):
            started.set()
            r = http.post(url + "/v1/completions", json=body)
            out[key] = (r.status_code, r.text)
            return
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            text = ""
            for piece in r.iter_text():
                text += piece
                started.set()
            out[key] = (r.status_code, text)


def test_policy_server_requests_in_flight_get_vllms_500_and_the_server_exits(models, tmp_path):
    with _server(PolicyServerProcess, models["policy"], POLICY,
                 str(tmp_path / "policy.log")) as server:
        core = _engine_core(server)
        results: dict[str, tuple[int, str]] = {}
        streaming = [threading.Event() for _ in range(2)]
        threads = [threading.Thread(target=_complete, args=(
            server.url, {**LONG, "stream": i < 2}, results, f"r{i}",
            streaming[i] if i < 2 else threading.Event())) for i in range(4)]
        paths = [("GET", "/runtime_version"), ("GET", "/health"),
                 ("POST", "/reset_prefix_cache")]
        with Poller(server.url, paths) as poller:
            poller.wait_answered(len(paths))
            assert all(a[2] == 200 for a in poller.answers), poller.answers[-5:]
            for t in threads:
                t.start()
            for e in streaming:  # both streams have produced tokens: they are in flight
                assert e.wait(120)
            t_dead = _kill(core)
            for t in threads:
                t.join(60)
        _assert_exits_loudly(server, core.pid, t_dead, "policy server")
    assert len(results) == 4, results
    for key, (status, text) in results.items():
        assert VLLM_DEAD_TEXT in text, (key, status, text[-500:])
        assert status == (200 if key in ("r0", "r1") else 500), (key, status)  # streams: 200
    _assert_dead_answers(poller.after(t_dead))


def test_reward_server_idle_answers_that_its_engine_died_and_exits(models, tmp_path):
    with _server(RewardServerProcess, models["reward"], REWARD,
                 str(tmp_path / "reward.log")) as server:
        core = _engine_core(server)
        paths = [("GET", "/runtime_version"), ("GET", "/health"), ("GET", "/runtime_version")]
        with Poller(server.url, paths) as poller:
            poller.wait_answered(2)
            assert all(a[2] == 200 for a in poller.answers), poller.answers[-5:]
            late = []
            with httpx.Client(timeout=30) as http:
                http.get(server.url + "/runtime_version")  # a connection open for the arrivals
                t_dead = _kill(core)
                for path, body in (("/score", {"input": ["a b c"]}),
                                   ("/get_reward", {"query": ["a b c"]}),
                                   ("/reset_prefix_cache", {})):
                    with contextlib.suppress(httpx.HTTPError):
                        r = http.post(server.url + path, json=body)
                        late.append((path, r.status_code, r.json()))
            _assert_exits_loudly(server, core.pid, t_dead, "reward server")
    # nothing ran into the dead engine: the watch alone stopped the server, which answered what
    # reached it meanwhile (it checks twice a second, so something did)
    after = poller.after(t_dead) + late
    assert after, poller.answers[-5:]
    _assert_dead_answers(after)


async def _push_until_killed(url: str, model_dir: str, core: psutil.Process,
                             marks: dict[str, float]) -> BaseException:
    """Push ``model_dir``'s weights through ``ws.connect``; once the update is under way the
    engine core is stopped (the next chunk's call waits in it) and killed a second later.
    -> what the push raised. ``push_chunks`` takes the chunks from an iterator of ours: the
    point where the engine dies is chosen there."""
    from safetensors.torch import load_file

    import weightsync as ws
    from weightsync.pipeline import make_chunks

    chunks = list(make_chunks(load_file(os.path.join(model_dir, "model.safetensors")).items(),
                              bucket_size_mb=0.05))
    assert len(chunks) >= 4, len(chunks)
    manifest = [m for c in chunks for m in c.metas()]

    async def stream():
        for i, chunk in enumerate(chunks):
            if i == 2:
                async with httpx.AsyncClient(timeout=10) as http:
                    while (await http.get(url + "/runtime_version")).json()["state"] != "updating":
                        await asyncio.sleep(0.01)
                core.send_signal(signal.SIGSTOP)
                marks["stopped"] = time.monotonic()
                threading.Timer(1.0, lambda: marks.__setitem__("dead", _kill(core))).start()
            yield chunk

    sync = await ws.connect([url], strategy={"type": "broadcast", "backend": "gloo",
                                             "timeout_s": 60, "bucket_size_mb": 0.05},
                            timeout_s=60)
    try:
        await sync.push_chunks(stream(), manifest, version=1)
    except BaseException as e:  # noqa: BLE001 - what the push raised is the result
        marks["raised"] = time.monotonic()
        return e
    finally:
        with contextlib.suppress(Exception):
            await sync.close()
    raise AssertionError("the push landed although the engine core died under it")


def test_policy_server_mid_update_the_push_names_the_dead_engine_not_a_timeout(models,
                                                                               tmp_path):
    with _server(PolicyServerProcess, models["policy"], POLICY,
                 str(tmp_path / "policy.log")) as server:
        core = _engine_core(server)
        marks: dict[str, float] = {}
        waiting: dict[str, tuple[int, str]] = {}
        paths = [("GET", "/runtime_version"), ("GET", "/health")]
        with Poller(server.url, paths) as poller:
            poller.wait_answered(len(paths))

            async def run() -> BaseException:
                push = asyncio.ensure_future(_push_until_killed(
                    server.url, models["policy"], core, marks))
                while "stopped" not in marks:  # the update is under way: this one waits for it
                    await asyncio.sleep(0.01)
                started = threading.Event()
                req = threading.Thread(target=_complete, args=(
                    server.url, {**LONG, "max_tokens": 4}, waiting, "behind", started))
                req.start()
                error = await push
                req.join(60)
                return error

            error = asyncio.run(run())
            _assert_exits_loudly(server, core.pid, marks["dead"], "policy server")
    assert isinstance(error, EngineDiedError), repr(error)
    assert DEAD_TEXT in str(error) and f"pid {core.pid}" in str(error), str(error)
    assert marks["raised"] - marks["dead"] < 15.0, marks  # not the strategy's 60 s timeout
    status, text = waiting["behind"]
    assert status == 500 and VLLM_DEAD_TEXT in text, (status, text[-500:])
    _assert_dead_answers(poller.after(marks["dead"]))
