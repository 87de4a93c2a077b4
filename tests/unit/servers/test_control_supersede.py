"""A join superseded before it reached the workers does not start there: a close (or a newer
init) that comes while the join still waits for the control call in progress abandons it, so
the join cannot then hold the control plane while it waits for a peer, with the close queued
behind it (seen in the servers' fuzz test in CI: four closes, two starts and a score got no
answer for 30 s while a Ludic join for an unreachable trainer held the control calls).

The engine here is a stand-in for vLLM's ``collective_rpc`` into the workers' endpoints (the
interleaving cannot be caused on purpose with a real engine): a join stays pending until it is
cancelled, every other call answers at once."""

from __future__ import annotations

import asyncio

import pytest

from weightsync.servers.control import ServiceError, UpdateControl


class _Workers:
    """``collective_rpc`` of one worker: ``weightsync_call`` / ``_poll`` / ``_cancel``."""

    def __init__(self) -> None:
        self.joins_started = 0
        self.cancelled: dict[str, str] = {}

    async def collective_rpc(self, method: str, timeout=None, args=()):
        if method == "weightsync_call":
            name, _kwargs, call_id, _slice = args
            if name == "init_weight_transfer":
                self.joins_started += 1
                return [{"pending": True}]
            return [{"ok": True, "state": {"version": 0}}]
        if method == "weightsync_poll":
            call_id = args[0]
            await asyncio.sleep(0.01)
            if call_id in self.cancelled:
                return [{"ok": False, "error": f"abandoned: {self.cancelled[call_id]}",
                         "error_type": "UpdateRefusedError", "state": {"version": 0}}]
            return [{"pending": True}]
        if method == "weightsync_cancel":
            self.cancelled[args[0]] = args[1]
            return [{"ok": True}]
        raise AssertionError(f"unexpected rpc {method}")


def test_a_close_abandons_a_join_still_waiting_for_the_control_plane():
    async def run():
        workers = _Workers()
        c = UpdateControl(workers, wait_timeout_s=3)
        blocker = asyncio.Event()

        async def control_call_in_progress():
            async with c._guard("a control call in progress"):
                await blocker.wait()

        busy = asyncio.ensure_future(control_call_in_progress())
        await asyncio.sleep(0.02)
        join = asyncio.ensure_future(c.init_communicator({}, {"type": "empty"}, 0))
        await asyncio.sleep(0.05)  # the join waits for the control call; no worker saw it
        close = asyncio.ensure_future(c.close_communicator())
        await asyncio.sleep(0.05)
        blocker.set()
        await busy
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(close, 2)  # not held by the join
        closed_in = asyncio.get_running_loop().time() - t0
        with pytest.raises(ServiceError) as e:
            await join
        return workers, closed_in, e.value

    workers, closed_in, error = asyncio.run(run())
    assert workers.joins_started == 0
    assert closed_in < 1.0
    assert error.status == 409 and error.message == "abandoned: the communicator was closed"


def test_a_join_in_the_workers_is_still_abandoned_by_a_close():
    async def run():
        workers = _Workers()
        c = UpdateControl(workers, wait_timeout_s=3)
        join = asyncio.ensure_future(c.init_communicator({}, {"type": "empty"}, 0))
        while not workers.joins_started:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(c.close_communicator(), 2)
        with pytest.raises(ServiceError, match="abandoned: the communicator was closed"):
            await join
        return workers

    assert asyncio.run(run()).joins_started == 1
