"""``RewardServerActor``: a Ray actor that owns one reward-model server process.

A plain class (``launch`` makes it a Ray actor). ``start`` runs the server the way a user does,
``python -m weightsync.cli serve-reward --model DIR --host NODE_IP --port P ...`` (a judge:
``serve-policy``), in a session of its own so that vLLM's engine-core children share its
process group, with its output in a log file; it waits until ``GET /health`` answers. The
server lives exactly as long as the actor: ``stop`` (and the actor's interpreter exit) kills
the group, and ``server_guard`` kills it when the actor is killed outright (``ray.kill``, its
driver's death: SIGKILL, where nothing of the actor runs any more). The subprocess imports the
``weightsync`` the actor runs (its directory leads ``PYTHONPATH``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from weightsync.reward_loop.server_guard import alive, code_env, start_guard, stop_group

#: ``kind`` -> the ``weightsync`` subcommand that serves it
SUBCOMMANDS = {"reward": "serve-reward", "policy": "serve-policy"}


class RewardServerActor:
    def __init__(self, kind: str, model_dir: str, args: list[str], env: dict[str, str],
                 grace_s: float = 15.0) -> None:
        """Args:
            kind: ``"reward"`` (``serve-reward``) or ``"policy"`` (``serve-policy``, a judge).
            model_dir: the checkpoint the server loads (``--model``).
            args: further command-line arguments.
            env: added to the server's environment (``CUDA_VISIBLE_DEVICES``, ...).
            grace_s: seconds between SIGTERM and SIGKILL when stopping.

        Raises:
            ValueError: ``kind`` is not one of ``SUBCOMMANDS``.
        """
        if kind not in SUBCOMMANDS:
            raise ValueError(f"kind: one of {sorted(SUBCOMMANDS)}, got {kind!r}")
        self.kind, self.model_dir, self.args = kind, model_dir, list(args)
        self.env, self.grace_s = dict(env), grace_s
        self._proc: subprocess.Popen | None = None
        self._guard: int | None = None
        self._guard_fd: int | None = None
        self.url = ""
        self.log_path = ""

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Start the server and wait for its health; -> ``{url, node_id, node_ip, pid,
        guard_pid, log_path}``. A server that dies or is not healthy in ``timeout_s`` is
        stopped and raises ``RuntimeError`` with the tail of its log."""
        import ray

        if self._proc is not None:
            raise RuntimeError("RewardServerActor.start: already started")
        host = ray.util.get_node_ip_address()
        port = _free_port(host)
        scratch = tempfile.mkdtemp(prefix="weightsync-rm-")
        self.log_path = os.path.join(scratch, f"{self.kind}-server-{port}.log")
        env = {**code_env(), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_RPC_BASE_PATH": os.path.join(scratch, "rpc"), **self.env}
        os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)
        cmd = [sys.executable, "-m", "weightsync.cli", SUBCOMMANDS[self.kind],
               "--model", self.model_dir, "--host", host, "--port", str(port), *self.args]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        atexit.register(self.stop)
        self._guard, self._guard_fd = start_guard(self._proc.pid, self.grace_s)
        self.url = f"http://{host}:{port}"
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return {"url": self.url, "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": host, "pid": self._proc.pid, "guard_pid": self._guard,
                "log_path": self.log_path}

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(urllib.error.URLError, OSError, ValueError), \
                    urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                if r.status == 200:
                    return
            code = self._proc.poll() if self._proc is not None else -1
            if code is not None:
                raise RuntimeError(f"{self.kind} server on {self.url} exited with code {code} "
                                   f"during start-up; last log lines:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} server on {self.url} not healthy after "
                                   f"{timeout_s:.0f} s; last log lines:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n_chars: int = 4000) -> str:
        """The end of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL) and the guard. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc.pid, self.grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            atexit.unregister(self.stop)
        fd, self._guard_fd = self._guard_fd, None
        if fd is not None:
            os.close(fd)  # the guard reads end-of-file, finds the group gone, and exits
        guard, self._guard = self._guard, None
        deadline = time.monotonic() + self.grace_s + 5
        while guard is not None and alive(guard) and time.monotonic() < deadline:
            time.sleep(0.1)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
