"""An update's flip run by vLLM's engine core between two of its steps, without pausing the
scheduler: what ``serve-policy --in-flight-requests continue --in-flight-kv keep`` uses.

Why: the flip that pauses (``vllm_compat.freeze_in_flight``) waits for the step in flight to end
before anything moves (18-28 ms of a 7B flip's pause on an H100, one decode step), then loads,
then resumes, and generation stands still for all of it. With the requests' KV kept nothing
needs the pause: vLLM's engine core runs a utility call between two iterations of its loop, so
a utility that counts the requests' tokens and then calls the workers' finish is itself the
step boundary. The step in flight when it runs keeps going on the GPU with the old weights (its
kernels were queued before the finish; a worker of a multiprocess executor takes the finish
after that step), and every step scheduled after it runs on the new ones. No step is scheduled
while the utility runs; the finish waits for its own copies, so for the step in flight too, which
the GPU runs meanwhile: the tokens stand still only for what comes after that step.

Engine-core side: ``engine_core_flip`` becomes ``EngineCore.weightsync_flip`` when vLLM loads
weightsync's plugin (``weightsync._runtime.vllm_plugin.register``, in the engine core's process).
It returns ``{"counts": {vLLM request id: output tokens made by the old weights}, "answers":
the workers' answers, "held_ms": how long it held the engine core}``. A request's count is its
output tokens plus the ones scheduled and not yet returned (``num_output_placeholders``, async
scheduling): those steps were queued before the finish, so the old weights make them.

Server side (``weightsync.servers.control.UpdateControl``, on its asyncio loop):
``flip_supported`` asks once whether the engine core has the utility (an engine started without
the plugin has not: the server then flips with the pause), ``flip_between_steps`` runs it and
turns vLLM's request ids into the ids the server sees (the ``X-Request-Id`` based external ids).
"""

from __future__ import annotations

import time
from typing import Any

#: the utility's name on vLLM's ``EngineCore``
UTILITY = "weightsync_flip"


def engine_core_flip(self: Any, method: str | None, timeout: float | None = None,
                     args: Any = ()) -> dict[str, Any]:
    """Runs in vLLM's engine core process, on its busy loop's thread, between two steps (``self``
    is the ``EngineCore``). ``method`` None: a probe, answers ``{"ready": True}``. Else: count
    every request's old-weight tokens, then ``collective_rpc(method, timeout, args)`` on the
    workers (it returns once each worker answered)."""
    if method is None:
        return {"ready": True}
    t0 = time.perf_counter()
    counts = tokens_made(getattr(self, "scheduler", None))
    answers = self.collective_rpc(method, timeout, tuple(args or ()))
    return {"counts": counts, "answers": list(answers),
            "held_ms": (time.perf_counter() - t0) * 1e3}


def tokens_made(scheduler: Any) -> dict[str, int]:
    """vLLM request id -> output tokens made or scheduled so far, for every request the
    scheduler holds (waiting ones included: 0, or what they made before a preemption)."""
    out: dict[str, int] = {}
    for rid, request in (getattr(scheduler, "requests", None) or {}).items():
        made = int(getattr(request, "num_output_tokens", 0) or 0)
        out[str(rid)] = made + int(getattr(request, "num_output_placeholders", 0) or 0)
    return out


def register() -> None:
    """Give vLLM's ``EngineCore`` the utility (idempotent; called by the plugin in every vLLM
    process, which matters only in the engine core's)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # noqa: BLE001 - another vLLM layout: the server flips with the pause
        return
    if getattr(EngineCore, UTILITY, None) is not engine_core_flip:
        setattr(EngineCore, UTILITY, engine_core_flip)
    _trace_requests()


def _trace_requests() -> None:
    """With tracing on (``weightsync._runtime.trace``), mark when vLLM's engine core loop takes
    each client request and when it is done with it (``core.request`` / ``core.request.end``,
    with the utility's method): a call's time splits into the way in, the work and the way
    back. Nothing is wrapped with tracing off."""
    from weightsync._runtime import trace

    if not trace.enabled:
        return
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except Exception:  # noqa: BLE001 - another vLLM layout: nothing traced there
        return
    original = EngineCoreProc._handle_client_request
    if getattr(original, "_weightsync_traced", False):
        return

    def handle(self: Any, request_type: Any, request: Any) -> Any:
        method = request[2] if isinstance(request, tuple) and len(request) == 4 else ""
        trace.mark("core.request", type=getattr(request_type, "name", str(request_type)),
                   method=method)
        try:
            return original(self, request_type, request)
        finally:
            trace.mark("core.request.end")

    handle._weightsync_traced = True  # type: ignore[attr-defined]
    EngineCoreProc._handle_client_request = handle


async def flip_supported(engine: Any) -> bool:
    """Whether ``engine`` (vLLM's ``AsyncLLM``) has an engine core that runs the utility."""
    call = getattr(getattr(engine, "engine_core", None), "call_utility_async", None)
    if call is None:
        return False
    try:
        answer = await call(UTILITY, None, None, ())
    except Exception:  # noqa: BLE001 - no such utility: the plugin did not load there
        return False
    return isinstance(answer, dict) and bool(answer.get("ready"))


async def flip_between_steps(engine: Any, method: str, args: tuple,
                             timeout_s: float | None = None) -> dict[str, Any]:
    """Run the flip's workers' ``method(*args)`` in the engine core between two steps (in every
    engine core of a data-parallel engine where vLLM can reach each). -> ``{"counts":
    {external request id: old-weight output tokens}, "answers": [each worker's], "held_ms": the
    longest an engine core was held}``."""
    core = engine.engine_core
    every = getattr(core, "call_utility_all_async", None)  # vLLM >= 0.32: each DP engine core
    if every is not None:
        answers = list(await every(UTILITY, method, timeout_s, tuple(args)))
    else:
        answers = [await core.call_utility_async(UTILITY, method, timeout_s, tuple(args))]
    from weightsync._runtime.vllm_compat import external_request_id, request_states

    states = request_states(engine)
    counts: dict[str, int] = {}
    workers: list[Any] = []
    for answer in answers:
        for rid, made in (answer.get("counts") or {}).items():
            counts[external_request_id(states, rid)] = int(made)
        workers += list(answer.get("answers") or ())
    return {"counts": counts, "answers": workers,
            "held_ms": max(float(a.get("held_ms") or 0.0) for a in answers)}
