"""An opt-in timeline of one update across the trainer and its engines (off by default).

Set ``WEIGHTSYNC_TRACE_DIR=DIR`` in the environment of the trainer and of the engines (read
once, at import; ``configure(dir)`` sets it in a running process, e.g. a test) and every
``mark(label, **fields)`` on the update path records ``(time.perf_counter_ns(), label, fields,
thread name)`` in a per-process in-memory list. ``flush()`` appends the recorded events as JSON
lines to ``DIR/trace-<pid>.jsonl`` and clears the list; ``benchmarks/trace_timeline.py DIR``
merges every process's file into one table per push.

Who calls what, in which process:

* ``mark``: phase boundaries of the update path, never per tensor: the front door
  (``connect.py``: ``push.*``), the broadcast sender's control calls and the vLLM driver's
  thread that carries them (``rpc.*``), the vLLM worker extension's entry and answer
  (``worker.*``, each engine worker), the stream's
  feed (``feed.*``, the trainer's event loop) and lane (``lane.*``, the trainer's lane thread),
  the endpoint (``endpoint.*``, each engine worker), the stream's receiver (``recv.*``) and the
  vLLM loader (``vllm.*``). Any thread may call it.
* ``flush``: the trainer at the end of each push, each engine worker at the end of each
  ``finish_weight_update`` (so a process killed later still leaves every update it finished;
  it runs after the ``endpoint.finish.end`` mark, inside the call the trainer waits for), and
  ``atexit`` for what is left (a process that leaves through ``os._exit`` skips it).

Cost when off: ``mark`` returns after one check of a module-level bool (plus the call and its
keyword arguments, which callers keep to values they already hold; ~70 ns a call on a 2-core
CPU). When on: one ``perf_counter_ns``, one thread lookup and one ``deque.append``
(thread-safe, no lock, no I/O; ~0.4 us); the I/O is ``flush``'s (~0.6 ms for 100 events).
Thread names are the threads' own: a pooled ``in_thread`` worker keeps the name of the job
that started it (``weightsync-io-1``, ``ws-checksum-3``) whatever it runs later.

Times: ``perf_counter_ns`` is ``clock_gettime(CLOCK_MONOTONIC)`` on Linux (see
``time.get_clock_info("perf_counter")``): one clock for every process of a host, so events of
the trainer and of engines on the same host line up. Processes on different hosts do not share
it (their times cannot be merged).
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: the environment variable that turns tracing on: the directory the trace files go to
ENV = "WEIGHTSYNC_TRACE_DIR"

_dir: str | None = os.environ.get(ENV) or None
#: whether ``mark`` records (read by ``mark`` on every call: the whole cost when off)
enabled: bool = _dir is not None
_events: collections.deque[tuple[int, str, dict[str, Any], str]] = collections.deque()
_write_lock = threading.Lock()


def configure(directory: str | os.PathLike[str] | None) -> None:
    """Trace into ``directory`` from now on (None: stop recording; what was recorded stays
    until the next ``flush``)."""
    global _dir, enabled
    _dir = os.fspath(directory) if directory is not None else None
    enabled = _dir is not None


def mark(label: str, **fields: Any) -> None:
    """Record that ``label`` happened now on this thread (``fields``: JSON-safe values, e.g.
    a chunk number and its bytes). Does nothing unless tracing is on."""
    if not enabled:
        return
    _events.append((time.perf_counter_ns(), label, fields, threading.current_thread().name))


class span:  # noqa: N801 - used as ``with trace.span(...)``, like a function
    """``with span("endpoint.start"):`` marks ``endpoint.start.begin`` on entry and
    ``endpoint.start.end`` on exit (an exception too)."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __enter__(self) -> None:
        mark(self.label + ".begin")

    def __exit__(self, *exc: Any) -> None:
        mark(self.label + ".end")


def flush() -> str | None:
    """Append every event recorded so far to ``DIR/trace-<pid>.jsonl`` (one JSON object per
    line: ``t_ns``, ``pid``, ``thread``, ``label``, ``fields``) and forget them; -> the file's
    path, or None when nothing was written (tracing off, no events, or the write failed: it
    logs a warning and never raises for I/O, so a trace cannot fail the update it watches)."""
    directory = _dir
    if directory is None or not _events:
        return None
    pid = os.getpid()
    lines = []
    while True:
        try:
            t_ns, label, fields, thread = _events.popleft()
        except IndexError:
            break
        lines.append(json.dumps({"t_ns": t_ns, "pid": pid, "thread": thread, "label": label,
                                 "fields": fields}, default=str))
    path = os.path.join(directory, f"trace-{pid}.jsonl")
    try:
        with _write_lock:
            os.makedirs(directory, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    except OSError as e:  # a trace never fails the update it watches
        log.warning("weightsync trace: could not write %s (%s); %d events dropped", path, e,
                    len(lines))
        return None
    return path


atexit.register(flush)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_events.clear)  # the parent's events are the parent's
