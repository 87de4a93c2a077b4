"""``VLLMNativeChannel``: one vLLM engine reached through vLLM's own weight-transfer API.

Lives in the sending (training) process. The engine was started with
``weight_transfer_config={"backend": "weightsync"}`` (its workers run
``weightsync.loaders.vllm_transfer_engine``); ``client`` is anything with vLLM's
``VLLMWeightSyncClient`` methods (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``; optionally ``shutdown_weight_transfer_engine``):
vLLM's ``HTTPVLLMWeightSyncClient`` (the server's HTTP routes, dev mode) or
``RayVLLMWeightSyncClient``, or ``weightsync.vllm_backend.LLMWeightSyncClient`` for an
in-process ``LLM``. The endpoint protocol maps onto those calls:

    init_weight_transfer(strategy_cfg, sync_info, rank_offset)
        -> init_weight_transfer_engine({"strategy", "sync_info", "rank_offset"})
    start_weight_update(start)   -> start_weight_update(); update_weights({"method", "kwargs"})
    update_named_weights(request) -> update_weights({"method", "kwargs"})
    finish_weight_update(finish) -> update_weights(...); finish_weight_update(weight_version);
                                    then the engine's prefix cache is reset (KV computed with
                                    the old weights must not be reused)
    close_weight_transfer()      -> shutdown_weight_transfer_engine()

vLLM's calls return nothing, so ``finish_weight_update`` answers the version the trainer asked
for (send explicit versions); ``status`` is not available. A failure comes back as the typed
weightsync error the worker raised (``weightsync.errors.error_from_text``). Not ordered (HTTP
requests may overtake each other): one chunk in flight. The calls are blocking; each runs on a
worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any

from weightsync.errors import WeightSyncError, WeightSyncTimeout, error_from_text


class VLLMNativeChannel:
    """A ``Channel`` over a ``VLLMWeightSyncClient`` (see the module docstring). ``world_size``:
    the engine's workers (TP x PP); ``loader``: ``VLLMLoaderConfig`` fields for the workers'
    loader (sent with the init)."""

    ordered = False

    def __init__(self, client: Any, *, world_size: int = 1, loader: dict[str, Any] | None = None,
                 name: str = "vLLM engine (weight-transfer API)") -> None:
        missing = [m for m in ("init_weight_transfer_engine", "start_weight_update",
                               "update_weights", "finish_weight_update")
                   if not callable(getattr(client, m, None))]
        if missing:
            raise TypeError(f"VLLMNativeChannel: {type(client).__name__} lacks {missing}; pass "
                            f"a vLLM VLLMWeightSyncClient (HTTPVLLMWeightSyncClient, ...)")
        self.client = client
        self.name = name
        self.loader = dict(loader or {})
        self._world_size = int(world_size)

    async def world_size(self) -> int:
        return self._world_size

    def call(self, method: str, kwargs: dict[str, Any], *, timeout_s: float) -> Awaitable[Any]:
        do = getattr(self, f"_do_{method}", None)
        if do is None:
            raise WeightSyncError(f"{self.name}: {method} is not available through vLLM's "
                                  f"weight-transfer API")
        plain = json.loads(json.dumps(kwargs))
        return asyncio.ensure_future(self._call(method, do, plain, timeout_s))

    async def aclose(self) -> None:
        return None

    # -- the mapping ----------------------------------------------------------------------------
    def _do_init_weight_transfer(self, kw: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine({
            "strategy": kw["strategy_cfg"], "sync_info": kw["sync_info"],
            "rank_offset": int(kw["rank_offset"]), "loader": self.loader})

    def _do_start_weight_update(self, kw: dict[str, Any]) -> None:
        self.client.start_weight_update()
        self.client.update_weights({"method": "start_weight_update", "kwargs": kw})

    def _do_update_named_weights(self, kw: dict[str, Any]) -> None:
        self.client.update_weights({"method": "update_named_weights", "kwargs": kw})

    def _do_finish_weight_update(self, kw: dict[str, Any]) -> int | None:
        self.client.update_weights({"method": "finish_weight_update", "kwargs": kw})
        finish = kw["finish"]
        version = finish.get("version")
        self.client.finish_weight_update(str(version) if version is not None else None)
        if finish.get("ok", True):
            self._reset_prefix_cache()
        return version

    def _do_close_weight_transfer(self, kw: dict[str, Any]) -> None:
        close = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if callable(close):
            close()

    def _reset_prefix_cache(self) -> None:
        """The client's own reset, or a vLLM server's ``/reset_prefix_cache`` (dev mode)."""
        reset = getattr(self.client, "reset_prefix_cache", None)
        if callable(reset):
            reset()
            return
        base_url = getattr(self.client, "base_url", None)
        if isinstance(base_url, str):
            import requests

            requests.post(f"{base_url}/reset_prefix_cache",
                          timeout=float(getattr(self.client, "timeout", 60))).raise_for_status()

    # -- calls ----------------------------------------------------------------------------------
    async def _call(self, method: str, do: Any, kwargs: dict[str, Any], timeout_s: float) -> Any:
        from weightsync._runtime.threads import in_thread

        try:
            return await asyncio.wait_for(in_thread(self._checked, method, do, kwargs),
                                          timeout_s)
        except TimeoutError:
            raise WeightSyncTimeout(
                f"{self.name}: {method} did not finish within {timeout_s:g}s") from None

    def _checked(self, method: str, do: Any, kwargs: dict[str, Any]) -> Any:
        try:
            return do(kwargs)
        except Exception as e:  # noqa: BLE001 - turned into the worker's typed error
            raise self._error(e, method) from None

    def _error(self, e: Exception, method: str) -> BaseException:
        for text in _texts(e):
            found = error_from_text(text, engine=self.name, method=method)
            if found is not None:
                return found
        return WeightSyncError(f"{self.name} ({method}): {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return f"VLLMNativeChannel({self.name!r})"


def _texts(e: BaseException) -> list[str]:
    """Where the worker's message may be: the exception's own text, an HTTP answer's body and
    the messages inside it (vLLM's servers answer ``{"error": {"message": ...}}``)."""
    out = [str(e)]
    response = getattr(e, "response", None)
    body = getattr(response, "text", None)
    if isinstance(body, str):
        out.append(body)
        with contextlib.suppress(ValueError):
            out.extend(_strings(json.loads(body)))
    return out


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []
