"""Exceptions with messages that say what was expected, what came, and what to do, and the one
codec that carries them across process boundaries.

Who uses the codec: every place where an error leaves one process and is raised in another (a
local engine's child process, a vLLM worker answering ``collective_rpc``, a Ray actor, an HTTP
control plane). The wire form is one JSON dict::

    {"error_type": "WeightMismatchError", "error": "<message>", "offenders": ["<line>", ...]}

``error_to_dict`` makes it, ``error_from_dict`` rebuilds the matching exception (naming the
engine and the method it failed in), ``http_status`` / ``error_from_http`` map it to and from an
HTTP answer. ``most_telling`` picks which of several engines' failures to raise (the one policy
every fan-out follows). Pure Python; no heavy imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class WeightSyncError(RuntimeError):
    """Base class for weightsync failures."""


class WeightMismatchError(WeightSyncError, ValueError):
    """Update metadata does not match the target model. Raised before any byte moves.

    ``offenders`` lists one human-readable line per offending parameter. The message says what
    to do: tensors sent in another dtype than the target's (``"<name>: dtype <sent> but target
    has <served>"``) are summed up in one line per dtype pair that names the fix,
    ``push(..., dtype="<served>")`` (for an engine holding FP8 weights: ``ws.connect(...,
    quantize=...)``); every other offender gets a line of its own.
    """

    def __init__(self, offenders: Sequence[str], *, target: str = "target model") -> None:
        self.offenders = list(offenders)
        summary = _summarize_offenders(self.offenders)
        shown = summary[:20]
        more = len(summary) - len(shown)
        lines = "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(
            f"{len(self.offenders)} parameter(s) do not match the {target}; nothing was "
            f"loaded:\n  {lines}"
        )
        self.target = target

    def __reduce__(self):  # keep offenders and message intact through pickle (Ray, multiprocessing)
        return (_rebuild_mismatch, (type(self), self.offenders, self.target))


_DTYPE_OFFENDER = re.compile(r"^(?P<name>.+): dtype (?P<sent>\S+) but target has (?P<served>\S+)$")


def _summarize_offenders(offenders: Sequence[str]) -> list[str]:
    """The message's lines: each dtype pair once (with the fix), the rest as they are."""
    groups: dict[tuple[str, str], list[str]] = {}
    lines: list[str | tuple[str, str]] = []
    for line in offenders:
        m = _DTYPE_OFFENDER.match(line)
        if m is None:
            lines.append(line)
            continue
        key = (m["sent"], m["served"])
        if key not in groups:
            groups[key] = []
            lines.append(key)
        groups[key].append(m["name"])
    out = []
    for item in lines:
        if isinstance(item, str):
            out.append(item)
            continue
        (sent, served), names = item, groups[item]
        fix = _dtype_fix(sent, served)
        if len(names) == 1:
            out.append(f"{names[0]}: dtype {sent} but target has {served}; {fix}")
        else:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            out.append(f"{len(names)} tensors ({shown}) are {sent} but the target holds "
                       f"{served}; {fix}")
    return out


def _dtype_fix(sent: str, served: str) -> str:
    """How to send ``served`` instead of ``sent``: a cast, or for an engine that holds FP8
    weights (with scales a cast does not make) the sender-side quantisation."""
    if served.startswith("float8") and not sent.startswith("float8"):
        return ("the engine serves FP8 weights: ws.connect(..., quantize=<its checkpoint "
                "directory>) quantises them on the sender (weightsync.fp8)")
    return f"send {served}: push(..., dtype=\"{served}\") casts on the way"


def _rebuild_mismatch(cls: type, offenders: list[str], target: str) -> WeightMismatchError:
    return cls(offenders, target=target)


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A peer did not answer within the configured timeout (it may have died)."""


class CollectiveError(WeightSyncError):
    """A data-plane collective failed on this side: a peer died, hangs, or left the group.
    Usually the follow-on of another engine's failure, so the fan-out ranks it last."""


class CollectiveTimeout(CollectiveError, WeightSyncTimeout):
    """A data-plane collective did not complete within its timeout (a peer stopped answering)."""


class EngineSilentError(WeightSyncTimeout):
    """An engine gave no answer while another engine of the same call had already failed:
    stuck (a stopped process, a hung collective) or just slow. Ranked above the follow-on
    collective errors of the others, below any real error."""


class UpdateIncompleteError(WeightSyncError):
    """The engine holds a partially applied update and refuses to serve until a complete one
    lands."""


class EngineDiedError(WeightSyncError):
    """An engine (process, worker or actor) is gone. Preferred over the follow-on errors its
    death causes on the other engines (e.g. their collective failing)."""


class EngineUnreachableError(WeightSyncError, ConnectionError):
    """Nothing answers at an engine's address and nothing ever did in this session (connection
    refused from the first call): a wrong URL or port, or a server not started (yet). Unlike
    ``EngineDiedError``, no engine was lost; the message says what to check."""


