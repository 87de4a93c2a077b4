"""Trainer-side client of the reward server: scoring and weight sync.

``RewardModelClient`` is the structural protocol the scorer / publisher / RL loop code against;
``VLLMRewardClient`` implements it for ``weightsync.servers.reward``, and the policy side's
``ChatClient`` as well (``complete`` refuses: a pooling model does not generate). It lives in
the training process (rank 0). Scoring is plain HTTP. Weight sync goes through the front door: a
``weightsync.connect`` session over the server's HTTP control plane with a strategy sender
(default ``broadcast``: gloo for CPU tensors, NCCL for CUDA ones; any strategy config works,
e.g. ``cuda_ipc`` when the server shares the host). With ``enable_weight_updates=True`` the
constructor waits for the server and builds that group, as the reference's client does. Each
sync is one update with a manifest (``SyncSession.push_chunks``), so the server refuses bad
names / shapes / dtypes / training modes before any byte moves.

Sync and async, one rule for the whole reward package: a method keeps the flavour the design
gives it and its twin carries a suffix. ``score``, ``score_batch``, ``get_model_version`` are
async (``score_batch_sync`` is the blocking twin); ``sync_weights`` is blocking
(``sync_weights_async`` is the coroutine); ``close`` is async (``close_sync``). The weight-sync
group lives on the client's private event-loop thread: every sync runs there, whichever flavour
and whichever loop calls it (``sync_loop``, a ``LoopThread``).

Tokenizer check (``tokenizer=``): the constructor waits for the server and compares how the
trainer's tokenizer and the server tokenize a few probe texts (the server's ``/tokenize`` when it
has one, else the token counts its ``/score`` reports per text) and raises
``TokenizerMismatchError``: a reward model fed another tokenizer's text scores garbage silently.

As the reference's client: its HTTP calls retry a connection error or a 5xx (``max_retries``,
backoff doubling from ``retry_backoff_s``; ``weightsync.reward.client_http``), a sync ends by
polling ``/get_num_background_tasks`` until 0 (at most ``timeout_s``), and a client with
weight updates leaves the group at interpreter exit (``atexit``) unless closed before.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import time
import weakref
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from weightsync._runtime.http import LoopClients, error_from_response
from weightsync._runtime.threads import LoopThread
from weightsync.config import DEFAULT_BUCKET_MB
from weightsync.errors import CommunicatorReplacedError, WeightSyncError
from weightsync.reward.client_http import (  # noqa: F401 - TokenizerMismatchError re-exported
    TokenizerMismatchError,
    check_tokenizer,
    request_with_retries,
    wait_background_tasks,
)
from weightsync.reward.selection import check_options, effective_mode, select_params
from weightsync.reward.types import (
    DEFAULT_MODEL_NAME,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.connect import SyncSession
    from weightsync.types import SyncStats, TensorMeta, WeightChunk

@runtime_checkable
class RewardModelClient(Protocol):
    """What RL code needs from a reward model service (implement it without subclassing):
    the reward spec's protocol."""

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]: ...

    async def score_batch(
        self, inputs: list[str], *, normalize: bool = True
    ) -> list[float] | list[list[float]]: ...

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
        training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL,
    ) -> str: ...

    async def get_model_version(self) -> int: ...


