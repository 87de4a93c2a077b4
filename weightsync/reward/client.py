"""Trainer-side client of the reward server: scoring and weight sync.

``RewardModelClient`` is the structural protocol the scorer / publisher / RL loop code against;
``VLLMRewardClient`` implements it for ``weightsync.servers.reward``. It lives in the training
process (rank 0). Scoring is plain HTTP. Weight sync goes through the front door: a
``weightsync.connect`` session over the server's HTTP control plane with a strategy sender
(default ``broadcast``: gloo for CPU tensors, NCCL for CUDA ones; any strategy config works,
e.g. ``cuda_ipc`` when the server shares the host) built on the first sync and reused after.
Each sync is one update with a manifest (``SyncSession.push_chunks``), so the server refuses bad
names / shapes / dtypes / training modes before any byte moves.

Sync and async, one rule for the whole reward package: a method keeps the flavour the design
gives it and its twin carries a suffix. ``score``, ``score_batch``, ``get_model_version`` are
async (``score_batch_sync`` is the blocking twin); ``sync_weights`` is blocking
(``sync_weights_async`` is the coroutine); ``close`` is async (``close_sync``). The blocking
forms run on one private event-loop thread, so the sender's state stays on one loop across
calls. A client's weight-sync group lives on the loop of its first sync: use one flavour of
``sync_weights`` per client (a sync from another live loop is refused with a clear error).

Tokenizer check (``tokenizer=``): the first contact with the server compares how the trainer's
tokenizer and the server tokenize a few probe texts (the server's ``/tokenize`` when it has one,
else the token counts its ``/score`` reports per text) and raises ``TokenizerMismatchError``
before any score or sync: a reward model fed another tokenizer's text scores garbage silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from weightsync._runtime.http import LoopClients, error_from_response
from weightsync._runtime.threads import LoopThread
from weightsync.errors import CommunicatorReplacedError, WeightSyncError
from weightsync.reward.selection import select_params
from weightsync.reward.types import RewardModelTrainingMode, ScoringRequest, ScoringResponse

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.connect import SyncSession
    from weightsync.types import SyncStats, TensorMeta, WeightChunk

T = TypeVar("T")

#: Texts the tokenizer check tokenizes on both sides: words, digits, code, punctuation, accents.
TOKENIZER_PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "Q: What is 12 * 34?\nA: 408",
    "def add(a, b):\n    return a + b  # sum",
    "Naïve café, déjà vu! (1999)",
)


class TokenizerMismatchError(ValueError):
    """The trainer's tokenizer and the reward server's tokenize a probe text differently."""


@runtime_checkable
class RewardModelClient(Protocol):
    """What RL code needs from a reward model service (implement it without subclassing)."""

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict]: ...

    async def score_batch(
        self, inputs: Sequence[str], *, normalize: bool | None = None
    ) -> list[float] | list[list[float]]: ...

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL,
        timeout_s: float = 600.0,
    ) -> str: ...

    async def get_model_version(self) -> int: ...


class VLLMRewardClient:
    """Client of one reward server at ``http://host:port``.

    The design's arguments, with our defaults where its are unsafe or wrong here:

    - ``host="127.0.0.1"`` (design: ``"0.0.0.0"``, a bind address, not a destination; the
      loopback default never reaches another machine by accident).
    - ``port=8001``; ``connection_timeout_s=60``: how long the first call waits for the server.
    - ``group_port=None`` (design: 51217): the trainer hosts the weight-sync group and tells the
      server its port in the set-up request, so no well-known port is needed; None picks a free
      one, which cannot collide with a colocated policy's group or another trainer.
    - ``enable_weight_updates=False``: a scoring-only client; ``sync_weights`` is refused.
    - ``device=None`` (design: 0): where the weights live, which picks the broadcast backend
      (NCCL for CUDA, gloo for CPU). None follows the tensors of the first sync, so the same
      code runs on a CPU machine; an int ``n`` means ``cuda:n``.
    - ``model_name=None`` (design: ``"reward-model"``): sent with every score request when set
      and checked by the server; None scores with whatever model the server serves.

    Ours, keyword-only: ``api_key`` (bearer token of the control plane), ``strategy`` (a
    strategy config replacing the default), ``request_timeout_s``, ``max_batch_size`` (split
    ``score_batch`` into concurrent requests of at most this many texts), ``head_name_patterns``
    (what HEAD_ONLY keeps), ``bucket_size_mb`` (chunk bound of a sync), ``tokenizer`` (an HF
    tokenizer or a path to one: checked against the server on first contact).
    """

    DEFAULT_PORT = 8001

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        group_port: int | None = None,
        connection_timeout_s: float = 60.0,
        enable_weight_updates: bool = False,
        device: int | str | Any | None = None,
        model_name: str | None = None,
        *,
        api_key: str | None = None,
        strategy: Any = None,
        request_timeout_s: float = 300.0,
        max_batch_size: int | None = None,
        head_name_patterns: Sequence[str] | None = None,
        bucket_size_mb: float | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.host, self.port = host, int(port)
        self.base_url = f"http://{host}:{self.port}"
        self.group_port = group_port
        self.connection_timeout_s = connection_timeout_s
        self.enable_weight_updates = enable_weight_updates
        self.device = f"cuda:{device}" if isinstance(device, int) else device
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_batch_size = max_batch_size
        self.head_name_patterns = list(head_name_patterns) if head_name_patterns else None
        self.tokenizer = tokenizer
        self._strategy_given = strategy
        self._bucket_size_mb = bucket_size_mb
        self.strategy_cfg: dict | None = None
        if strategy is not None or self.device is not None:
            self.strategy_cfg = self._strategy_cfg(str(self.device or "cpu"))
        self.last_sync_stats: SyncStats | None = None
        self._http = LoopClients(timeout_s=request_timeout_s)
        self._session: SyncSession | None = None  # the front door's session, opened at the 1st sync
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._server_up = False
        self._twin = LoopThread("weightsync-reward-client")  # runs the blocking twins
        self._sync_lock: asyncio.Lock | None = None

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

    # -- HTTP ---------------------------------------------------------------------------------
    async def wait_for_server(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until the server answers (at most ``connection_timeout_s``), then
        run the tokenizer check when a tokenizer was given."""
        import httpx

        deadline = time.monotonic() + (self.connection_timeout_s if timeout_s is None else timeout_s)
        last = ""
        while True:
            try:
                r = await self._http.get().get(self.base_url + "/health", timeout=5.0)
                if r.status_code == 200 and r.json().get("type") == "reward_model":
                    break
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"reward server {self.base_url} not reachable within "
                    f"{self.connection_timeout_s:g}s ({last})"
                )
            await asyncio.sleep(0.5)
        if self.tokenizer is not None:
            await self._check_tokenizer()
        self._server_up = True

    async def _ensure_server(self) -> None:
        if not self._server_up:
            await self.wait_for_server()

    async def _check_tokenizer(self) -> None:
        tok = self.tokenizer
        if isinstance(tok, str):
            from transformers import AutoTokenizer

            tok = self.tokenizer = AutoTokenizer.from_pretrained(tok)
        http = self._http.get()
        for text in TOKENIZER_PROBES:
            mine = list(tok(text)["input_ids"])
            r = await http.post(self.base_url + "/tokenize", json={"prompt": text})
            if r.status_code == 200 and "tokens" in r.json():
                theirs: list[int] | int = list(r.json()["tokens"])
                same = theirs == mine
            else:  # no /tokenize: compare the count the score route reports for this text
                resp, _ = await self._score_request(ScoringRequest(inputs=[text]))
                theirs = resp.prompt_tokens
                same = theirs == len(mine)
            if not same:
                shown = theirs if isinstance(theirs, int) else f"{len(theirs)} tokens {theirs[:12]}"
                raise TokenizerMismatchError(
                    f"tokenizer check against reward server {self.base_url}: probe {text!r} is "
                    f"{len(mine)} tokens {mine[:12]} for the trainer's tokenizer but {shown} on "
                    f"the server; give the trainer the reward model's tokenizer (or "
                    f"tokenizer=None to skip the check)"
                )

    # -- scoring ------------------------------------------------------------------------------
    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict]:
        """One POST /score -> (response, info: latency_s, status, url, num_inputs)."""
        await self._ensure_server()
        return await self._score_request(request)

    async def _score_request(self, request: ScoringRequest) -> tuple[ScoringResponse, dict]:
        if request.model is None and self.model_name is not None:
            request = dataclasses.replace(request, model=self.model_name)
        t0 = time.perf_counter()
        r = await self._http.get().post(self.base_url + "/score", json=request.to_dict())
        info = {"latency_s": time.perf_counter() - t0, "status": r.status_code,
                "url": self.base_url + "/score", "num_inputs": len(request)}
        if r.status_code >= 400:
            err = error_from_response(self.base_url + "/score", r)
            if r.status_code == 503 and "in progress" in str(err):
                raise WeightSyncError(str(err))  # waiting for an update, not torn: retryable
            raise err
        return ScoringResponse.from_dict(r.json()), info

    async def score_batch(
        self, inputs: Sequence[str], *, normalize: bool | None = None
    ) -> list[float] | list[list[float]]:
        """Scores in input order (floats for one label, lists otherwise). ``normalize``: apply
        the model's activation (sigmoid for one label, softmax otherwise); None (default) keeps
        the raw scores, what transformers computes (the request says ``normalize: false``).
        With ``max_batch_size`` the texts go as concurrent sub-batches."""
        texts = list(inputs)
        norm = False if normalize is None else normalize
        ScoringRequest(texts, normalize=norm)  # validate before any request
        size = self.max_batch_size or len(texts)
        parts = [texts[i:i + size] for i in range(0, len(texts), size)]
        answers = await asyncio.gather(
            *(self.score(ScoringRequest(p, normalize=norm)) for p in parts))
        out: list[Any] = []
        for resp, _ in answers:
            out.extend(resp.scores)
        return out

    def score_batch_sync(
        self, inputs: Sequence[str], *, normalize: bool | None = None
    ) -> list[float] | list[list[float]]:
        """Blocking twin of ``score_batch`` (e.g. for a synchronous credit-assignment step)."""
        return self._run(self.score_batch(inputs, normalize=normalize))

    async def get_model_version(self) -> int:
        """The weight version the server serves now (``/runtime_version``)."""
        await self._ensure_server()
        r = await self._http.get().get(self.base_url + "/runtime_version")
        if r.status_code >= 400:
            raise error_from_response(self.base_url + "/runtime_version", r)
        return int(r.json()["version"])

    # -- weight sync --------------------------------------------------------------------------
    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float = 600.0,
    ) -> str:
        """Publish ``params`` as one update; returns the version the server now serves, as a
        string (details in ``last_sync_stats``). Names are normalised to engine names (PEFT /
        FSDP / DDP prefixes stripped), the training mode selects what is sent (HEAD_ONLY keeps
        the head and warns about the rest) and checks it: bad input raises
        ``WeightMismatchError`` before any byte moves and changes nothing."""
        named, mode = self._selected(params, training_mode)  # errors here, not on the loop
        return self._run(self._sync_named(named, mode, version, timeout_s))

    async def sync_weights_async(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float = 600.0,
    ) -> str:
        """Coroutine twin of ``sync_weights``."""
        named, mode = self._selected(params, training_mode)
        return await self._sync_named(named, mode, version, timeout_s)

    def _selected(
        self, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        training_mode: RewardModelTrainingMode | str,
    ) -> tuple[list[tuple[str, torch.Tensor]], RewardModelTrainingMode]:
        """What a sync sends: the mode's selection of ``params`` under engine names (refused
        when updates are disabled, or when the selection breaks the mode)."""
        self._check_enabled()
        mode = RewardModelTrainingMode.parse(training_mode)
        return select_params(params, mode, self.head_name_patterns), mode

    async def _sync_named(
        self, named: list[tuple[str, torch.Tensor]], mode: RewardModelTrainingMode,
        version: int | None, timeout_s: float,
    ) -> str:
        from weightsync.pipeline import make_chunks
        from weightsync.types import TensorMeta, dtype_to_str

        manifest = [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]

        def chunks() -> Iterable[WeightChunk]:  # made one by one as the sender asks
            cfg = self.strategy_cfg or {}
            return make_chunks(named, bucket_size_mb=float(cfg.get("bucket_size_mb", 1024)))

        stats = await self._send_update(chunks, manifest, mode, version, timeout_s,
                                        first_tensor=named[0][1])
        return _served(stats)

    def _check_enabled(self) -> None:
        if not self.enable_weight_updates:
            raise WeightSyncError(
                "weight updates are disabled for this client; create it with "
                "enable_weight_updates=True to sync weights"
            )

    async def _send_update(
        self,
        make_chunks: Any,
        manifest: list[TensorMeta],
        mode: RewardModelTrainingMode,
        version: int | None,
        timeout_s: float,
        *,
        first_tensor: Any = None,
    ) -> SyncStats:
        """One update from ``make_chunks()`` (an iterable or async iterable of chunks, made
        again for the one retry) under ``manifest``. Also the publisher's streaming path: the
        chunks are produced as the sender consumes them, so at most a few buckets are alive."""
        self._check_enabled()
        if self.strategy_cfg is None:  # device=None: follow the tensors
            device = str(getattr(first_tensor, "device", "cpu"))
            self.strategy_cfg = self._strategy_cfg(device)
        loop = asyncio.get_running_loop()
        if self._session_loop is not None and self._session_loop is not loop:
            if not self._session_loop.is_closed():
                raise WeightSyncError(
                    "this client's weight-sync group lives on another running event loop; use "
                    "one flavour per client (sync_weights, or sync_weights_async on one loop)"
                )
            self._session = self._session_loop = None  # its loop is gone (a finished
            self._sync_lock = None  # asyncio.run): join again
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

    async def _sync(
        self, chunks: Iterable[WeightChunk] | AsyncIterable[WeightChunk],
        manifest: list[TensorMeta], mode: RewardModelTrainingMode, version: int | None,
    ) -> SyncStats:
        """One update through the front door's session (``weightsync.connect``): it builds the
        group at the first sync, keeps it after a refusal and drops it after a transport
        failure or a replaced communicator (the next sync joins again)."""
        if self._session is None:
            from weightsync.connect import connect

            assert self.strategy_cfg is not None
            self._session = await connect([self.base_url], self.strategy_cfg,
                                          api_key=self.api_key, is_sender=True)
            self._session_loop = asyncio.get_running_loop()
        return await self._session.push_chunks(
            chunks, manifest, version=version, training_mode=mode,
            head_name_patterns=self.head_name_patterns,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Tear down the weight-sync group on both sides and close HTTP connections."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()  # best effort on the server's side: it may be gone already
        await self._http.aclose()

    def close_sync(self) -> None:
        """Blocking twin of ``close``; also stops the private loop thread."""
        if self._twin.started:
            self._twin.run(self.close())
            self._twin.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._twin.run(coro)

    async def __aenter__(self) -> VLLMRewardClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _served(stats: SyncStats) -> str:
    """The version the server serves after ``stats``' update, as a string."""
    served = [v for v in stats.versions if v is not None]
    return str(served[0]) if served else ""