class UpdateRefusedError(WeightSyncError):
    """The engine refused a control call for its current state (an older version, a chunk
    without its start, a closed endpoint, ...); the data plane did not move (HTTP 409)."""


class CommunicatorReplacedError(UpdateRefusedError):
    """The engine's receivers now belong to another sender (or were closed); connect again."""


class DeltaBaseMismatchError(UpdateRefusedError):
    """The engine cannot apply a delta update: it does not serve the delta's base version, or
    no longer holds what the delta needs (``weightsync.delta``). Raised at the start, before
    any byte moves; the sender then sends a full update."""


class ManifestUnknownError(UpdateRefusedError):
    """A start that refers to the manifest of an earlier update (``manifest_of``) reached an
    engine that does not hold that manifest (restarted, or it parsed another one since):
    refused before anything changed; the sender sends the manifest in full."""


class ChecksumMismatchError(WeightSyncError):
    """The bytes an engine received are not the bytes the sender sent (``weightsync.integrity``):
    the update fails like any other fault. ``offenders`` lists one line per tensor."""

    def __init__(self, message: str, offenders: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.offenders = list(offenders)

    def __reduce__(self):  # keep offenders through pickle (Ray, multiprocessing)
        return (type(self), (str(self), self.offenders))


# --------------------------------------------------------------------------------------------
# codec: exception <-> JSON dict <-> HTTP status
# --------------------------------------------------------------------------------------------

#: error_type -> class rebuilt on the receiving side (anything else becomes a WeightSyncError)
ERROR_TYPES: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        WeightSyncError, WeightMismatchError, WeightSyncTimeout, UpdateIncompleteError,
        EngineDiedError, EngineUnreachableError, UpdateRefusedError, CommunicatorReplacedError,
        DeltaBaseMismatchError, ManifestUnknownError, ChecksumMismatchError,
        CollectiveError, CollectiveTimeout, EngineSilentError, ValueError, TypeError,
    )
}
ERROR_TYPES["TimeoutError"] = WeightSyncTimeout

#: HTTP status of each error class; the most specific class in the MRO wins, anything else 500
_HTTP_STATUS: dict[type[BaseException], int] = {
    WeightMismatchError: 400,
    ValueError: 400,
    TypeError: 400,
    ChecksumMismatchError: 422,
    UpdateIncompleteError: 503,
    CollectiveTimeout: 504,
    CollectiveError: 502,
    WeightSyncTimeout: 504,
    TimeoutError: 504,
    EngineDiedError: 502,
    EngineUnreachableError: 502,
    UpdateRefusedError: 409,
    WeightSyncError: 409,
}


def error_to_dict(e: BaseException) -> dict[str, Any]:
    """``{"error_type", "error", "offenders"}`` for any exception (plain JSON data)."""
    return {
        "error_type": type(e).__name__,
        "error": str(e)[:4000],
        "offenders": [str(o) for o in getattr(e, "offenders", None) or []][:500],
    }


def error_from_dict(
    d: Mapping[str, Any], *, engine: str | None = None, method: str | None = None
) -> BaseException:
    """The exception for a wire dict, its message prefixed with ``engine`` and ``method``.

    Known types come back as themselves (``WeightMismatchError`` with its offenders); a type
    this side does not know becomes a ``WeightSyncError`` that keeps the remote type's name.
    """
    kind = str(d.get("error_type") or "WeightSyncError")
    msg = str(d.get("error", d.get("message", "")))
    where = _where(engine, method)
    cls = ERROR_TYPES.get(kind)
    if cls is WeightMismatchError or (cls is None and d.get("offenders")):
        target = f"model of {where}" if where else "target model"
        return WeightMismatchError(list(d.get("offenders") or [msg]), target=target)
    prefix = f"{where}: " if where else ""
    if cls is None:
        return WeightSyncError(f"{prefix}{kind}: {msg}")
    if cls is ChecksumMismatchError:
        return ChecksumMismatchError(f"{prefix}{msg}", list(d.get("offenders") or []))
    return cls(f"{prefix}{msg}")


#: how ``error_to_text`` marks the wire dict inside a message
_TEXT_MARK = ("[weightsync-error ", " weightsync-error]")


def error_to_text(e: BaseException) -> str:
    """A readable message for ``e`` that also carries its wire dict, for a transport that
    passes on nothing but a message (vLLM's ``collective_rpc`` and its HTTP routes turn a
    worker's exception into text); ``error_from_text`` reads it back."""
    import json

    return f"{type(e).__name__}: {e} {_TEXT_MARK[0]}{json.dumps(error_to_dict(e))}{_TEXT_MARK[1]}"


