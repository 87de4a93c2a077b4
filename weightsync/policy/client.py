"""``VLLMChatClient``: the reference's chat client for a policy server, on the front door.

Lives in the trainer (or a rollout worker). ``complete`` is async and returns ``(ChatResponse,
info)`` like the reference's ``ChatClient.complete``; ``sync_weights`` is synchronous, like the
reference's, and pushes through ``weightsync.connect`` (any strategy; a gloo / NCCL broadcast by
default), so a push is validated by the server before any byte moves and published as one
version. The server is ``weightsync serve-policy`` (vLLM's OpenAI routes plus our control plane).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from weightsync._runtime.http import LoopClients, error_from_response
from weightsync._runtime.threads import LoopThread
from weightsync.errors import WeightSyncError
from weightsync.policy.types import ChatCompletionRequest, ChatResponse
from weightsync.types import SyncStats


class VLLMChatClient:
    """Client of one policy server at ``http://host:port``.

    The reference's arguments, with our defaults where its are unsafe or wrong here:

    - ``host="127.0.0.1"`` (reference examples: ``"0.0.0.0"``, a bind address, not a
      destination).
    - ``port=8000``; ``group_port=51216``: the port of the weight-sync group's rendezvous store,
      which the trainer hosts (give a free one when several trainers share a machine).
    - ``enable_weight_updates=False``: an inference-only client; ``sync_weights`` is refused.
      True connects at construction, as the reference does (the group forms now when ``device``
      is given, else at the first sync, when the tensors say where they live).
    - ``device=None`` (reference: 0): where the trainer's weights live, which picks the
      broadcast backend (NCCL for CUDA, gloo for CPU); an int ``n`` means ``cuda:n``.

    Ours, keyword-only: ``api_key`` (the control plane's token), ``model`` (default: the
    server's first model), ``strategy`` (any strategy ``ws.connect`` takes; replaces the
    broadcast default), ``connection_timeout_s`` (waiting for ``/health``),
    ``request_timeout_s`` (each HTTP call).
    """

    DEFAULT_PORT = 8000
    DEFAULT_GROUP_PORT = 51216

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        group_port: int = DEFAULT_GROUP_PORT,
        enable_weight_updates: bool = False,
        device: int | str | Any | None = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        strategy: Any = None,
        connection_timeout_s: float = 60.0,
        request_timeout_s: float = 300.0,
    ) -> None:
        self.host, self.port, self.group_port = host, int(port), int(group_port)
        self.server_url = f"http://{host}:{self.port}"
        self.enable_weight_updates = enable_weight_updates
        self.device = f"cuda:{device}" if isinstance(device, int) else (
            str(device) if device is not None else None)
        self.api_key = api_key
        self.model = model
        self.strategy = strategy
        self.connection_timeout_s = connection_timeout_s
        self.request_timeout_s = request_timeout_s
        self.last_sync_stats: SyncStats | None = None
        self._http = LoopClients(timeout_s=request_timeout_s)
        #: the loop the weight-sync session lives on (every push runs there)
        self.sync_loop = LoopThread("weightsync-chat-client")
        self._sync: Any = None
        self._wait_for_server()
        if enable_weight_updates:
            self._connect()

    # -- set-up -------------------------------------------------------------------------------
    def _wait_for_server(self) -> None:
        import httpx

        deadline = time.monotonic() + self.connection_timeout_s
        last = ""
        while True:
            try:
                r = httpx.get(self.server_url + "/health", timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"policy server at {self.server_url} not healthy after "
                    f"{self.connection_timeout_s:g}s ({last}); start it with `weightsync "
                    f"serve-policy --model DIR --port {self.port}`"
                )
            time.sleep(0.5)

    def _strategy_cfg(self) -> Any:
        if self.strategy is not None:
            return self.strategy
        from weightsync.clients.http_control import server_strategy

        return server_strategy(self.host, self.group_port)  # connect picks the backend

    def _connect(self) -> None:
        from weightsync.connect import connect

        async def opened() -> Any:
            return await connect([self.server_url], strategy=self._strategy_cfg(),
                                 api_key=self.api_key, device=self.device)

        try:
            self._sync = self.sync_loop.run(opened())
        except BaseException:
            self.sync_loop.close()
            raise

    # -- weights ------------------------------------------------------------------------------
    def sync_weights(
        self,
        params: Mapping[str, Any] | Any,
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
    ) -> str:
        """Push ``params`` (a name -> tensor mapping, or a model) as one update and return the
        version the server now serves, as a string (details in ``last_sync_stats``). Blocks
        until the server published it. Bad names / shapes / dtypes raise
        ``WeightMismatchError`` naming them, and the server keeps serving its old weights."""
        if not self.enable_weight_updates or self._sync is None:
            raise WeightSyncError("sync_weights() on an inference-only client; create it with "
                                  "enable_weight_updates=True")

        async def push() -> SyncStats:
            return await asyncio.wait_for(self._sync.push(params, version=version), timeout_s)

        stats = self.sync_loop.run(push())
        self.last_sync_stats = stats
        return str(stats.versions[0])

    async def send_update(self, make_chunks: Any, manifest: list[Any], mode: Any,
                          version: int | None, timeout_s: float, *,
                          first_tensor: Any = None) -> SyncStats:
        """One update from chunks under engine names (``make_chunks()``: an iterable or async
        iterable), on ``sync_loop``: what the two-plane adapters
        (``weightsync.distributed.VllmControlPlane``) send through."""
        if not self.enable_weight_updates or self._sync is None:
            raise WeightSyncError("an update through an inference-only client; create it with "
                                  "enable_weight_updates=True")
        stats = await asyncio.wait_for(self._sync.push_chunks(
            make_chunks(), manifest, version=version, training_mode=mode, device=self.device),
            timeout_s)
        self.last_sync_stats = stats
        return stats

    async def get_policy_version(self) -> int:
        """The version the server serves now (``GET /runtime_version``)."""
        r = await self._http.get().get(self.server_url + "/runtime_version")
        r.raise_for_status()
        return int(r.json()["version"])

    def reset_prefix_cache(self) -> None:
        """(The server resets it after every completed update anyway.)"""
        import httpx

        r = httpx.post(self.server_url + "/reset_prefix_cache", headers=self._auth(),
                       timeout=self.request_timeout_s)
        if r.status_code != 200:
            raise error_from_response(self.server_url + "/reset_prefix_cache", r)

    def close_communicator(self) -> None:
        """Leave the weight-sync group (the server drops its receivers); a later
        ``sync_weights`` needs a new client."""
        sync, self._sync = self._sync, None
        if sync is not None:
            try:
                self.sync_loop.run(sync.close())
            finally:
                self.sync_loop.close()

    # -- generation ---------------------------------------------------------------------------
    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        """One chat (``messages``) or text (``prompt``) completion -> ``(ChatResponse, info)``;
        ``info``: ``raw_response``, ``used_args``, ``weight_version``, ``latency_s``. A torn
        server (a failed update) raises ``UpdateIncompleteError``; a bad request ``ValueError``
        with vLLM's reason."""
        responses, info = await self.complete_n(request, 1)
        return responses[0], info

    async def complete_n(
        self, request: ChatCompletionRequest, n: int
    ) -> tuple[list[ChatResponse], dict[str, Any]]:
        """Ours: ``n`` completions of one request in one call (OpenAI's ``n``: the server
        samples them together, one seed giving ``n`` different samples) -> the responses in
        choice order and the call's ``info``; what a rollout engine asks for a group."""
        chat = request.messages is not None
        payload: dict[str, Any] = {"model": request.model or self.model or await self._model()}
        if chat:
            payload["messages"] = request.messages
        else:
            payload["prompt"] = request.prompt
        payload.update(request.sampling)
        if n != 1:
            payload["n"] = int(n)
        if request.return_token_ids:
            payload["return_token_ids"] = True
        if request.logprobs is not None:
            if chat:
                payload.update(logprobs=True, top_logprobs=int(request.logprobs))
            else:
                payload["logprobs"] = int(request.logprobs)
        payload.update(request.extra_body)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        r = await self._http.get().post(self.server_url + path, json=payload)
        latency = time.perf_counter() - t0
        if r.status_code != 200:
            raise error_from_response(self.server_url + path, r)
        body = r.json()
        version = int(r.headers["x-weight-version"]) if "x-weight-version" in r.headers else None
        choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
        responses = [_parse_choice(body, c, chat, version) for c in choices]
        info = {"raw_response": body, "used_args": payload, "weight_version": version,
                "latency_s": latency}
        return responses, info

    async def _model(self) -> str:
        r = await self._http.get().get(self.server_url + "/v1/models")
        r.raise_for_status()
        self.model = str(r.json()["data"][0]["id"])
        return self.model

    # -- plumbing -----------------------------------------------------------------------------
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def aclose(self) -> None:
        """Close the HTTP clients of this loop and the weight-sync session."""
        await self._http.aclose()
        await asyncio.to_thread(self.close_communicator)

    async def __aenter__(self) -> VLLMChatClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _parse_choice(body: dict, choice: dict, chat: bool, version: int | None) -> ChatResponse:
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    logprobs = None
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if chat and lp.get("content") is not None:
            logprobs = [float(t["logprob"]) for t in lp["content"]]
        elif not chat and lp.get("token_logprobs") is not None:
            logprobs = [float(x) for x in lp["token_logprobs"]]
    prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
    return ChatResponse(
        text=text or "", finish_reason=choice.get("finish_reason"),
        completion_token_ids=choice.get("token_ids"), prompt_token_ids=prompt_ids,
        completion_logprobs=logprobs, weight_version=version,
    )
