"""JSON messages between a ``LocalEngineProcess`` and its child.

Only JSON bytes cross the connection (``Connection.send_bytes`` / ``recv_bytes``); nothing is
pickled. An exception in the child travels as the codec's dict (``weightsync.errors``:
``{"error_type", "error", "offenders"}``) and is rebuilt in the parent as the matching
weightsync error, prefixed with the engine's name.
"""

from __future__ import annotations

import json
from typing import Any

from weightsync.errors import error_from_dict, error_to_dict


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(raw: bytes) -> Any:
    return json.loads(raw.decode())


def error_payload(e: BaseException) -> dict[str, Any]:
    return error_to_dict(e)


def rebuild_error(payload: dict[str, Any], engine: str) -> BaseException:
    """The parent-side exception for a child's error payload, naming ``engine``."""
    return error_from_dict(payload, engine=f"engine {engine!r}")
