"""``Channel``: how the sending process calls one method on one engine.

Lives in the sending (training) process. A channel carries the endpoint protocol
(``weightsync.engine.METHODS``: ``init_weight_transfer``, ``start_weight_update``,
``update_named_weights``, ``finish_weight_update``, ``close_weight_transfer``, ``status``) with
plain-dict arguments to one engine, whatever is in between: an in-process
``WeightUpdateEndpoint``, a ``LocalEngineProcess``, a Ray actor, an HTTP control plane, an
in-process vLLM ``LLM`` / ``AsyncLLM``. ``FanOutClient`` puts one error policy on top of several.

The protocol is structural: implement the four members without importing or subclassing
anything.

* ``name``: how the engine is named in errors (unique within one fan-out);
* ``ordered``: True when calls reach the engine in the order ``call`` was made (the message is
  queued before ``call`` returns, and the engine runs them in that order); only then may a
  sender keep more than one chunk in flight;
* ``world_size()``: receiving workers in the engine (TP x PP for vLLM, 1 for a plain module);
* ``call(method, kwargs, *, timeout_s)``: issue the call now, return an awaitable of its
  result. Failures come back as weightsync errors (``weightsync.errors`` codec):
  ``WeightMismatchError`` for a refusal, ``EngineDiedError`` for a dead engine,
  ``WeightSyncTimeout`` when no answer came within ``timeout_s``;
* ``aclose()``: release what the channel holds (connections), not the engine.

Optional: ``one_call = True`` when the channel carries the endpoint's ``apply_update`` (a
whole update in one call); a sender then sends an update of one chunk in one round trip.

``as_channel(obj)`` adapts anything the library knows how to reach (the table ``ADAPTERS``;
third parties add theirs with ``register_channel_adapter``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from weightsync.errors import WeightSyncTimeout

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.engine import WeightUpdateEndpoint


@runtime_checkable
class Channel(Protocol):
    """Calls one method on one engine (see the module docstring)."""

    name: str
    ordered: bool

    async def world_size(self) -> int: ...

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------
# the in-process channel
# --------------------------------------------------------------------------------------------


class EndpointChannel:
    """An engine in this process: a ``WeightUpdateEndpoint`` on this event loop (tests,
    examples, a trainer that holds a small model for evaluation). Arguments go through JSON, as
    they would over a process boundary. Ordered: each call becomes a task at once, and the
    endpoint takes calls in the order their tasks start."""

    ordered = True
    one_call = True

    def __init__(self, endpoint: WeightUpdateEndpoint, *, name: str | None = None,
                 world_size: int = 1) -> None:
        self.endpoint = endpoint
        self.name = name or endpoint.name
        self._world_size = int(world_size)

    async def world_size(self) -> int:
        return self._world_size

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        plain = json.loads(json.dumps(kwargs))
        return asyncio.ensure_future(self._call(method, plain, timeout_s))

    async def _call(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(self.endpoint.call(method, kwargs), timeout_s)
        except WeightSyncTimeout:
            raise  # the endpoint's own (a collective that timed out): it says more
        except TimeoutError:
            raise WeightSyncTimeout(
                f"{self.name}: {method} did not finish within {timeout_s:g}s"
            ) from None

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"EndpointChannel({self.name!r})"


# --------------------------------------------------------------------------------------------
# adapters: anything reachable -> a Channel
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelAdapter:
    """``kind`` (for error messages), ``matches(obj)`` and ``make(obj, **options)``; options:
    ``index`` (the engine's position), ``api_key``, ``name``."""

    kind: str
    matches: Callable[[Any], bool]
    make: Callable[..., Channel]


def _is_channel(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("name", "ordered", "world_size", "call", "aclose"))


def _is_url(obj: Any) -> bool:
    return isinstance(obj, str) and obj.startswith(("http://", "https://"))


def _is_endpoint(obj: Any) -> bool:
    from weightsync.engine import WeightUpdateEndpoint

    return isinstance(obj, WeightUpdateEndpoint)


def _is_local_process(obj: Any) -> bool:
    return type(obj).__name__ == "LocalEngineProcess" and type(obj).__module__.startswith(
        "weightsync.local"
    )


def _is_ray_actor(obj: Any) -> bool:
    return type(obj).__module__.startswith("ray.") and hasattr(obj, "_actor_id")


def _is_vllm_engine(obj: Any) -> bool:
    return callable(getattr(obj, "collective_rpc", None))


def _same(obj: Any, **_: Any) -> Channel:
    return obj


def _endpoint(obj: Any, *, name: str | None = None, **_: Any) -> Channel:
    return EndpointChannel(obj, name=name)


def _http(obj: Any, *, api_key: str | None = None, name: str | None = None, **_: Any) -> Channel:
    from weightsync.clients.http_control import HttpChannel

    return HttpChannel(obj, api_key=api_key, name=name)


def _local(obj: Any, *, name: str | None = None, **_: Any) -> Channel:
    from weightsync.clients.local_process import LocalChannel

    return LocalChannel(obj, name=name)


def _ray(obj: Any, *, index: int = 0, name: str | None = None, **_: Any) -> Channel:
    from weightsync.clients.ray_actor import RayChannel

    return RayChannel(obj, name=name, index=index)


def _vllm(obj: Any, *, index: int = 0, name: str | None = None, **_: Any) -> Channel:
    from weightsync.clients.vllm_engine import VLLMChannel

    return VLLMChannel(obj, name=name or f"vLLM engine {index}")


#: tried in order; the first that matches makes the channel
ADAPTERS: list[ChannelAdapter] = [
    ChannelAdapter("a Channel", _is_channel, _same),
    ChannelAdapter("an http(s):// URL of a policy or reward server", _is_url, _http),
    ChannelAdapter("a WeightUpdateEndpoint (in this process)", _is_endpoint, _endpoint),
    ChannelAdapter("a weightsync.local.LocalEngineProcess", _is_local_process, _local),
    ChannelAdapter("a Ray actor handle (WeightSyncEngineMixin)", _is_ray_actor, _ray),
    ChannelAdapter("a vLLM LLM / AsyncLLM with the weightsync worker extension",
                   _is_vllm_engine, _vllm),
]


def register_channel_adapter(adapter: ChannelAdapter, *, first: bool = True) -> None:
    """Teach ``as_channel`` a new kind of engine (tried before the built-ins unless
    ``first=False``)."""
    if first:
        ADAPTERS.insert(0, adapter)
    else:
        ADAPTERS.append(adapter)


def as_channel(obj: Any, **options: Any) -> Channel:
    """The channel for ``obj`` (see ``ADAPTERS``); anything else is a ``TypeError`` that lists
    what is accepted."""
    for adapter in ADAPTERS:
        if adapter.matches(obj):
            return adapter.make(obj, **options)
    kinds = "; ".join(a.kind for a in ADAPTERS)
    raise TypeError(f"cannot reach an engine through a {type(obj).__name__} ({obj!r:.80}); "
                    f"give one of: {kinds}")