def error_from_text(text: str, *, engine: str | None = None,
                    method: str | None = None) -> BaseException | None:
    """The exception ``error_to_text`` wrote somewhere into ``text`` (a decoded message, not
    one still escaped inside a JSON body), or None when there is none."""
    import json

    start = text.find(_TEXT_MARK[0])
    end = text.rfind(_TEXT_MARK[1])
    if start < 0 or end < start:
        return None
    try:
        d = json.loads(text[start + len(_TEXT_MARK[0]):end])
    except ValueError:
        return None
    return error_from_dict(d, engine=engine, method=method) if isinstance(d, dict) else None


def http_status(e: BaseException | type[BaseException] | str) -> int:
    """The HTTP status that answers ``e`` (an exception, its class or its ``error_type``)."""
    cls = ERROR_TYPES.get(e, WeightSyncError) if isinstance(e, str) else (
        e if isinstance(e, type) else type(e)
    )
    if isinstance(e, str) and e not in ERROR_TYPES:
        return 500
    for base in cls.__mro__:
        if base in _HTTP_STATUS:
            return _HTTP_STATUS[base]
    return 500


def error_from_http(status: int, body: Any, *, where: str) -> BaseException:
    """The exception for an HTTP error answer ``{"detail", "error_type"?, "offenders"?}``.

    With ``error_type`` the exact class comes back; without it the status decides: 400 with
    offenders -> ``WeightMismatchError``, 400 -> ``ValueError``, 409 -> ``UpdateRefusedError``
    (``CommunicatorReplacedError`` when the reason says the communicator was replaced), 502 ->
    ``EngineDiedError``, 422 -> ``ChecksumMismatchError``, 503 -> ``UpdateIncompleteError``, 504 -> ``WeightSyncTimeout``,
    anything else ``WeightSyncError``. OpenAI's shape ``{"error": {"message", ...}}`` (vLLM's
    OpenAI routes) gives its message as the detail.
    """
    data = body if isinstance(body, Mapping) else {"detail": str(body)[:2000]}
    openai = data.get("error")
    if "detail" not in data and isinstance(openai, Mapping):
        data = {"detail": openai.get("message", str(openai))}
    detail = str(data.get("detail", data.get("error", "")))
    offenders = list(data.get("offenders") or [])
    kind = data.get("error_type")
    if not kind:
        kind = _TYPE_BY_STATUS.get(status, "")
        if status == 400 and offenders:
            kind = "WeightMismatchError"
        elif status == 409 and "communicator was replaced" in detail:
            kind = "CommunicatorReplacedError"
    if not kind:
        return WeightSyncError(f"{where}: HTTP {status}: {detail}")
    return error_from_dict({"error_type": kind, "error": detail, "offenders": offenders},
                           engine=where)


_TYPE_BY_STATUS = {
    400: "ValueError",
    409: "UpdateRefusedError",
    422: "ChecksumMismatchError",
    502: "EngineDiedError",
    503: "UpdateIncompleteError",
    504: "WeightSyncTimeout",
}


# --------------------------------------------------------------------------------------------
# which failure to raise when several engines failed at once
# --------------------------------------------------------------------------------------------

#: most telling first (the first class an error is an instance of decides): a refusal names
#: the culprit tensors; a dead engine explains the broken collectives of the others; corrupted
#: bytes name the tensors; an engine's own timeout says who hung; then any other error; then an
#: engine that stayed silent after another failed (stuck, or slow); last the collectives that
#: broke because of someone else
_RANK: tuple[type[BaseException], ...] = (
    WeightMismatchError, EngineDiedError, EngineUnreachableError, ChecksumMismatchError,
    CollectiveError, EngineSilentError, TimeoutError,
)
_RANK_OF = {WeightMismatchError: 0, EngineDiedError: 1, EngineUnreachableError: 1,
            ChecksumMismatchError: 2, TimeoutError: 3, EngineSilentError: 5, CollectiveError: 6}
_OTHER_RANK = 4


def telling_rank(e: BaseException) -> int:
    """0 a ``WeightMismatchError``, 1 a dead or unreachable engine, 2 corrupted bytes, 3 a timeout, 4 anything
    else, 5 an engine silent after another failed, 6 a broken collective."""
    cls = next((c for c in _RANK if isinstance(e, c)), None)
    return _RANK_OF[cls] if cls is not None else _OTHER_RANK


def most_telling(errors: Iterable[BaseException]) -> BaseException:
    """The failure to raise out of several (ties: the first given, i.e. engine order). The
    others are attached to it as notes, so nothing is lost."""
    errs = list(errors)
    if not errs:
        raise ValueError("most_telling: no errors given")
    best = min(errs, key=telling_rank)
    for other in errs:
        if other is not best:
            best.add_note(f"also: {type(other).__name__}: {str(other)[:500]}")
    return best


def _where(engine: str | None, method: str | None) -> str:
    if engine and method:
        return f"{engine} ({method})"
    return engine or method or ""
