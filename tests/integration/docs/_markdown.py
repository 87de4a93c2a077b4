"""Reading the docs as a user does: their code blocks, the command lines in them, and whether an
output has the shape a page shows.

- ``blocks(text)``: fenced blocks in order, as ``Block(lang, body, marker)``; ``marker`` is the
  ``<!-- quickstart: NAME -->`` comment on the line before a fence, if any.
- ``command_lines(text)``: every command line of a page: the lines of ``bash`` / ``sh`` /
  ``shell`` / ``console`` fences, and the lines of indented (4-space) code blocks that start
  with a command (``weightsync``, ``python``, ``pytest``, ``bash``, ``export``, ``VAR=...``);
  continuation lines joined, trailing ``# comments`` dropped. Inline code in prose is not a
  command line.
- ``same_shape(expected, actual)``: an output line as a page shows it vs one printed: equal once
  numbers and quoted strings are wildcards and runs of spaces are one space; ``assert_shape``
  for a whole output, ``with_ports`` for a page's ports replaced by free ones, ``wait_for_line``
  for a server's ready line in its log.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*quickstart:\s*(\S+)\s*-->\s*$")
_SHELL = ("bash", "sh", "shell", "console")
_COMMAND_START = re.compile(r"^(weightsync|python|pytest|bash|export|curl|[A-Z_][A-Z0-9_]*=\S*)\b")


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    marker: str | None


def blocks(text: str) -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        marker = _MARKER.match(lines[i - 1]) if i else None
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        out.append(Block(m.group(1), "\n".join(lines[i + 1:j]), marker and marker.group(1)))
        i = j + 1
    return out


def _logical_lines(raw: list[str]) -> list[str]:
    out, pending = [], ""
    for line in raw:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        out.append((pending + line.strip()).strip())
        pending = ""
    return out


def _strip_comment(line: str) -> str:
    # a '#' that starts a comment: at the line's start or after a space, outside quotes
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1] == " "):
            return line[:i].rstrip()
    return line.rstrip()


def command_lines(text: str) -> list[str]:
    commands: list[str] = []
    fence: str | None = None  # the language of the fence we are in
    body: list[str] = []  # the lines of that fence, or of the indented block we are in
    for line in text.splitlines() + [""]:
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence, body = opening.group(1), []
            continue
        if fence is not None:
            if line.rstrip() != "```":
                body.append(line)
                continue
            if fence in _SHELL:
                commands += [c for c in map(_strip_comment, _logical_lines(body)) if c]
            fence, body = None, []
            continue
        if line.startswith("    ") and line.strip():
            body.append(line)
            continue
        commands += [c for c in map(_strip_comment, _logical_lines(body))
                     if _COMMAND_START.match(c)]
        body = []
    return commands


_NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
_QUOTED = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""


def _shape(line: str) -> str:
    # a table's rule ('----  ---') is as wide as the values under it: only its columns count
    line = re.sub(r"-{2,}", "-", line.strip()) if set(line.strip()) <= {"-", " "} else line
    line = re.sub(_QUOTED, "Q", line.strip())
    line = re.sub(_NUMBER, "N", line)
    return re.sub(r"\s+", " ", line)


def same_shape(expected: str, actual: str) -> bool:
    return _shape(expected) == _shape(actual)


def with_ports(text: str, ports: dict[str, str]) -> str:
    for doc_port, port in ports.items():
        text = text.replace(f":{doc_port}", f":{port}").replace(f"--port {doc_port}",
                                                                f"--port {port}")
    return text


def assert_shape(expected: str, output: str) -> None:
    """Each line the page shows has a line of that shape in ``output``, in order (a bench's
    ``verdict:`` line only by its start: the winner varies from run to run)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    at = 0
    for want in (ln for ln in expected.splitlines() if ln.strip()):
        if want.startswith("verdict: "):  # the winner varies from run to run
            hit = next((i for i in range(at, len(lines)) if lines[i].startswith("verdict: ")),
                       None)
        else:
            hit = next((i for i in range(at, len(lines)) if same_shape(want, lines[i])), None)
        assert hit is not None, f"expected a line like\n  {want}\nin:\n{output[-4000:]}"
        at = hit + 1


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line of the log at ``path`` that starts with ``needle``, waited for while
    ``proc`` (the server writing it) lives, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(needle):
                return line
        assert proc.poll() is None, f"server exited:\n{path.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no '{needle}' after {timeout_s} s:\n{path.read_text()[-3000:]}")
