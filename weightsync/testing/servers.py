"""Run a reward or policy server as a real subprocess and always take it down again.

Used by ``weightsync demo``, the integration and GPU tests' server fixtures, the benchmarks and
the examples, in the trainer's process. ``ServerProcess`` starts the server the way a user does,
through the command line (``weightsync serve-reward|serve-policy --model DIR --host H --port P
...``, as ``python -m weightsync.cli``; or ``python -m MODULE ...`` for another module), with
the caller's environment less what only the caller's own process needs
(``CALLER_ONLY_ENV``), in its own session (so vLLM's engine-core children go down with it),
sends its output to a log file, waits for ``GET /health`` while reporting progress, and stops
the whole process group on ``stop()``, on leaving a ``with`` block, and at interpreter exit
(atexit), whichever comes first. A server that dies during start-up raises ``RuntimeError``
with the tail of its log. ``RewardServerProcess`` (``weightsync.servers.reward``) and
``PolicyServerProcess`` (``weightsync.servers.policy``, i.e. ``weightsync serve-policy``) only
fix module and label. ``stop_together`` stops several at once. ``started_or_attached`` is what
the examples use: a server of their own, or one already running at a URL they were given.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def signals_raise_system_exit() -> Iterator[None]:
    """While active, SIGTERM / SIGHUP raise ``SystemExit(128 + signum)`` so that ``finally``
    blocks and context managers (``RewardServerProcess.__exit__``) run. Python's default
    action for SIGTERM ends the process without them (and without atexit), which would orphan
    the server. Only in the main thread (signals are delivered there); elsewhere a no-op."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


#: variables a test or trainer process sets for its own in-process engines that a user starting
#: a server does not set: a server never inherits them (``env=`` passes one on on purpose)
CALLER_ONLY_ENV = ("VLLM_WORKER_MULTIPROC_METHOD",)


