"""Faults caused for real between a trainer (this process) and engines in their own processes
(``LocalEngineProcess``: a torch module behind a ``WeightUpdateEndpoint``):

* an engine SIGKILLed in the middle of a push into a fan-out of two: the push raises within its
  timeout naming the dead engine and the phase; the surviving engine rolls back as documented
  (in place: torn, 503-style refusal until the next complete update; staged: the last version
  exactly), and a new session without the dead engine lands the next version;
* the only engine of a streamed broadcast (one control call per update), killed between two
  pushes: the push fails naming it and the call, without waiting for a timeout; refusing a
  start in that call: no byte moves, its weights stay, the same session's next push lands;
* an engine SIGSTOPped mid-push (stuck, not dead): the push raises a timeout naming it and the
  phase within the configured time; once it runs again it accepts a new communicator and a new
  sync, without a restart;
* an engine that never joins the data plane (SIGSTOPped before ``connect``): creating the group
  fails within ``join_timeout_s`` naming it; the other engine then takes a new group;
* a chunk corrupted on the receiving side (a test-only hook registered by this test's engine
  factory, ``_corrupting_engine.py``, flips one byte after the data plane delivered it): the
  end-to-end checksum catches it, names the chunk and the tensor, and the engine keeps version
  v (staged: its weights exactly; in place: torn).

Engines' weights are compared by state digest (bit-exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

import weightsync as ws
from weightsync.clients import FanOutClient
from weightsync.digest import state_digest
from weightsync.errors import (
    ChecksumMismatchError,
    EngineDiedError,
    WeightSyncError,
    WeightSyncTimeout,
)
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module
from weightsync.pipeline import make_chunks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = os.path.dirname(os.path.abspath(__file__))
FACTORY = "weightsync.local.modules:qwen2_module"
SMALL = {"size": "small", "dtype": "float32"}
BUCKET_MB = 0.5  # ~9 MB model: ~20 chunks
STRATEGIES = ["broadcast", "cuda_ipc", "packed_cuda_ipc"]


def _cfg(strategy: str, **extra) -> dict:
    cfg = {"type": strategy, "bucket_size_mb": BUCKET_MB, "timeout_s": 5.0, **extra}
    if strategy == "broadcast":
        cfg["backend"] = "gloo"
    return cfg


def _weights(seed: int) -> dict:
    return qwen2_module(**SMALL, seed=seed).state_dict()


def _digest(engine: LocalEngineProcess) -> dict:
    return asyncio.run(engine.call("state_digest"))


def _status(engine: LocalEngineProcess) -> dict:
    return asyncio.run(engine.call("get_state"))


def _push(engines, cfg, weights, version):
    async def go():
        async with ws.connect(engines, strategy=cfg) as sync:
            return await sync.push(weights, version=version)

    return asyncio.run(go())


def _send_stream(engines, cfg, chunks, version, faulty):
    """The low-level push (what ``SyncSession.push`` runs): a sender over a fan-out with the
    strategy's timeouts, fed by ``faulty(chunks)`` (an iterator that causes a fault on the
    way). Returns the seconds until it raised, and the error."""

    async def go():
        s = ws.build_strategy(cfg)
        client = FanOutClient(engines, timeout_s=s.cfg.timeout_s, join_timeout_s=10)
        info = await s.create_sync_info(s.cfg, client)
        sender = await s.create_sender(s.cfg, client, info)
        manifest = [m for c in chunks for m in c.metas()]
        t0 = time.monotonic()
        try:
            with pytest.raises(WeightSyncError) as ei:
                await sender.send_chunks(faulty(chunks), client, version=version,
                                         manifest=manifest)
            return time.monotonic() - t0, ei.value
        finally:
            await sender.close()
            await client.aclose()

    return asyncio.run(go())


def _spawn(name: str, **kw) -> LocalEngineProcess:
    return LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name=name, **kw)


@pytest.fixture
def engines():
    made: list[LocalEngineProcess] = []

    def make(n: int = 2, **kw) -> list[LocalEngineProcess]:
        made.extend(_spawn(f"engine{i}", **kw) for i in range(n))
        return made[-n:]

    yield make
    for e in made:
        for w in e.workers:  # a SIGSTOPped child must run again to die cleanly
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGCONT)
        e.kill()


# -- an engine killed mid-push --------------------------------------------------------------------


@pytest.mark.parametrize("staged", [False, True], ids=["in_place", "staged"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_engine_killed_mid_push_the_push_names_it_and_the_survivor_rolls_back(
    engines, strategy, staged
):
    e0, e1 = engines(2)
    w1, w2 = _weights(1), _weights(2)
    assert _push([e0, e1], _cfg(strategy), w1, 1).versions == [1, 1]
    v1 = _digest(e1)
    chunks = list(make_chunks(w2.items(), bucket_size_mb=BUCKET_MB))
    assert len(chunks) > 8

    def stream(chunks):
        for i, c in enumerate(chunks):
            if i == 6:
                # the real fault: SIGKILL. The streamed sender takes up to 3 chunks ahead of
                # what has landed (one in flight, one going out, one announced), so at least
                # chunks 0-2 went out: the survivor was written to
                e0.kill()
            yield c

    elapsed, err = _send_stream([e0, e1], _cfg(strategy, staged=staged), chunks, 2, stream)
    assert elapsed < 5.0 + 10, elapsed  # the timeout plus the fan-out's grace, at most
    assert isinstance(err, EngineDiedError), repr(err)
    # the call it died in: a streamed broadcast sends its request and finish as one call
    # unless the update is staged
    call = "apply_update" if strategy == "broadcast" and not staged else "update_named_weights"
    assert "engine0" in str(err) and call in str(err), str(err)
    assert not e0.is_alive()
    state = _status(e1)
    assert state["version"] == 1
    if staged:  # the survivor keeps the last version exactly
        assert state["state"] == "idle" and state["last_error"] == "", state
        assert _digest(e1) == v1
    else:  # in place: the survivor refuses to serve until a complete update lands
        assert state["state"] == "torn" and "aborted" in state["last_error"], state
    # a new session without the dead engine: the next version lands whole
    assert _push([e1], _cfg(strategy), w2, 2).versions == [2]
    assert _status(e1)["state"] == "idle"
    assert _digest(e1) == state_digest(w2)


# -- the only engine: the streamed broadcast's one call ---------------------------------------------


def test_the_only_engine_killed_before_its_update_fails_the_one_call_naming_it(engines):
    """One engine: the streamed broadcast sends start, request and finish as one call, issued
    while the sender enters the vote. An engine dead before the update fails that call (not
    the group's timeout), and the push names it."""
    (e0,) = engines(1)
    cfg = _cfg("broadcast")

    async def go():
        async with ws.connect([e0], strategy=cfg) as sync:
            first = await sync.push(_weights(1), version=1)
            e0.kill()  # the real fault, between two pushes of one session
            t0 = time.monotonic()
            with pytest.raises(EngineDiedError) as ei:
                await sync.push(_weights(2), version=2)
            return first, time.monotonic() - t0, ei.value

    first, elapsed, err = asyncio.run(go())
    assert first.versions == [1]
    assert elapsed < 5.0 + 5, elapsed  # the call fails at once; the vote waits no timeout
    assert "engine0" in str(err) and "apply_update" in str(err), str(err)


def test_the_only_engine_refusing_the_start_keeps_its_weights_and_the_group_in_step(engines):
    """A start the engine refuses (a tensor of another shape) inside the one call: the request
    is refused too, so the engine votes no and no byte moves; the push names the tensor, the
    engine keeps version 1 exactly, and the same session's next push lands."""
    (e0,) = engines(1)
    w1, w2 = _weights(1), _weights(2)
    bad = dict(w2)
    name = next(n for n in bad if n.endswith("mlp.up_proj.weight"))
    bad[name] = bad[name][:-1]

    async def go():
        async with ws.connect([e0], strategy=_cfg("broadcast")) as sync:
            first = await sync.push(w1, version=1)
            with pytest.raises(ws.WeightMismatchError) as ei:
                await sync.push(bad, version=2)
            v1 = await e0.call("state_digest")
            again = await sync.push(w2, version=2)
            return first, ei.value, v1, again

    first, err, v1, again = asyncio.run(go())
    assert first.versions == [1] and again.versions == [2]
    assert name in str(err), str(err)
    assert v1 == state_digest(w1)
    assert _status(e0)["state"] == "idle" and _digest(e0) == state_digest(w2)


# -- a stuck engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["broadcast", "packed_cuda_ipc"])
def test_stuck_engine_the_push_times_out_naming_it_then_it_takes_a_new_sync(engines, strategy):
    e0, e1 = engines(2)
    w1, w2, w3 = _weights(1), _weights(2), _weights(3)
    assert _push([e0, e1], _cfg(strategy), w1, 1).versions == [1, 1]
    chunks = list(make_chunks(w2.items(), bucket_size_mb=BUCKET_MB))
    pid = e0.workers[0].proc.pid

    def stream(chunks):
        for i, c in enumerate(chunks):
            if i == 3:
                os.kill(pid, signal.SIGSTOP)  # the real fault: engine0 stops answering
            yield c

    try:
        elapsed, err = _send_stream([e0, e1], _cfg(strategy, timeout_s=3.0), chunks, 2, stream)
    finally:
        os.kill(pid, signal.SIGCONT)
    # 3 s per control call / collective; a broken collective waits the fan-out's grace (5 s)
    # for the silent engine, and the sender 2 s more for the fan-out's verdict
    assert elapsed < 3.0 + 5 + 2 + 5, elapsed
    assert isinstance(err, WeightSyncTimeout), repr(err)
    # the call that timed out: the streamed broadcast's request and finish travel as one call
    call = "apply_update" if strategy == "broadcast" else "update_named_weights"
    assert "engine0" in str(err) and call in str(err), str(err)
    # running again, it accepts a new communicator and a new sync (no restart)
    assert _push([e0, e1], _cfg(strategy), w3, 3).versions == [3, 3]
    assert _digest(e0) == _digest(e1) == state_digest(w3)


# -- a peer that never joins ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["broadcast", "cuda_ipc"])
def test_engine_that_never_joins_fails_creation_in_time_naming_it(engines, strategy):
    e0, e1 = engines(2)
    pid = e1.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)  # the real fault: engine1 never takes part
    cfg = _cfg(strategy, join_timeout_s=4.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncTimeout) as ei:
            _push([e0, e1], cfg, _weights(1), 1)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert elapsed < 4.0 + 5 + 2 + 5, elapsed
    msg = str(ei.value)
    assert "engine1" in msg and "engine0" not in msg.split("(the other engines")[0], msg
    if strategy == "broadcast":
        assert "never joined" in msg and "ranks 2..2" in msg, msg
    else:
        assert "init_weight_transfer" in msg, msg
    # both take a new communicator and a sync, without a restart
    assert _push([e0, e1], _cfg(strategy), _weights(2), 2).versions == [2, 2]
    assert _digest(e0) == _digest(e1) == state_digest(_weights(2))


