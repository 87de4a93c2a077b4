"""HTTP plumbing shared by the servers' own routes: bodies, fields, tokens, errors.

Callers: ``weightsync.servers.control_routes`` and ``weightsync.servers.scoring`` (routes that
we own; vLLM's OpenAI routes parse their own bodies). Bodies are read with a size limit (413
past it, before the rest is read) and parsed as JSON by hand, so every bad input gets a 4xx
whose reason names the field; nothing received is unpickled. Errors answer
``{"detail": reason, "offenders": [...], "error_type": ...}`` (the last two when known).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from weightsync.servers.control import ServiceError

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 1000-tensor manifest is ~100 KB; texts to score fit too


def error_response(e: ServiceError, headers: dict[str, str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body: dict[str, Any] = {"detail": e.message}
    if e.offenders:
        body["offenders"] = e.offenders
    if e.error_type:
        body["error_type"] = e.error_type
    return JSONResponse(body, status_code=e.status, headers=headers)


def service_route_class() -> type:
    """An ``APIRoute`` whose handler answers a ``ServiceError`` itself, so a router mounted on
    any app (vLLM's included) keeps our error format without app-level handlers."""
    from fastapi.routing import APIRoute

    class ServiceRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def run(request: Any) -> Any:
                try:
                    return await handler(request)
                except ServiceError as e:
                    return error_response(e)

            return run

    return ServiceRoute


async def json_body(request: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict:
    """The request's JSON object ({} for an empty body); 413 past ``max_bytes``, 400 for
    anything that is not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise ServiceError(413, _too_large(int(declared), max_bytes))
        except ValueError:
            raise ServiceError(400, f"content-length: not a number ({declared!r})") from None
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise ServiceError(413, _too_large(size, max_bytes))
        chunks.append(part)
    raw = b"".join(chunks)
    if not raw:
        return {}
    try:
        body = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float,
                          parse_constant=_no_constant)
    except ValueError as e:
        raise ServiceError(400, f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise ServiceError(400, f"body: nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise ServiceError(400, f"body must be a JSON object, got {type(body).__name__}")
    if _depth(body) > MAX_DEPTH:
        raise ServiceError(400, f"body: nested deeper than {MAX_DEPTH} levels")
    return body


#: what a body may hold: integers that fit 64 bits (they travel to the engine's workers as
#: msgpack), finite numbers, and at most this much nesting
MAX_DEPTH = 32


def _bounded_int(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"integer {text[:30]}{'...' if len(text) > 30 else ''} does not fit "
                         f"in 64 bits")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:30]} is not finite")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (only finite numbers are accepted)")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _too_large(size: int, limit: int) -> str:
    return (f"body: {size} bytes is over this server's limit of {limit} bytes "
            f"(--max-body-bytes); send fewer tensors per call")


def field(body: dict, name: str, kind: type | tuple[type, ...], *, required: bool = True,
          default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (bool is never an int here)."""
    if name not in body or body[name] is None:
        if required:
            raise ServiceError(400, f"{name}: missing")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ServiceError(400, f"{name}: expected {_kind_name(kinds)}, got bool")
    if not isinstance(value, kinds):
        raise ServiceError(400, f"{name}: expected {_kind_name(kinds)}, got {type(value).__name__}")
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {dict: "an object", int: "an integer", str: "a string", bool: "a boolean", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def token_checker(api_key: str | None) -> Callable[[Any], None]:
    """``check(request)``: 401 unless ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``
    carries ``api_key`` (no key configured: everything passes)."""

    def check(request: Any) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise ServiceError(401, "missing or wrong API token (Authorization: Bearer <key>)")

    return check
