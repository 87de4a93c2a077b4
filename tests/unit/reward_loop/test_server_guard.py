"""The server guard stops a process group when its owner lets go or dies outright: real
processes (a shell and its ``sleep`` child in a session of their own), a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from weightsync.reward_loop.server_guard import alive, start_guard


def _group() -> tuple[subprocess.Popen, int]:
    """A session leader with a child: -> (the leader, the child's pid)."""
    leader = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_closing_the_pipe_stops_the_whole_group():
    leader, child = _group()
    guard, fd = start_guard(leader.pid, grace_s=5.0)
    try:
        time.sleep(0.5)
        assert alive(guard) and alive(child)  # the guard waits while the owner holds the pipe
        os.close(fd)
        assert _wait_gone([child, guard]) == []
        assert leader.wait(timeout=10) is not None
    finally:
        for pid in (leader.pid, child):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_owner_killed_outright_takes_its_group_down():
    owner_code = textwrap.dedent("""
        import subprocess, sys, time
        from weightsync.reward_loop.server_guard import start_guard
        leader = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"],
                                  stdout=subprocess.PIPE, start_new_session=True)
        child = int(leader.stdout.readline())
        guard, fd = start_guard(leader.pid, grace_s=5.0)
        print(leader.pid, child, guard, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE)
    leader, child, guard = map(int, owner.stdout.readline().split())
    try:
        assert all(alive(p) for p in (leader, child, guard))
        owner.kill()  # SIGKILL: no atexit, no finally in the owner
        owner.wait(timeout=10)
        assert _wait_gone([leader, child, guard]) == []
    finally:
        for pid in (leader, child, guard):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
