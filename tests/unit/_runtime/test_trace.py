"""``weightsync._runtime.trace``: off unless ``WEIGHTSYNC_TRACE_DIR`` is set (then nothing is
written), marks as JSON lines per process when on, and ``benchmarks/trace_timeline.py``'s
reading of them (a real push's trace: ``tests/integration/_runtime/test_trace_push.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from weightsync._runtime import trace


@pytest.fixture
def traced(tmp_path):
    """Tracing on into ``tmp_path`` for one test; off again (and nothing left over) after."""
    trace.flush()
    trace.configure(tmp_path)
    yield tmp_path
    trace.configure(None)
    trace._events.clear()


def _python(code: str, cwd: Path, **env: str) -> str:
    child_env = {k: v for k, v in os.environ.items() if k != trace.ENV}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=child_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_the_variable_marks_record_nothing_and_write_no_file(tmp_path):
    code = ("from weightsync._runtime import trace\n"
            "trace.mark('push.begin', version=1)\n"
            "print(trace.enabled, len(trace._events), trace.flush())")
    assert _python(code, tmp_path) == "False 0 None"
    assert list(tmp_path.iterdir()) == []


def test_the_variable_turns_it_on_at_import_and_exit_flushes(tmp_path):
    code = ("import os\nfrom weightsync._runtime import trace\n"
            "trace.mark('push.begin', version=1)\nprint(os.getpid())")
    pid = _python(code, tmp_path, **{trace.ENV: str(tmp_path / "t")})
    (line,) = (tmp_path / "t" / f"trace-{pid}.jsonl").read_text().splitlines()
    assert json.loads(line)["label"] == "push.begin"  # written at exit (atexit)


def test_marks_become_json_lines_in_time_order_with_their_thread(traced):
    trace.mark("push.begin", version=3)
    worker = threading.Thread(target=trace.mark, args=("lane.vote",), kwargs={"go": True},
                              name="lane")
    worker.start()
    worker.join()
    trace.mark("push.end")
    path = trace.flush()
    assert path == str(traced / f"trace-{os.getpid()}.jsonl")
    events = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [(e["label"], e["thread"], e["fields"]) for e in events] == [
        ("push.begin", threading.current_thread().name, {"version": 3}),
        ("lane.vote", "lane", {"go": True}),
        ("push.end", threading.current_thread().name, {}),
    ]
    times = [e["t_ns"] for e in events]
    assert times == sorted(times) and len(set(times)) == 3
    assert {e["pid"] for e in events} == {os.getpid()}
    assert trace.flush() is None  # flushed events are gone
    trace.mark("push.begin")
    trace.flush()  # appends
    assert len(Path(path).read_text().splitlines()) == 4


def test_a_directory_that_cannot_be_written_drops_the_events_without_raising(traced):
    blocker = traced / "file"
    blocker.write_text("")
    trace.configure(blocker / "sub")  # under a file: makedirs fails
    trace.mark("push.begin")
    assert trace.flush() is None and len(trace._events) == 0


def _event(t_ms: float, pid: int, label: str, **fields) -> dict:
    return {"t_ns": int(t_ms * 1e6), "pid": pid, "thread": "MainThread", "label": label,
            "fields": fields}


def test_the_timeline_splits_pushes_names_processes_and_measures_gaps(tmp_path, trace_timeline):
    tl = trace_timeline
    trainer = [_event(0, 10, "push.begin", version=1), _event(9, 10, "push.end"),
               _event(20, 10, "push.begin", version=2), _event(30, 10, "lane.vote"),
               _event(35, 10, "push.end")]
    engine = [_event(2, 20, "endpoint.start.begin"), _event(22, 20, "endpoint.start.begin"),
              _event(25, 20, "recv.voted"), _event(31, 20, "recv.end")]
    for pid, events in ((10, trainer), (20, engine)):
        lines = [json.dumps(e) for e in events]
        (tmp_path / f"trace-{pid}.jsonl").write_text("\n".join(lines) + "\n{cut by a kill")
    events = tl.read_events(str(tmp_path))
    assert len(events) == 9 and [e["t_ns"] for e in events] == sorted(e["t_ns"] for e in events)
    assert tl.process_names(events) == {10: "trainer", 20: "engine"}
    pushes = tl.split_pushes(events)
    assert [len(p) for p in pushes] == [3, 6]
    rows = tl.timeline(pushes[1], tl.process_names(events))
    assert [(r["ms"], r["proc"], r["label"], r["gap_ms"]) for r in rows] == [
        (0.0, "trainer", "push.begin", None), (2.0, "engine", "endpoint.start.begin", None),
        (5.0, "engine", "recv.voted", 3.0), (10.0, "trainer", "lane.vote", 10.0),
        (11.0, "engine", "recv.end", 6.0), (15.0, "trainer", "push.end", 5.0)]
    table = tl.format_rows(rows, limit=4)
    assert len(table) == 1 + 5 + 1 and "2 events" in table[3]  # header, 2 + ... + 2, gaps
    assert table[-1].startswith("largest gaps") and "trainer lane.vote 10.000 ms" in table[-1]
