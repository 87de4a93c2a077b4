"""vLLM's engine core on its workers' cores (``weightsync/_runtime/cpu_binding.py``): which
cores a binding names, what the servers set when asked, and a real process named as vLLM names its engine
core binding every one of its threads (and one named otherwise binding none)."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from weightsync._runtime.cpu_binding import (
    ENGINE_CORE_CPUS_ENV,
    FOLLOW_WORKERS,
    WORKER_CPUS_ENV,
    bind_engine_core,
    engine_core_follows_workers,
    parse_cpus,
)


def test_only_core_lists_name_cores():
    assert parse_cpus("0") == {0}
    assert parse_cpus("4-7") == {4, 5, 6, 7}
    assert parse_cpus("0-1|3") == {0, 1, 3}  # one list per worker
    assert parse_cpus("0,2") == {0, 2}
    for spec in ("", "auto", "nobind", "all", "3-1", "0-", "a", "0|auto"):
        assert parse_cpus(spec) is None, spec


def test_the_servers_bind_the_engine_core_only_when_asked():
    """``workers`` becomes the workers' cores; cores given stay; nothing asked, nothing bound
    (the default: engines whose workers share cores would spin beside them)."""
    env = {WORKER_CPUS_ENV: "2-3|0", ENGINE_CORE_CPUS_ENV: FOLLOW_WORKERS}
    assert engine_core_follows_workers(env) == "0,2,3" == env[ENGINE_CORE_CPUS_ENV]
    mine = {WORKER_CPUS_ENV: "0", ENGINE_CORE_CPUS_ENV: "1"}
    assert engine_core_follows_workers(mine) == "1" and mine[ENGINE_CORE_CPUS_ENV] == "1"
    for unbound in ({WORKER_CPUS_ENV: "0"}, {ENGINE_CORE_CPUS_ENV: FOLLOW_WORKERS},
                    {WORKER_CPUS_ENV: "auto", ENGINE_CORE_CPUS_ENV: FOLLOW_WORKERS}):
        assert engine_core_follows_workers(unbound) is None
        assert ENGINE_CORE_CPUS_ENV not in unbound


def _child(cpus: str, out) -> None:
    os.environ[ENGINE_CORE_CPUS_ENV] = cpus
    stop = threading.Event()
    before = threading.Thread(target=stop.wait)  # a thread already running, like ZMQ's
    before.start()
    bound = bind_engine_core()
    after = threading.Thread(target=stop.wait)  # started later: inherits it
    after.start()
    seen = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    stop.set()
    before.join()
    after.join()
    out.put((sorted(bound) if bound else None, seen))


def _run(name: str, cpus: str):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_child, args=(cpus, out), name=name)
    p.start()
    result = out.get(timeout=60)
    p.join(60)
    return result


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_the_engine_core_binds_every_thread_and_no_other_process_binds():
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1]
    bound, seen = _run("EngineCore", str(core))
    assert bound == [core]
    assert len(seen) >= 3 and all(cpus == [core] for cpus in seen.values()), seen
    bound, seen = _run("EngineCore_DP1", f"{core}|{core}")
    assert bound == [core] and all(cpus == [core] for cpus in seen.values())
    bound, seen = _run("VllmWorker-0", str(core))  # the plugin runs in workers too
    assert bound is None and all(cpus == allowed for cpus in seen.values())
    bound, _ = _run("EngineCore", "any")
    assert bound is None