# -- a corrupted chunk ------------------------------------------------------------------------------


@pytest.fixture
def corrupting_engine():
    made: list[LocalEngineProcess] = []

    def make() -> LocalEngineProcess:
        env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
        made.append(LocalEngineProcess.spawn(
            "_corrupting_engine:build", {**SMALL, "fill": "zeros", "corrupt_chunk": 1},
            name="engine0", env=env))
        return made[-1]

    yield make
    for e in made:
        e.kill()


@pytest.mark.parametrize("staged", [False, True], ids=["in_place", "staged"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_corrupted_chunk_is_caught_by_the_checksum_and_the_version_stays(
    corrupting_engine, strategy, staged
):
    engine = corrupting_engine()
    before = _digest(engine)
    w = _weights(4)
    with pytest.raises(ChecksumMismatchError) as ei:
        _push([engine], _cfg(strategy, checksum=True, staged=staged), w, 1)
    err = ei.value
    chunk1 = list(make_chunks(w.items(), bucket_size_mb=BUCKET_MB))[1]
    assert "engine0" in str(err) and "chunk 1 of update" in str(err), str(err)
    assert err.offenders and err.offenders[0].startswith(chunk1.names[0] + ": checksum"), err
    state = _status(engine)
    assert state["version"] == 0
    if staged:
        assert state["state"] == "idle", state
        assert _digest(engine) == before  # not one byte of the update reached the weights
    else:
        assert state["state"] == "torn" and "ChecksumMismatchError" in state["last_error"], state


def test_without_the_checksum_the_same_corruption_goes_unnoticed(corrupting_engine):
    """The fault is real: without ``checksum: true`` the flipped byte lands and the version
    advances over weights that differ from the trainer's."""
    engine = corrupting_engine()
    w = _weights(4)
    assert _push([engine], _cfg("packed_cuda_ipc"), w, 1).versions == [1]
    got, want = _digest(engine), state_digest(w)
    chunk1 = list(make_chunks(w.items(), bucket_size_mb=BUCKET_MB))[1]
    assert [n for n in want if got[n] != want[n]] == [chunk1.names[0]]
