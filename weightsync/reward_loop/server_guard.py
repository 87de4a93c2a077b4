"""The guard that takes a launched reward server down when its owner dies, however it dies.

``RewardServerActor`` runs the server in a process group of its own (so vLLM's engine-core
children go down with it). A graceful stop kills that group; but a Ray actor killed with
``ray.kill``, or one whose driver died, is ended with SIGKILL: no ``atexit``, no ``finally``,
and a server in its own session would outlive it. So the actor also starts this guard, in a
session of its own, holding the read end of a pipe whose only write end the actor keeps. The
kernel closes that end when the actor exits in any way; the guard then reads end-of-file and
stops the server's group: SIGTERM, a grace period, SIGKILL. The guard detaches (forks, and the
first process exits) so it is no child of the actor: Ray kills a dead worker's children, and
would take the guard with the actor, before it could act.

    python -m weightsync.reward_loop.server_guard PGID [GRACE_S] < pipe
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to process group ``pgid``, up to ``grace_s`` for it to leave, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def code_env() -> dict[str, str]:
    """This process's environment with the directory of the ``weightsync`` it runs leading
    ``PYTHONPATH``: a subprocess started with it runs the same code, whatever its cwd."""
    import weightsync

    root = os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))
    rest = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + rest if rest else "")}


def start_guard(pgid: int, grace_s: float = 10.0) -> tuple[int, int]:
    """Start a guard over process group ``pgid``; -> (the guard's pid, the pipe's write end).

    Keep the write end open for as long as the server should live; closing it (or exiting)
    makes the guard stop the group.

    Args:
        pgid: the server's process group (its leader's pid when started in a new session).
        grace_s: seconds between SIGTERM and SIGKILL.

    Returns:
        The detached guard's pid and the write end's file descriptor (not inheritable).

    Raises:
        RuntimeError: the guard did not report its pid.
    """
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.reward_loop.server_guard", str(pgid), str(grace_s)],
            stdin=read_fd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=code_env(), start_new_session=True)
        line = proc.stdout.readline() if proc.stdout is not None else b""
        proc.wait()
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    if not line.strip().isdigit():
        os.close(write_fd)
        raise RuntimeError(f"server guard for process group {pgid} did not start "
                           f"(exit code {proc.returncode})")
    return int(line), write_fd


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    pgid, grace_s = int(args[0]), float(args[1]) if len(args) > 1 else 10.0
    # signals that reach the guard's own group (a terminal's ^C) must not stop the watch
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    child = os.fork()
    if child:  # the starter's own child: report the guard and leave it to init
        sys.stdout.write(f"{child}\n")
        sys.stdout.flush()
        os._exit(0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    stop_group(pgid, grace_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
