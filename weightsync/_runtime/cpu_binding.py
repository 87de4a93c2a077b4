"""On vLLM's CPU build, vLLM's engine core runs on the cores of its own workers.

Why: vLLM's engine core reads its workers' results from a shared-memory queue and, for a
second after each read, waits for the next one by calling ``sched_yield()`` in a loop
(``SpinCondition`` in ``vllm/distributed/device_communicators/shm_broadcast.py``). On CPU only
the workers are bound to cores (``VLLM_CPU_OMP_THREADS_BIND``); the engine core may run
anywhere, and while an engine decodes it keeps a core of its own busy that the API server and
its clients need. With a 2-core box and the worker on core 0, the engine core held core 1 and
the Linux scheduler left a client woken on it runnable but unscheduled for up to 0.7 s at a
time (``perf sched``: the engine core ran 573 ms of a 670 ms window on that core; kernel
threads waited too): an adapter stream's events came in one burst at its end and a second
request of the client was sent only then. Bound to its workers' cores the engine core alternates
with its worker (it schedules while the worker waits, spins while the worker computes) and the
other cores stay free: the longest gap in such a stream fell from 0.4-0.8 s to 8-73 ms, at about
10 % more time per token.

It is asked for, not done by default: ``WEIGHTSYNC_ENGINE_CORE_CPUS`` names the cores
(``"0-3"``), or ``workers`` for the cores of ``VLLM_CPU_OMP_THREADS_BIND`` (``"0"``, ``"4-7"``,
``"0-3|4-7"`` for two workers). Bound, the engine core shares its worker's cores, which is
right for one server on cores of its own, and wrong where several engines' workers share cores:
each engine core then spins beside them, and a worker sharing a core with another engine's
spinning engine core can go a minute without reading its own engine core's messages (its
weight-sync group then never forms).
``engine_core_follows_workers()`` is called by ``serve-policy`` and ``serve-reward`` on CPU
before they start vLLM: it turns ``workers`` into those cores (or drops it when they are not
cores). weightsync's vLLM plugin calls ``bind_engine_core()`` in every vLLM process; in the
engine core (and only there: the plugin is loaded in the API server and the workers too) it
binds every thread of the process to the cores named. Nothing happens otherwise.
"""

from __future__ import annotations

import os
import re

#: the cores vLLM's engine core is bound to ("workers": its workers' cores; unset: not bound)
ENGINE_CORE_CPUS_ENV = "WEIGHTSYNC_ENGINE_CORE_CPUS"
#: ``WEIGHTSYNC_ENGINE_CORE_CPUS`` value: the cores the engine's workers are bound to
FOLLOW_WORKERS = "workers"
#: vLLM's CPU binding of its workers' OpenMP threads (per worker, separated by "|")
WORKER_CPUS_ENV = "VLLM_CPU_OMP_THREADS_BIND"

_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpus(spec: str) -> set[int] | None:
    """``"0-3|4-7"`` / ``"0,2"`` -> the set of cores; None when ``spec`` names no cores
    (vLLM's ``auto``, ``nobind``, ``all``, empty, anything else)."""
    cpus: set[int] = set()
    for part in spec.strip().split("|"):
        part = part.strip()
        if not _CPU_LIST.match(part):
            return None
        for item in part.split(","):
            lo, _, hi = item.partition("-")
            first, last = int(lo), int(hi or lo)
            if last < first:
                return None
            cpus.update(range(first, last + 1))
    return cpus or None


def engine_core_follows_workers(environ: dict[str, str] | None = None) -> str | None:
    """In a server process on CPU, before vLLM starts: ``WEIGHTSYNC_ENGINE_CORE_CPUS=workers``
    becomes the cores the workers are bound to (dropped when they name no cores); any other
    value stays as set; -> the value in effect (None: the engine core is not bound)."""
    env = os.environ if environ is None else environ
    given = env.get(ENGINE_CORE_CPUS_ENV)
    if given != FOLLOW_WORKERS:
        return given
    cpus = parse_cpus(env.get(WORKER_CPUS_ENV, ""))
    if cpus is None:
        del env[ENGINE_CORE_CPUS_ENV]
        return None
    env[ENGINE_CORE_CPUS_ENV] = ",".join(str(c) for c in sorted(cpus))
    return env[ENGINE_CORE_CPUS_ENV]


def in_engine_core() -> bool:
    """Whether this process is vLLM's engine core (``EngineCore`` / ``EngineCore_DP<n>``)."""
    import multiprocessing

    return multiprocessing.current_process().name.startswith("EngineCore")


def bind_engine_core() -> set[int] | None:
    """In vLLM's engine core with ``WEIGHTSYNC_ENGINE_CORE_CPUS`` naming cores: bind every
    thread of this process to them (threads started later inherit it) -> the cores; else
    None. Cores this process may not use are left out; none left: not bound."""
    cpus = parse_cpus(os.environ.get(ENGINE_CORE_CPUS_ENV, ""))
    if cpus is None or not in_engine_core():
        return None
    cpus &= os.sched_getaffinity(0)
    if not cpus:
        return None
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass
    return cpus