def vllm_scratch_env(scratch_dir: str) -> dict[str, str]:
    """Environment that keeps vLLM's cache and IPC sockets inside ``scratch_dir``: this
    process's, less ``CALLER_ONLY_ENV``."""
    env = {k: v for k, v in os.environ.items() if k not in CALLER_ONLY_ENV}
    env.setdefault("VLLM_CACHE_ROOT", os.path.join(scratch_dir, "vllm-cache"))
    env.setdefault("VLLM_RPC_BASE_PATH", os.path.join(scratch_dir, "vllm-rpc"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")  # the log tail in an error is the latest output
    os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)
    return env


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_core_slots(n: int, cores: Sequence[int] | None = None) -> list[str | None]:
    """Disjoint core lists (``VLLM_CPU_OMP_THREADS_BIND`` syntax, e.g. ``"0"``, ``"4-7"``) for
    ``n`` vLLM CPU engines started on this machine together; ``None`` for each (vLLM's own
    binding) when the user set that variable, when ``n < 2`` or when there are fewer cores
    than engines.

    Why: vLLM binds every CPU engine's worker to the same cores by itself (on a 2-core machine,
    core 0), so two servers on one box share one core. One that decodes at full speed then
    starves the other's gloo threads: a 0.1 MB weight chunk into the reward server took 15-25 s
    while the policy server generated (measured here, issue 12's load test). The slots split
    the cores this process may use into ``n`` contiguous runs; one core is left to the front
    ends (API servers, the trainer) when there are at least ``2n + 1``. The servers bind each
    vLLM engine core to its workers' slot too (``weightsync._runtime.cpu_binding``).
    ``cores``: default the cores this process may run on.
    """
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if n < 2 or len(cores) < n or os.environ.get(CPU_BIND_ENV):
        return [None] * n
    usable = cores[:-1] if len(cores) >= 2 * n + 1 else cores
    per = len(usable) // n
    slots = []
    for i in range(n):
        run = usable[i * per:(i + 1) * per]
        slots.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return slots


class ServerProcess:
    """One server subprocess (``python -m module``) on ``host:port``, owned by the calling
    process; ``label`` names it in messages and in its log file's name. ``scratch_dir``: where
    vLLM's cache and IPC sockets go (``vllm_scratch_env``); default a short-named temporary
    directory of its own, removed by ``stop``. ``port``: default a free one; ``log_path``:
    default ``scratch_dir/<label>-<port>.log``; ``env``: added to the environment, e.g.
    ``CUDA_VISIBLE_DEVICES``; ``cpu_cores``: the cores a CPU engine's worker is bound to
    (``VLLM_CPU_OMP_THREADS_BIND``; one of ``cpu_core_slots``), default vLLM's choice."""

    module = ""
    subcommand = ""  # the ``weightsync`` subcommand that starts this server, if any
    label = "server"

    def __init__(
        self,
        model_dir: str,
        *,
        scratch_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        module: str | None = None,
        log_path: str | None = None,
        env: Mapping[str, str] | None = None,
        cpu_cores: str | None = None,
    ) -> None:
        if module is None and self.subcommand:
            launch = ["weightsync.cli", self.subcommand]
        else:
            module = module or self.module
            if not module:
                raise ValueError("ServerProcess: give module= (e.g. 'weightsync.servers.reward')")
            launch = [module]
        self.model_dir = model_dir
        self._remove_scratch: Callable[[], Any] | None = None
        if scratch_dir is None:  # short: vLLM's IPC socket paths must stay under ~107 bytes
            scratch_dir = tempfile.mkdtemp(prefix="weightsync-server-")
            self._remove_scratch = weakref.finalize(self, shutil.rmtree, scratch_dir, True)
        self.host = host
        self.port = port or free_port(host)
        slug = self.label.replace(" ", "-")
        self.log_path = log_path or os.path.join(scratch_dir, f"{slug}-{self.port}.log")
        self.cmd = [
            sys.executable, "-m", *launch, "--model", model_dir,
            "--host", host, "--port", str(self.port), *extra_args,
        ]
        self._env = {**vllm_scratch_env(scratch_dir), **(env or {})}
        self.cpu_cores = cpu_cores
        if cpu_cores is not None:
            self._env[CPU_BIND_ENV] = cpu_cores
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def env(self) -> dict[str, str]:
        """The environment the subprocess gets (a copy)."""
        return dict(self._env)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> ServerProcess:
        """Launch the subprocess (returns at once; use ``wait_healthy`` to wait for it)."""
        if self._proc is not None:
            raise RuntimeError(f"{type(self).__name__}.start: already started")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self._env,
            start_new_session=True,
        )
        atexit.register(self.stop)
        return self

    def start_healthy(self, *, timeout_s: float = 240.0,
                      progress: Callable[[str], None] | None = None) -> ServerProcess:
        """``start`` and ``wait_healthy``; a server that does not come up is stopped again."""
        self.start()
        try:
            self.wait_healthy(timeout_s=timeout_s, progress=progress)
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def last_log_line(self, max_chars: int = 90) -> str:
        """The server's latest non-empty log line, shortened (for progress messages)."""
        lines = [ln.strip() for ln in self.log_tail(2000).splitlines() if ln.strip()]
        if not lines:
            return ""
        line = lines[-1]
        return line if len(line) <= max_chars else line[: max_chars - 3] + "..."

    def health(self, timeout_s: float = 2.0) -> dict | None:
        """The parsed ``/health`` answer, or None while the server is not answering."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as r:
                return json.loads(r.read() or b"{}") if r.status == 200 else None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return None

    def wait_healthy(
        self,
        *,
        timeout_s: float = 240.0,
        progress: Callable[[str], None] | None = None,
        every_s: float = 5.0,
    ) -> float:
        """Block until ``/health`` answers 200; -> seconds waited. Raises if the server dies or
        ``timeout_s`` passes (the log tail is in the message)."""
        if self._proc is None:
            raise RuntimeError(f"{type(self).__name__}.wait_healthy: call start() first")
        t0 = time.monotonic()
        next_report = t0 + every_s
        while True:
            if self.health() is not None:
                return time.monotonic() - t0
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.label} exited with code {code} during start-up "
                    f"(command: {' '.join(self.cmd)}); last log lines:\n{self.log_tail()}"
                )
            now = time.monotonic()
            if now - t0 > timeout_s:
                error = TimeoutError(
                    f"{self.label} not healthy after {timeout_s:.0f}s at {self.url}; "
                    f"last log lines:\n{self.log_tail()}"
                )
                self.stop()
                raise error
            if progress is not None and now >= next_report:
                last = self.last_log_line()
                progress(
                    f"waiting for {self.label} ... {now - t0:.0f}s"
                    + (f" (log: {last})" if last else "")
                )
                next_report = now + every_s
            time.sleep(0.25)

    def terminate(self) -> None:
        """Send SIGTERM to the server's process group and return at once (``stop`` waits);
        lets a caller with several servers have them shut down together."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the server's whole process group (SIGTERM, then SIGKILL). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # the group may outlive its leader (engine-core children, Python's resource
            # tracker, which unlinks vLLM's /dev/shm segments once they are gone): let it
            # leave by itself for a moment (a SIGKILL first leaks the segments), then make sure
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                try:
                    os.killpg(proc.pid, 0)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            atexit.unregister(self.stop)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._remove_scratch is not None:
            self._remove_scratch()

    def __enter__(self) -> ServerProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RewardServerProcess(ServerProcess):
    """The reward server (``weightsync serve-reward``) as a subprocess."""

    module = "weightsync.servers.reward"
    subcommand = "serve-reward"
    label = "reward server"


class PolicyServerProcess(ServerProcess):
    """The policy server (``weightsync serve-policy``) as a subprocess."""

    module = "weightsync.servers.policy"
    subcommand = "serve-policy"
    label = "policy server"


def stop_together(servers: Sequence[ServerProcess]) -> None:
    """Stop several servers at once: SIGTERM to all, then wait for each (their shutdowns
    overlap instead of adding up)."""
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop()


@contextlib.contextmanager
def started_or_attached(
    servers: Sequence[tuple[type[ServerProcess], str, str | None]],
    *,
    scratch_dir: str,
    extra_args: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    timeout_s: float = 300.0,
) -> Iterator[list[str]]:
    """Yield the base URLs of healthy servers, one per ``(server_cls, model_dir, url)``: ``url``
    as given (a server someone else runs on ``model_dir``'s checkpoint; left running), or a
    ``server_cls`` started on ``model_dir``. The ones started here start together (each CPU
    engine on cores of its own: ``cpu_core_slots``), are waited for, and are stopped on leaving
    (SIGTERM / SIGHUP included)."""
    started: list[ServerProcess] = []
    slots = iter(cpu_core_slots(sum(1 for _, _, url in servers if not url)))
    with signals_raise_system_exit():
        try:
            urls: list[str] = []
            for server_cls, model_dir, url in servers:
                if url:
                    urls.append(url.rstrip("/"))
                    continue
                server = server_cls(model_dir, scratch_dir=scratch_dir, extra_args=extra_args,
                                    cpu_cores=next(slots))
                started.append(server.start())
                urls.append(server.url)
                if progress is not None:
                    progress(f"{server.label} starting (pid {server.pid}, log {server.log_path})")
            for server in started:
                server.wait_healthy(timeout_s=timeout_s, progress=progress)
            yield urls
        finally:
            stop_together(started)
