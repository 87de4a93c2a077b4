"""Progress lines, bars and the closing summary table of ``weightsync demo`` (and the
benchmarks).

Pure formatting, no heavy imports. ``Progress`` prints ``[  12.3s] message`` lines to a stream
(stdout by default), flushed at once so a user watching a slow start sees where it is;
``progress_bar`` draws the bar the RLHF loop puts in each step's line; ``nan_to_none`` makes a
result's ``--json`` record (a NaN, "not measured", becomes null).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO


class Progress:
    """Time-stamped progress lines; ``quiet=True`` swallows them (tests, library use)."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed:6.1f}s] {msg}", file=self.stream, flush=True)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[########------------]  4/10``: a text bar that survives logs and CI output."""
    total = max(total, 1)
    filled = round(width * min(max(done, 0), total) / total)
    digits = len(str(total))
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{digits}}/{total}"


def nan_to_none(x: Any) -> Any:
    """``x`` with every NaN float, also inside dicts and lists, replaced by None (a JSON
    record's "not measured")."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [nan_to_none(v) for v in x]
    return x


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0.0:
            return "0"
        if abs(v) < 1e-3 or abs(v) >= 1e7:
            return f"{v:.3e}"
        return f"{v:.1f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with a header rule; numbers right-aligned, text left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    numeric = [
        all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows)
        for i in range(len(headers))
    ]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(vals, widths, numeric, strict=True)
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def format_markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table as GitHub markdown (for docs/benchmarks.md)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out.extend("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)
    return "\n".join(out)
