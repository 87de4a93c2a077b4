"""Where one push's time went, across the trainer and its engines: a merged timeline.

    WEIGHTSYNC_TRACE_DIR=/tmp/ws-trace <run the trainer and the engines>
    python benchmarks/trace_timeline.py /tmp/ws-trace [--last 1] [--limit 120] [--json OUT]

Reads every ``trace-*.jsonl`` that ``weightsync._runtime.trace`` wrote in the directory (one
per process: the trainer and each engine worker; the variable must reach every process, e.g.
exported before the engines start), merges their events by time (one monotonic clock per
host: the processes must share one) and prints, for each of the last ``--last`` pushes (from
a ``push.begin`` to the next ``push.end`` of the same process), one row per event in that
window: ms since the push began, the process (``trainer``: it has ``push.*`` events;
``engine``: ``endpoint.*`` ones, numbered when there are several; else its pid), the thread,
the label, its fields, and the gap since that process's previous event in the push (the
time its last phase took). Then the largest gaps. ``--json OUT`` writes the same rows.

Reading the labels: ``push.*`` the front door, ``rpc.*`` the sender's control calls,
``feed.*`` chunks handed from the extraction to the lane, ``lane.*`` the sender's
collectives, ``endpoint.*`` the engine's calls, ``recv.*`` the stream's receiver (``post``:
a chunk's receives issued; ``finish``: its bytes arrived; ``load`` / ``in_place``: landed),
``vllm.*`` the vLLM loader.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any


def read_events(directory: str) -> list[dict[str, Any]]:
    """Every event of every ``trace-*.jsonl`` in ``directory``, sorted by time (a line that
    is not JSON, e.g. one cut by a killed process, is skipped)."""
    events = []
    for path in sorted(glob.glob(os.path.join(directory, "trace-*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(e, dict) and "t_ns" in e and "label" in e:
                    events.append(e)
    events.sort(key=lambda e: e["t_ns"])
    return events


def process_names(events: list[dict[str, Any]]) -> dict[int, str]:
    """pid -> ``trainer`` (it pushed), ``engine`` / ``engine1``, ``engine2``... (it ran the
    endpoint; numbered by pid when there are several), else the pid."""
    labels: dict[int, set[str]] = {}
    for e in events:
        labels.setdefault(e["pid"], set()).add(e["label"].split(".", 1)[0])
    engines = sorted(p for p, ls in labels.items() if "endpoint" in ls and "push" not in ls)
    names = {p: str(p) for p in labels}
    for p, ls in labels.items():
        if "push" in ls:
            names[p] = "trainer"
    for i, p in enumerate(engines, start=1):
        names[p] = "engine" if len(engines) == 1 else f"engine{i}"
    return names


def split_pushes(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events of each push, in time order: every event (of any process) from a
    ``push.begin`` to the ``push.end`` of the same process; a push without its end (a killed
    trainer) runs to the last event."""
    pushes = []
    for i, e in enumerate(events):
        if e["label"] != "push.begin":
            continue
        end = next((j for j in range(i + 1, len(events))
                    if events[j]["label"] == "push.end" and events[j]["pid"] == e["pid"]),
                   len(events) - 1)
        pushes.append(events[i : end + 1])
    return pushes


def timeline(push: list[dict[str, Any]], names: dict[int, str]) -> list[dict[str, Any]]:
    """One row per event of ``push``: ``ms`` since its begin, ``proc``, ``thread``, ``label``,
    ``fields`` and ``gap_ms`` since the same process's previous event in the push (None for
    its first)."""
    t0 = push[0]["t_ns"]
    last: dict[int, int] = {}
    rows = []
    for e in push:
        pid, t = e["pid"], e["t_ns"]
        rows.append({"ms": (t - t0) / 1e6, "proc": names.get(pid, str(pid)),
                     "thread": e.get("thread", ""), "label": e["label"],
                     "fields": e.get("fields") or {},
                     "gap_ms": None if pid not in last else (t - last[pid]) / 1e6})
        last[pid] = t
    return rows


def format_rows(rows: list[dict[str, Any]], limit: int = 120, top: int = 5) -> list[str]:
    """The table of one push (at most ``limit`` event rows: the first and last halves when
    there are more; 0: every row), then its ``top`` largest gaps."""
    def line(r: dict[str, Any]) -> str:
        fields = " ".join(f"{k}={v}" for k, v in r["fields"].items())
        gap = "" if r["gap_ms"] is None else f"{r['gap_ms']:.3f}"
        return (f"{r['ms']:9.3f} {gap:>8} {r['proc']:<8.8} {r['thread']:<20.20} "
                f"{r['label']:<22} {fields}").rstrip()

    out = [f"{'ms':>9} {'gap ms':>8} {'proc':<8} {'thread':<20} {'label':<22} fields"]
    shown = rows
    if limit and len(rows) > limit:
        half = limit // 2
        shown = [*rows[:half], None, *rows[-half:]]
    for r in shown:
        out.append(f"{'...':>9} ({len(rows) - 2 * (limit // 2)} events; --limit 0 shows all)"
                   if r is None else line(r))
    gaps = sorted((r for r in rows if r["gap_ms"] is not None), key=lambda r: -r["gap_ms"])
    if gaps:
        out.append("largest gaps (the phase that ends at the label): " + "; ".join(
            f"{r['proc']} {r['label']} {r['gap_ms']:.3f} ms" for r in gaps[:top]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="the WEIGHTSYNC_TRACE_DIR the processes wrote to")
    ap.add_argument("--last", type=int, default=1, help="how many of the last pushes (0: all)")
    ap.add_argument("--limit", type=int, default=120,
                    help="the most event rows per push (the first and last halves; 0: all)")
    ap.add_argument("--json", metavar="OUT", help="write the pushes' rows as JSON to OUT")
    args = ap.parse_args(argv)
    events = read_events(args.directory)
    pushes = split_pushes(events)
    if not pushes:
        print(f"no push in {args.directory} ({len(events)} events; was WEIGHTSYNC_TRACE_DIR "
              f"set in the trainer?)", file=sys.stderr)
        return 1
    names = process_names(events)
    chosen = pushes[-args.last:] if args.last > 0 else pushes
    tables = [timeline(p, names) for p in chosen]
    for k, rows in enumerate(tables, start=len(pushes) - len(chosen) + 1):
        procs = sorted({r["proc"] for r in rows})
        print(f"push {k} of {len(pushes)}: {rows[-1]['ms']:.3f} ms, {len(rows)} events, "
              f"processes {', '.join(procs)}")
        print("\n".join(format_rows(rows, args.limit)))
        print()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(tables, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
