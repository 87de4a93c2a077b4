"""Trainer-side client of the reward server: scoring and weight sync.

``RewardModelClient`` is the structural protocol the scorer / publisher / RL loop code against;
``VLLMRewardClient`` implements it for ``weightsync.servers.reward``. It lives in the training
process (rank 0). Scoring is plain HTTP. Weight sync goes through the framework: an
``HttpEngineClient`` over the server's control plane plus a strategy sender (default
``broadcast``: gloo on CPU, NCCL on CUDA; any strategy config works, e.g. ``cuda_ipc`` when the
server shares the host) built on the first sync and reused after; each sync is one
``send_chunks`` with a manifest, so the server refuses bad names / shapes / dtypes / training
modes before any byte moves.

Sync wrappers (``score_batch_sync``, ``sync_weights_sync``, ``close_sync``) run the coroutines
on one private event loop thread, so the sender's state stays on one loop across calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from weightsync._runtime.threads import LoopThread
from weightsync.errors import UpdateIncompleteError, WeightSyncError
from weightsync.reward.http_engine_client import (
    CommunicatorReplacedError,
    HttpEngineClient,
    UpdateRefusedError,
    _error_from_response,
)
from weightsync.reward.types import (
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    training_mode_offenders,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.interfaces import SyncStats

T = TypeVar("T")


@runtime_checkable
class RewardModelClient(Protocol):
    """What RL code needs from a reward model service (implement it without subclassing)."""

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict]: ...

    async def score_batch(self, inputs: Sequence[str]) -> list[float] | list[list[float]]: ...

    def score_batch_sync(self, inputs: Sequence[str]) -> list[float] | list[list[float]]: ...

    async def get_model_version(self) -> int: ...

    async def sync_weights(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL,
        timeout_s: float = 600.0,
    ) -> Any: ...


class VLLMRewardClient:
    """Client of one reward server at ``http://host:port``.

    ``group_port``: the port of the weight-sync group (broadcast strategies); the trainer hosts
    it. ``connection_timeout_s``: how long the first call waits for the server to come up.
    ``enable_weight_updates=False`` makes ``sync_weights`` an error (score-only clients).
    ``device``: where the trainer's tensors live ("cpu" / "cuda"); picks the default strategy.
    ``strategy``: a strategy config (mapping / YAML path / dataclass) replacing the default.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8001,
        group_port: int | None = None,
        connection_timeout_s: float = 60.0,
        enable_weight_updates: bool = True,
        device: str = "cpu",
        model_name: str | None = None,
        api_key: str | None = None,
        strategy: Any = None,
        *,
        request_timeout_s: float = 300.0,
        max_batch_size: int | None = None,
        head_name_patterns: Sequence[str] | None = None,
        bucket_size_mb: float | None = None,
    ) -> None:
        self.host, self.port = host, int(port)
        self.base_url = f"http://{host}:{self.port}"
        self.group_port = group_port
        self.connection_timeout_s = connection_timeout_s
        self.enable_weight_updates = enable_weight_updates
        self.device = device
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_batch_size = max_batch_size
        self.head_name_patterns = list(head_name_patterns) if head_name_patterns else None
        self.strategy_cfg = self._strategy_cfg(strategy, bucket_size_mb)
        self._http_clients: dict[int, Any] = {}
        self._engine_client: HttpEngineClient | None = None
        self._strategy: Any = None
        self._sender: Any = None
        self._server_up = False
        self._twin = LoopThread("weightsync-reward-client")  # runs the *_sync methods
        self._sync_lock: asyncio.Lock | None = None

    # -- configuration ------------------------------------------------------------------------
    def _strategy_cfg(self, strategy: Any, bucket_size_mb: float | None) -> dict:
        from weightsync.config import to_plain

        if strategy is None:
            backend = "nccl" if str(self.device).startswith("cuda") else "gloo"
            cfg: dict[str, Any] = {"type": "broadcast", "backend": backend}
            if self.group_port:
                cfg["master_port"] = int(self.group_port)
            if self.host in ("127.0.0.1", "localhost", "::1"):
                cfg["master_addr"] = "127.0.0.1"
        else:
            cfg = dict(to_plain(strategy))
            if "strategy" in cfg and "type" not in cfg:
                cfg = dict(cfg["strategy"])
        if bucket_size_mb is not None:
            cfg["bucket_size_mb"] = bucket_size_mb
        return cfg

    # -- HTTP ---------------------------------------------------------------------------------
    def _http(self) -> Any:
        import httpx

        key = id(asyncio.get_running_loop())
        client = self._http_clients.get(key)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s))
            self._http_clients = {key: client}
        return client

    async def wait_for_server(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until the server answers (at most ``connection_timeout_s``)."""
        import httpx

        deadline = time.monotonic() + (self.connection_timeout_s if timeout_s is None else timeout_s)
        last = ""
        while True:
            try:
                r = await self._http().get(self.base_url + "/health", timeout=5.0)
                if r.status_code == 200 and r.json().get("type") == "reward_model":
                    self._server_up = True
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"reward server {self.base_url} not reachable within "
                    f"{self.connection_timeout_s:g}s ({last})"
                )
            await asyncio.sleep(0.5)

    async def _ensure_server(self) -> None:
        if not self._server_up:
            await self.wait_for_server()

    # -- scoring ------------------------------------------------------------------------------
    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict]:
        """One POST /score -> (response, info: latency_s, status, url)."""
        await self._ensure_server()
        if request.model is None and self.model_name is not None:
            request = ScoringRequest(request.inputs, request.use_activation, self.model_name)
        t0 = time.perf_counter()
        r = await self._http().post(self.base_url + "/score", json=request.to_dict())
        info = {"latency_s": time.perf_counter() - t0, "status": r.status_code,
                "url": self.base_url + "/score", "num_inputs": len(request)}
        if r.status_code >= 400:
            err = _error_from_response(self.base_url + "/score", r)
            if r.status_code == 503 and "in progress" in str(err):
                raise WeightSyncError(str(err))  # waiting for an update, not torn: retryable
            raise err
        return ScoringResponse.from_dict(r.json()), info

    async def score_batch(
        self, inputs: Sequence[str], *, use_activation: bool = False
    ) -> list[float] | list[list[float]]:
        """Scores in input order (floats for one label, lists otherwise). With
        ``max_batch_size`` the texts go as concurrent sub-batches."""
        texts = list(inputs)
        ScoringRequest(texts, use_activation)  # validate before any request
        size = self.max_batch_size or len(texts)
        parts = [texts[i:i + size] for i in range(0, len(texts), size)]
        answers = await asyncio.gather(
            *(self.score(ScoringRequest(p, use_activation)) for p in parts)
        )
        out: list[Any] = []
        for resp, _ in answers:
            out.extend(resp.scores)
        return out

    def score_batch_sync(
        self, inputs: Sequence[str], *, use_activation: bool = False
    ) -> list[float] | list[list[float]]:
        return self._run(self.score_batch(inputs, use_activation=use_activation))

    async def get_model_version(self) -> int:
        await self._ensure_server()
        r = await self._http().get(self.base_url + "/runtime_version")
        if r.status_code >= 400:
            raise _error_from_response(self.base_url + "/runtime_version", r)
        return int(r.json()["version"])

    # -- weight sync --------------------------------------------------------------------------
    async def sync_weights(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float = 600.0,
    ) -> SyncStats:
        """Publish ``params`` (engine names -> tensors) as one update; returns its ``SyncStats``
        (``versions``: what the server now serves). Bad names / shapes / dtypes / training-mode
        violations raise ``WeightMismatchError`` before any byte moves and change nothing."""
        if not self.enable_weight_updates:
            raise WeightSyncError("weight updates are disabled for this client "
                                  "(enable_weight_updates=False)")
        mode = RewardModelTrainingMode.parse(training_mode)
        named = _named_list(params)
        if not named:
            raise ValueError("params: nothing to sync (no tensors given)")
        bad = training_mode_offenders([n for n, _ in named], mode, self.head_name_patterns,
                                      whole_update=True)
        if bad:
            from weightsync.errors import WeightMismatchError

            raise WeightMismatchError(bad, target=f"{mode.value} update")
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        async with self._sync_lock:
            await self._ensure_server()
            try:
                return await asyncio.wait_for(self._sync(named, mode, version), timeout_s)
            except CommunicatorReplacedError:
                # another sender took the server's receivers (refused at start, nothing moved):
                # join again and retry once
                return await asyncio.wait_for(self._sync(named, mode, version), timeout_s)

    async def _sync(
        self, named: list[tuple[str, torch.Tensor]], mode: RewardModelTrainingMode,
        version: int | None,
    ) -> SyncStats:
        from weightsync.errors import WeightMismatchError
        from weightsync.pipeline import make_chunks
        from weightsync.types import TensorMeta, dtype_to_str

        sender = await self._ensure_sender()
        assert self._engine_client is not None
        self._engine_client.training_mode = mode
        chunks = list(make_chunks(
            named, bucket_size_mb=float(self.strategy_cfg.get("bucket_size_mb", 1024))
        ))
        manifest = [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]
        try:
            return await sender.send_chunks(
                chunks, self._engine_client, version=version, manifest=manifest,
                training_mode=mode, head_name_patterns=self.head_name_patterns,
            )
        except CommunicatorReplacedError:
            await self._drop_sender()  # our group is gone on the server side
            raise
        except (WeightMismatchError, ValueError, UpdateIncompleteError, UpdateRefusedError):
            raise  # refused / torn: the data plane is still in step
        except BaseException:
            await self._drop_sender()  # a transport failure: rebuild the group next time
            raise

    async def _ensure_sender(self) -> Any:
        if self._sender is not None:
            return self._sender
        from weightsync.config import build_strategy

        if self._engine_client is None:
            self._engine_client = HttpEngineClient(
                self.base_url, api_key=self.api_key, timeout_s=self.request_timeout_s
            )
        self._strategy = build_strategy(self.strategy_cfg)
        info = await self._strategy.create_sync_info(None, self._engine_client)
        self._sender = await self._strategy.create_sender(None, self._engine_client, info)
        return self._sender

    async def _drop_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            try:
                await sender.close()
            except Exception:  # noqa: BLE001 - already failing; keep the first error
                pass

    def sync_weights_sync(self, params: Any, **kwargs: Any) -> SyncStats:
        return self._run(self.sync_weights(params, **kwargs))

    # -- lifecycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Tear down the weight-sync group on both sides and close HTTP connections."""
        if self._sender is not None and self._engine_client is not None:
            try:
                await self._engine_client.close_weight_transfer()
            except Exception:  # noqa: BLE001 - the server may be gone already
                pass
        await self._drop_sender()
        if self._engine_client is not None:
            await self._engine_client.aclose()
        clients, self._http_clients = list(self._http_clients.values()), {}
        for c in clients:
            try:
                await c.aclose()
            except RuntimeError:
                pass

    def close_sync(self) -> None:
        if self._twin.started:
            self._run(self.close())
            self._twin.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._twin.run(coro)

    async def __aenter__(self) -> VLLMRewardClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _named_list(params: Any) -> list[tuple[str, Any]]:
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"params: item {i} is not a (name, tensor) pair")
        if not hasattr(item[1], "dtype") or not hasattr(item[1], "shape"):
            raise ValueError(f"params: {item[0]!r} is a {type(item[1]).__name__}, not a tensor")
        out.append((item[0], item[1].detach()))
    return out
