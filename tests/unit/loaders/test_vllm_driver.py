"""``VLLMWorkers`` against a blocking engine: calls run one at a time.

vLLM's blocking ``LLM`` talks to its engine core over one zmq socket, which is not thread-safe;
two ``collective_rpc`` calls from two threads at once corrupted a send (seen in a full test
run: a refused one-call update's follow-up call overlapped the next update's call and both
hung). Two overlapping sends cannot be caused on purpose against a real engine, so the engine
here is a stand-in that records how many calls are inside ``collective_rpc`` at once (the test
double for that fault only)."""

from __future__ import annotations

import asyncio
import threading
import time

from weightsync.loaders.vllm_driver import VLLMWorkers


class BlockingEngine:
    def __init__(self) -> None:
        self.inside = 0
        self.most = 0
        self.lock = threading.Lock()
        self.order: list[str] = []

    def collective_rpc(self, method, timeout=None, args=()):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.05)
        self.order.append(args[0] if args else method)
        with self.lock:
            self.inside -= 1
        return [{"ok": True, "result": None}]


def test_calls_into_a_blocking_engine_never_overlap_and_keep_their_order():
    engine = BlockingEngine()
    workers = VLLMWorkers(engine)

    async def go():
        first = asyncio.ensure_future(workers.rpc("weightsync_call", "a"))
        await asyncio.sleep(0.01)  # "a" is inside the engine when "b" comes
        second = asyncio.ensure_future(workers.rpc("weightsync_call", "b"))
        return await asyncio.gather(first, second)

    answers = asyncio.run(go())
    assert len(answers) == 2
    assert engine.most == 1  # one call inside the engine at a time
    assert engine.order == ["a", "b"]
