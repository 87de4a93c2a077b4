"""``SleepMode``'s rules, on a stand-in engine: vLLM has no sleep mode on CPU, so the engine's
``sleep`` / ``wake_up`` are recorded by a double here (said where used); on a real GPU engine
the same paths run in tests/gpu/test_reward_sleep_gpu.py."""

from __future__ import annotations

import asyncio

import pytest

from weightsync.servers.control import ServiceError
from weightsync.servers.sleep import SleepMode
from weightsync.types import TrainingMode


class RecordingEngine:
    """Test double for vLLM's ``AsyncLLM`` sleep API: records each call, takes a moment."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def sleep(self, level: int) -> None:
        await asyncio.sleep(0.01)
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None) -> None:
        await asyncio.sleep(0.01)
        self.calls.append(("wake_up", tuple(tags) if tags else None))


def _mode():
    engine = RecordingEngine()
    return engine, SleepMode(engine, enabled=True, device="cuda")


def test_without_sleep_mode_every_call_is_501_naming_the_flag():
    mode = SleepMode(RecordingEngine(), enabled=False, device="cpu")
    for call in (lambda: mode.sleep(1), lambda: mode.wake_up()):
        with pytest.raises(ServiceError, match="--enable-sleep-mode .*this server runs on cpu") as e:
            asyncio.run(call())
        assert e.value.status == 501
    with pytest.raises(ServiceError):
        mode.state()


def test_requests_wake_a_sleeping_engine_once_and_sleep_waits_for_requests():
    engine, mode = _mode()

    async def run():
        await mode.sleep(1)
        assert mode.state()["is_sleeping"] and mode.state()["level"] == 1

        async def request():
            async with mode.awake():
                await asyncio.sleep(0.05)

        await asyncio.gather(*(request() for _ in range(5)))  # 5 requests, one wake
        assert engine.calls == [("sleep", 1), ("wake_up", None)]
        assert not mode.state()["is_sleeping"] and mode.state()["last_wake_s"] > 0

        inside = asyncio.Event()
        leave = asyncio.Event()

        async def long_request():
            async with mode.awake():
                inside.set()
                await leave.wait()

        held = asyncio.ensure_future(long_request())
        await inside.wait()
        sleeping = asyncio.ensure_future(mode.sleep(2))
        await asyncio.sleep(0.05)
        assert not sleeping.done()  # waits for the request in flight
        leave.set()
        await asyncio.gather(held, sleeping)
        assert engine.calls[-1] == ("sleep", 2)

    asyncio.run(run())


def test_level_2_needs_a_full_update_before_scoring():
    engine, mode = _mode()

    async def run():
        await mode.sleep(2)
        with pytest.raises(ServiceError, match="dropped by a level-2 sleep") as e:
            async with mode.awake():
                pass
        assert e.value.status == 409
        with pytest.raises(ServiceError, match="training_mode: head_only, but a level-2 sleep"):
            await mode.before_update(TrainingMode.HEAD_ONLY)
        note = await mode.before_update(TrainingMode.FULL)
        assert "woken for this update" in note
        assert engine.calls[-1] == ("wake_up", ("weights",))  # the KV cache stays asleep
        assert mode.state()["kv_cache_asleep"] and not mode.state()["weights_asleep"]
        mode.weights_valid = True  # what SleepAwareControl.finish does after a full update
        async with mode.awake():
            pass
        assert engine.calls[-1] == ("wake_up", ("kv_cache",))
        assert await mode.before_update(TrainingMode.HEAD_ONLY) is None  # awake: nothing to do

    asyncio.run(run())


def test_bad_level_and_tags_are_named():
    _, mode = _mode()
    with pytest.raises(ServiceError, match="level: 1 .* or 2"):
        asyncio.run(mode.sleep(3))
    with pytest.raises(ServiceError, match=r"tags: \['gpu'\] unknown"):
        asyncio.run(mode.wake_up(["gpu"]))