class VLLMRewardClient:
    """Client of one reward server at ``http://host:port``.

    The reward plan's arguments, in its order, with its defaults except where noted:

    - ``host="127.0.0.1"`` (the design's ``"0.0.0.0"`` is a bind address; as a destination it
      means this machine, as the loopback does); ``port=8001``.
    - ``group_port=None`` (design: 51217, ``DEFAULT_GROUP_PORT``): the trainer hosts the
      weight-sync group and tells the server its port in the set-up request, so no well-known
      port is needed; None picks a free one, which cannot collide with a colocated policy's
      group or another trainer. Give 51217 to get the design's.
    - ``enable_weight_updates=False``: a scoring-only client; ``sync_weights`` is refused.
      True waits for the server (``connection_timeout_s``) and builds the weight-sync group now.
    - ``device=0``: where the trainer's weights live, which picks the broadcast backend: an int
      ``n`` is ``cuda:n`` on a machine with CUDA and the CPU (gloo) on one without; a string or
      ``torch.device`` as given; None follows the tensors of the first sync.
    - ``connection_timeout_s=60``: how long set-up (or the first call) waits for the server.
    - ``model_name="reward-model"``: sent with every score request; every reward server
      answers to it as well as to its served name.

    Ours, keyword-only: ``api_key`` (bearer token of the control plane), ``strategy`` (a
    strategy config replacing the default), ``request_timeout_s`` (each HTTP call; 60 s, the
    reference's ``/score`` timeout), ``max_batch_size`` (split ``score_batch`` into concurrent
    requests of at most this many texts), ``head_name_patterns`` (what HEAD_ONLY keeps),
    ``bucket_size_mb`` (chunk bound of a sync), ``tokenizer`` (an HF tokenizer or a path to one:
    checked against the server in the constructor), ``max_retries`` / ``retry_backoff_s``
    (HTTP retries, see the module), ``unmerged_lora`` (``"refuse"``, ours, or ``"skip"``, the
    reference's) and ``head_only_extra`` (``"send"``, the reference client's, or ``"drop"``):
    see ``weightsync.reward.selection``.
    """

    DEFAULT_PORT = 8001
    DEFAULT_GROUP_PORT = 51217

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        group_port: int | None = None,
        enable_weight_updates: bool = False,
        device: int | str | Any | None = 0,
        connection_timeout_s: float = 60.0,
        model_name: str | None = DEFAULT_MODEL_NAME,
        *,
        api_key: str | None = None,
        strategy: Any = None,
        request_timeout_s: float = 60.0,
        max_batch_size: int | None = None,
        head_name_patterns: Sequence[str] | None = None,
        bucket_size_mb: float | None = None,
        tokenizer: Any = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        unmerged_lora: str = "refuse",
        head_only_extra: str = "send",
    ) -> None:
        self.host, self.port = host, int(port)
        self.server_url = f"http://{host}:{self.port}"
        self.group_port = group_port
        self.connection_timeout_s = connection_timeout_s
        self.enable_weight_updates = enable_weight_updates
        self.device = _device_name(device)
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_batch_size = max_batch_size
        self.head_name_patterns = list(head_name_patterns) if head_name_patterns else None
        self.tokenizer = tokenizer
        self.max_retries, self.retry_backoff_s = int(max_retries), float(retry_backoff_s)
        self.unmerged_lora, self.head_only_extra = check_options(unmerged_lora, head_only_extra)
        #: polls of ``/get_num_background_tasks`` at the end of the last sync
        self.last_background_polls = 0
        self._strategy_given = strategy
        self._bucket_size_mb = bucket_size_mb
        self.strategy_cfg: dict | None = None
        if strategy is not None or self.device is not None:
            self.strategy_cfg = self._strategy_cfg(str(self.device or "cpu"))
        self.last_sync_stats: SyncStats | None = None
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else None  # control routes
        self._http = LoopClients(timeout_s=request_timeout_s, headers=auth)
        self._session: SyncSession | None = None  # the front door's session (the group)
        self._server_up = False
        #: the loop the weight-sync group lives on (every sync runs there; the blocking twins too)
        self.sync_loop = LoopThread("weightsync-reward-client")
        self._sync_lock: asyncio.Lock | None = None
        if enable_weight_updates:
            self._init_communicator()
            ref = weakref.ref(self)
            self._atexit = lambda: (c := ref()) is not None and c.close_sync()
            atexit.register(self._atexit)
        elif tokenizer is not None:  # the plan: check the tokenizer at init, fail fast
            try:
                self.sync_loop.run(self.wait_for_server())
            except BaseException:
                self.close_sync()
                raise

    # -- configuration ------------------------------------------------------------------------
    def _strategy_cfg(self, device: str) -> dict:
        from weightsync.clients.http_control import server_strategy
        from weightsync.config import broadcast_backend, resolve_strategy

        if self._strategy_given is None:
            cfg = {**server_strategy(self.host, self.group_port),
                   "backend": broadcast_backend(device)}
        else:
            cfg = resolve_strategy(self._strategy_given)  # any way the front door takes one
        if self._bucket_size_mb is not None:
            cfg["bucket_size_mb"] = self._bucket_size_mb
        return cfg

    def _init_communicator(self) -> None:
        """Wait for the server and build the weight-sync group (the constructor, with weight
        updates on). With ``device=None`` the group forms at the first sync instead, when the
        tensors say which backend it needs."""

        async def open_group() -> None:
            await self.wait_for_server()
            if self.strategy_cfg is not None:
                await self._open_session()

        try:
            self.sync_loop.run(open_group())
        except BaseException:
            self.close_sync()
            raise

    # -- HTTP ---------------------------------------------------------------------------------
    async def wait_for_server(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until the server answers (at most ``connection_timeout_s``), then
        run the tokenizer check when a tokenizer was given."""
        import httpx

        deadline = time.monotonic() + (self.connection_timeout_s if timeout_s is None else timeout_s)
        last = ""
        while True:
            try:
                r = await self._http.get().get(self.server_url + "/health", timeout=5.0)
                if r.status_code == 200 and r.json().get("type") == "reward_model":
                    break
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"reward server {self.server_url} not reachable within "
                    f"{self.connection_timeout_s:g}s ({last})"
                )
            await asyncio.sleep(0.5)
        if self.tokenizer is not None:
            self.tokenizer = await check_tokenizer(
                self.tokenizer, self._http.get(), self.server_url, self._token_count)
        self._server_up = True

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One HTTP call to the server, with the retries of the module docstring."""
        return await request_with_retries(
            self._http.get(), method, self.server_url + path, max_retries=self.max_retries,
            backoff_s=self.retry_backoff_s, **kwargs)

    async def _token_count(self, text: str) -> int:
        resp, _ = await self._score_request(ScoringRequest(inputs=[text]))
        return int(resp.usage.get("prompt_tokens", 0))

    async def _ensure_server(self) -> None:
        if not self._server_up:
            await self.wait_for_server()

    # -- scoring ------------------------------------------------------------------------------
    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """One ``POST /score`` -> ``(ScoringResponse, info)``; ``info``: the reference's
        ``raw_response`` (the body) and ``request`` (the payload sent), and ours: ``latency_s``,
        ``status``, ``url``, ``num_inputs``."""
        await self._ensure_server()
        return await self._score_request(request)

    async def _score_request(
        self, request: ScoringRequest
    ) -> tuple[ScoringResponse, dict[str, Any]]:
        if request.model is None and self.model_name is not None:
            request = dataclasses.replace(request, model=self.model_name)
        payload = request.to_dict()
        url = self.server_url + "/score"
        t0 = time.perf_counter()
        r = await self._call("POST", "/score", json=payload)
        latency = time.perf_counter() - t0
        if r.status_code >= 400:
            err = error_from_response(url, r)
            if r.status_code == 503 and "in progress" in str(err):
                raise WeightSyncError(str(err))  # waiting for an update, not torn: retryable
            raise err
        data = r.json()
        info = {"raw_response": data, "request": payload, "latency_s": latency,
                "status": r.status_code, "url": url, "num_inputs": len(request)}
        return ScoringResponse.from_dict(data), info

    async def score_batch(
        self, inputs: Sequence[str], *, normalize: bool = True
    ) -> list[float] | list[list[float]]:
        """Scores in input order (floats for one label, lists otherwise). ``normalize`` (the
        design's default True): apply the model's activation (sigmoid for one label, softmax
        otherwise); False keeps the raw logits, what transformers computes. With
        ``max_batch_size`` the texts go as concurrent sub-batches."""
        texts = list(inputs)
        ScoringRequest(self.model_name, texts, normalize=normalize)  # validate before sending
        size = self.max_batch_size or len(texts)
        parts = [texts[i:i + size] for i in range(0, len(texts), size)]
        answers = await asyncio.gather(*(
            self.score(ScoringRequest(self.model_name, p, normalize=normalize)) for p in parts))
        out: list[Any] = []
        for resp, _ in answers:
            out.extend(resp.scores)
        return out

    def score_batch_sync(
        self, inputs: Sequence[str], *, normalize: bool = True
    ) -> list[float] | list[list[float]]:
        """Blocking twin of ``score_batch`` (e.g. for a synchronous credit-assignment step)."""
        return self.sync_loop.run(self.score_batch(inputs, normalize=normalize))

    async def get_model_version(self) -> int:
        """The weight version the server serves now (``/runtime_version``)."""
        await self._ensure_server()
        r = await self._call("GET", "/runtime_version")
        if r.status_code >= 400:
            raise error_from_response(self.server_url + "/runtime_version", r)
        return int(r.json()["version"])

    async def complete(self, request: Any) -> tuple[Any, dict[str, Any]]:
        """``ChatClient.complete``: refused (``NotImplementedError`` naming what to use): a
        pooling model scores but cannot generate; it exists so ``ChatClient`` code takes us."""
        raise NotImplementedError(
            f"reward server {self.server_url} serves a pooling (reward) model: it scores text "
            f"(score / score_batch) but cannot generate; send completions to a policy server "
            f"(weightsync.policy.VLLMChatClient)"
        )

    # -- weight sync --------------------------------------------------------------------------
    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> str:
        """Publish ``params`` as one update and block until the server serves it. Returns what
        the reference returns: ``str(version)`` for a version, else ``"rm-<unix time>"`` (a
        version of 0 or None lets the server count on); the version the server serves is in
        ``last_sync_stats.versions``. Names are normalised to engine names (PEFT / FSDP / DDP
        prefixes stripped), the training mode selects what is sent (HEAD_ONLY keeps the head
        and warns about the rest) and checks it: bad input raises ``WeightMismatchError``
        before any byte moves and changes nothing. HEAD_ONLY given backbone tensors sends them
        too (the reference client's ``head_only_extra="send"``), announced as a full update."""
        named, mode = self._selected(params, training_mode)  # errors here, not on the loop
        return self.sync_loop.run(self._sync_named(named, mode, version, timeout_s))

    async def sync_weights_async(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> str:
        """Coroutine twin of ``sync_weights`` (runs on the client's loop, see the module)."""
        named, mode = self._selected(params, training_mode)
        return await self.sync_loop.run_async(self._sync_named(named, mode, version, timeout_s))

    def _selected(
        self, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        training_mode: RewardModelTrainingMode | str,
    ) -> tuple[list[tuple[str, torch.Tensor]], RewardModelTrainingMode]:
        """What a sync sends: the mode's selection of ``params`` under engine names (refused
        when updates are disabled, or when the selection breaks the mode)."""
        self._check_enabled()
        mode = RewardModelTrainingMode.parse(training_mode)
        named = select_params(params, mode, self.head_name_patterns,
                              unmerged_lora=self.unmerged_lora,
                              head_only_extra=self.head_only_extra)
        return named, effective_mode([n for n, _ in named], mode, self.head_name_patterns)

    async def _sync_named(
        self, named: list[tuple[str, torch.Tensor]], mode: RewardModelTrainingMode,
        version: int | None, timeout_s: float,
    ) -> str:
        from weightsync.pipeline import make_chunks
        from weightsync.types import TensorMeta, dtype_to_str

        manifest = [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]

        def chunks() -> Iterable[WeightChunk]:  # made one by one as the sender asks
            cfg = self.strategy_cfg or {}
            return make_chunks(named, bucket_size_mb=float(cfg.get("bucket_size_mb", DEFAULT_BUCKET_MB)))

        t0 = time.monotonic()
        await self.send_update(chunks, manifest, mode, version, timeout_s,
                               first_tensor=named[0][1])
        self.last_background_polls = await wait_background_tasks(
            self._http.get(), self.server_url,
            timeout_s=max(timeout_s - (time.monotonic() - t0), 1.0),
            max_retries=self.max_retries, backoff_s=self.retry_backoff_s)
        return str(version) if version else f"rm-{int(time.time())}"

    def _check_enabled(self) -> None:
        if not self.enable_weight_updates:
            raise WeightSyncError(
                "weight updates are disabled for this client; create it with "
                "enable_weight_updates=True to sync weights"
            )

    async def send_update(
        self,
        make_chunks: Any,
        manifest: list[TensorMeta],
        mode: RewardModelTrainingMode | None,
        version: int | None,
        timeout_s: float,
        *,
        first_tensor: Any = None,
    ) -> SyncStats:
        """One update from ``make_chunks()`` (an iterable or async iterable of chunks, made
        again for the one retry) under ``manifest``.
        Also the publisher's and the two-plane adapters' path: the chunks are produced as the
        sender consumes them, so at most a few buckets are alive. ``mode`` None: the server's
        default (FULL). Run it on ``sync_loop``."""
        self._check_enabled()
        if self.strategy_cfg is None:  # device=None: follow the tensors
            self.strategy_cfg = self._strategy_cfg(str(getattr(first_tensor, "device", "cpu")))
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        async with self._sync_lock:
            await self._ensure_server()
            try:
                stats = await asyncio.wait_for(
                    self._sync(make_chunks(), manifest, mode, version), timeout_s)
            except CommunicatorReplacedError:
                # another sender took the server's receivers (refused at start, nothing moved):
                # join again and retry once
                stats = await asyncio.wait_for(
                    self._sync(make_chunks(), manifest, mode, version), timeout_s)
        self.last_sync_stats = stats
        return stats

    async def _open_session(self) -> SyncSession:
        if self._session is None:
            from weightsync.connect import connect

            assert self.strategy_cfg is not None
            self._session = await connect([self.server_url], self.strategy_cfg,
                                          api_key=self.api_key, is_sender=True,
                                          device=self.device)
        return self._session

    async def _sync(
        self, chunks: Iterable[WeightChunk] | AsyncIterable[WeightChunk],
        manifest: list[TensorMeta], mode: RewardModelTrainingMode | None, version: int | None,
    ) -> SyncStats:
        """One update through the front door's session (``weightsync.connect``): it keeps the
        group after a refusal and drops it after a transport failure or a replaced communicator
        (the next sync joins again)."""
        session = await self._open_session()
        return await session.push_chunks(
            chunks, manifest, version=version, training_mode=mode,
            head_name_patterns=self.head_name_patterns, device=self.device,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def close_communicator(self) -> None:
        """Leave the weight-sync group (the server drops its receivers); a later sync joins a
        new one."""
        if self._session is not None:
            self.sync_loop.run(self._close_session())

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()  # best effort on the server's side: it may be gone already

    async def close(self) -> None:
        """Tear down the weight-sync group on both sides and close HTTP connections."""
        if self._session is not None:
            await self.sync_loop.run_async(self._close_session())
        await self._http.aclose()

    def close_sync(self) -> None:
        """Blocking twin of ``close``; also stops the private loop thread."""
        if getattr(self, "_atexit", None) is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        if self.sync_loop.started:
            self.sync_loop.run(self.close())
            self.sync_loop.close()

    async def __aenter__(self) -> VLLMRewardClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _device_name(device: Any) -> str | None:
    """``device=`` as a device name: an int ``n`` is ``cuda:n`` where CUDA is available and the
    CPU elsewhere (the reference's default 0 then runs on a CPU machine); None stays None."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        import torch

        return f"cuda:{device}" if torch.cuda.is_available() else "cpu"
    return str(device)
