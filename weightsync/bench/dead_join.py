"""Trainers that ask a server for a communicator and never complete the join: the disturbance of
``benchmarks/bench_load_during_syncs.py --disturb killed-join|silent-join`` and of the servers'
dead-join tests.

Callers: the benchmark and ``tests/integration/servers/test_servers_trainer_killed.py``, in the
trainer's (or test's) process. Each one leaves the server's workers waiting in a rendezvous that
will not complete, for real:

* ``KilledLudicTrainer``: a separate process speaks the Ludic/TRL protocol, ``POST
  /init_communicator {host, port, world_size}`` (the server answers at once; its worker 0 now
  hosts the group's store and waits for the trainer to join) and is SIGKILLed before it joins
  (``os.kill(os.getpid(), SIGKILL)``, nothing cleaned up). The workers wait until the server's
  ``--group-timeout-s``, or until a later ``/init_communicator`` / ``/close_communicator``.
* ``SilentSender``: our dialect, a sender that hosts its rendezvous store (as a real one does
  before ``/init_communicator``) and asks for a ``broadcast`` communicator, but never joins its
  own group. Its ``/init_communicator`` request waits for the join, so it runs in a thread; the
  workers wait until ``join_timeout_s``.
* ``killed_mid_join``: our dialect, a separate process hosts its store, sends
  ``/init_communicator`` and is SIGKILLed while that request is outstanding and the workers are
  joining its group (the store dies with it).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from typing import Any

#: the Ludic trainer's whole life: ask for the group, then die before joining it
_LUDIC_THEN_DIE = """
import os, signal, sys, httpx
url, port, world, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
r = httpx.post(url + "/init_communicator", json={"host": "127.0.0.1", "port": port,
               "world_size": world}, headers={"Authorization": "Bearer " + key}, timeout=60)
print("INIT", r.status_code, r.text, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

#: our dialect: host the store, ask for the communicator, die while the workers join
_OURS_THEN_DIE = """
import datetime, os, signal, sys, threading, time
import httpx, torch.distributed as dist
url, world, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
body = {"strategy": {"type": "broadcast", "backend": "gloo"},
        "sync_info": {"type": "torch_distributed", "master_addr": "127.0.0.1",
                      "master_port": store.port, "world_size": world, "join_timeout_s": 60}}
threading.Thread(target=lambda: httpx.post(url + "/init_communicator", json=body, timeout=120,
                 headers={"Authorization": "Bearer " + key}), daemon=True).start()
while not store.check(["weightsync/weightsync/joined/1"]):  # a worker is in the group's join
    time.sleep(0.01)
print("JOINING", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _run_to_death(code: str, *args: str, timeout_s: float = 120.0) -> str:
    """Run ``code`` in a new process until it SIGKILLs itself; -> its output."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != -9:
        raise RuntimeError(f"the dying trainer ended with {proc.returncode}, not SIGKILL: "
                           f"{proc.stdout[-500:]} {proc.stderr[-1500:]}")
    return proc.stdout


class KilledLudicTrainer:
    """``start()``: the Ludic trainer process asks ``url`` for a group of ``workers + 1`` ranks
    on ``port`` and is SIGKILLed; returns once it is dead (the join is then pending)."""

    def __init__(self, url: str, api_key: str, *, port: int, workers: int = 1) -> None:
        self.url, self.api_key, self.port, self.workers = url, api_key, port, workers
        self.output = ""

    def start(self) -> KilledLudicTrainer:
        self.output = _run_to_death(_LUDIC_THEN_DIE, self.url, str(self.port),
                                    str(self.workers + 1), self.api_key)
        if "INIT 200" not in self.output:
            raise RuntimeError(f"the server did not accept the group: {self.output}")
        return self


def killed_mid_join(url: str, api_key: str, *, workers: int = 1) -> str:
    """Our dialect's sender SIGKILLed while the workers join its group; -> its output."""
    return _run_to_death(_OURS_THEN_DIE, url, str(workers + 1), api_key)


class SilentSender:
    """Hosts a rendezvous store and asks ``url`` for a ``broadcast`` communicator that it never
    joins; ``answer`` is the HTTP answer once the server gave up (``join_timeout_s``) or
    abandoned the join (``None`` until then)."""

    def __init__(self, url: str, api_key: str, *, join_timeout_s: float, workers: int = 1
                 ) -> None:
        import torch.distributed as dist

        self.url, self.api_key = url, api_key
        self.store = dist.TCPStore("127.0.0.1", 0, workers + 1, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=join_timeout_s + 30))
        self.body = {"strategy": {"type": "broadcast", "backend": "gloo"},
                     "sync_info": {"type": "torch_distributed", "master_addr": "127.0.0.1",
                                   "master_port": self.store.port, "world_size": workers + 1,
                                   "join_timeout_s": join_timeout_s}}
        self.answer: Any = None
        self.seconds = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> SilentSender:
        import httpx

        def ask() -> None:
            t0 = time.monotonic()
            self.answer = httpx.post(self.url + "/init_communicator", json=self.body,
                                     headers={"Authorization": f"Bearer {self.api_key}"},
                                     timeout=None)
            self.seconds = time.monotonic() - t0

        self._thread = threading.Thread(target=ask, name="silent-sender", daemon=True)
        self._thread.start()
        while not self.store.check(["weightsync/weightsync/joined/1"]):  # the workers joined it
            time.sleep(0.01)
        return self

    def join(self, timeout_s: float | None = None) -> Any:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.answer
