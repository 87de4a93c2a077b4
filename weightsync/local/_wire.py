"""JSON messages between a ``LocalEngineProcess`` and its child, and error round-tripping.

Only JSON bytes cross the connection (``Connection.send_bytes`` / ``recv_bytes``); nothing is
pickled. An exception in the child travels as ``{"error_type", "message", "offenders"?}`` and
is rebuilt in the parent as the matching weightsync error, prefixed with the engine's name.
"""

from __future__ import annotations

import json
from typing import Any

from weightsync import errors

_BY_NAME: dict[str, type[BaseException]] = {
    "WeightMismatchError": errors.WeightMismatchError,
    "WeightSyncTimeout": errors.WeightSyncTimeout,
    "UpdateIncompleteError": errors.UpdateIncompleteError,
    "WeightSyncError": errors.WeightSyncError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "KeyError": KeyError,
    "FileNotFoundError": FileNotFoundError,
    "TimeoutError": errors.WeightSyncTimeout,
}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(raw: bytes) -> Any:
    return json.loads(raw.decode())


def error_payload(e: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"error_type": type(e).__name__, "message": str(e)}
    if isinstance(e, errors.WeightMismatchError):
        out["offenders"] = list(e.offenders)
    return out


def rebuild_error(payload: dict[str, Any], engine: str) -> BaseException:
    """The parent-side exception for a child's error payload, naming ``engine``."""
    kind = str(payload.get("error_type", "WeightSyncError"))
    msg = str(payload.get("message", ""))
    if kind == "WeightMismatchError":
        return errors.WeightMismatchError(
            payload.get("offenders") or [msg], target=f"model of engine {engine!r}"
        )
    cls = _BY_NAME.get(kind)
    if cls is None:  # anything else is a generic failure of that engine
        return errors.WeightSyncError(f"engine {engine!r}: {kind}: {msg}")
    if cls is KeyError:
        return errors.WeightSyncError(f"engine {engine!r}: KeyError: {msg}")
    return cls(f"engine {engine!r}: {msg}")
