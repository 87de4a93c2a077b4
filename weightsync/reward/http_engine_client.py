"""``InferenceEngineClient`` over the reward server's HTTP control plane.

Lives in the sending (training) process. Maps the framework's calls onto the server routes:

    get_world_sizes        GET  /get_world_size
    init_weight_transfer   POST /init_communicator   {strategy, sync_info, rank_offset}
    start_weight_update    POST /update_param_batch  {metadata: start,   training_mode, version}
    update_named_weights   POST /update_param_batch  {metadata: request, training_mode}
    finish_weight_update   POST /update_param_batch  {metadata: finish,  training_mode} -> version
    close_weight_transfer  POST /close_communicator

Several servers (replicas) fan out concurrently, each with its ``rank_offset``. A 4xx/5xx answer
becomes the matching exception: 400 with offenders -> ``WeightMismatchError`` (the server
refused before any byte moved), 503 -> ``UpdateIncompleteError``, 504 -> ``WeightSyncTimeout``,
409 -> ``UpdateRefusedError`` (``CommunicatorReplacedError`` when another sender took the
receivers), anything else -> ``WeightSyncError`` with the server's reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from weightsync.errors import (
    EngineDiedError,
    UpdateIncompleteError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncTimeout,
)
from weightsync.interfaces import InferenceEngineClient
from weightsync.reward.types import RewardModelTrainingMode


class UpdateRefusedError(WeightSyncError):
    """HTTP 409: the server refused a control call for its current state (an older version, a
    chunk without its start, ...); the data plane did not move."""


class CommunicatorReplacedError(UpdateRefusedError):
    """The server's receivers now belong to another sender (or were closed); re-initialise."""


class HttpEngineClient(InferenceEngineClient):
    """``base_urls``: ``"http://127.0.0.1:8001"`` or a list of them. ``training_mode`` travels
    with every update call (set it before ``send_chunks``)."""

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
    ) -> None:
        self.base_urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not self.base_urls:
            raise ValueError("base_urls: give at least one server URL")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.training_mode = RewardModelTrainingMode.parse(training_mode)
        self._clients: dict[int, Any] = {}  # per event loop (httpx clients are loop-bound)
        self.communicator_ids: list[int | None] = [None] * len(self.base_urls)

    # -- HTTP plumbing ------------------------------------------------------------------------
    def _http(self) -> Any:
        import httpx

        key = id(asyncio.get_running_loop())
        client = self._clients.get(key)
        if client is None or client.is_closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.timeout_s))
            self._clients = {key: client}
        return client

    async def _request(self, url: str, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            if method == "GET":
                r = await self._http().get(url + path)
            else:
                r = await self._http().post(url + path, json=body or {})
        except httpx.TimeoutException as e:
            raise WeightSyncTimeout(
                f"{url}{path}: no answer within {self.timeout_s:g}s ({type(e).__name__})"
            ) from None
        except (httpx.ConnectError, httpx.RemoteProtocolError) as e:  # server gone mid-call
            raise EngineDiedError(f"{url}{path}: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code < 400:
            return r.json()
        raise _error_from_response(url + path, r)

    async def _all(self, method: str, path: str, bodies: Sequence[dict | None]) -> list[dict]:
        return list(await asyncio.gather(
            *(self._request(u, method, path, b) for u, b in zip(self.base_urls, bodies, strict=True))
        ))

    def _update_bodies(self, metadata: dict) -> list[dict]:
        bodies = []
        for cid in self.communicator_ids:
            body: dict[str, Any] = {"metadata": metadata, "training_mode": self.training_mode.value}
            if metadata.get("type") == "start" and metadata.get("version") is not None:
                body["version"] = metadata["version"]
            if cid is not None:
                body["communicator_id"] = cid
            bodies.append(body)
        return bodies

    # -- InferenceEngineClient ----------------------------------------------------------------
    async def get_world_sizes(self) -> list[int]:
        answers = await self._all("GET", "/get_world_size", [None] * len(self.base_urls))
        return [int(a["world_size"]) for a in answers]

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        offsets = self.rank_offsets(await self.get_world_sizes())
        answers = await self._all("POST", "/init_communicator", [
            {"strategy": strategy_cfg, "sync_info": sync_info, "rank_offset": o} for o in offsets
        ])
        self.communicator_ids = [a.get("communicator_id") for a in answers]

    async def start_weight_update(self, start: dict) -> None:
        await self._all("POST", "/update_param_batch", self._update_bodies(start))

    async def update_named_weights(self, request: dict) -> None:
        await self._all("POST", "/update_param_batch", self._update_bodies(request))

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        answers = await self._all("POST", "/update_param_batch", self._update_bodies(finish))
        return [a.get("version") for a in answers]

    async def close_weight_transfer(self) -> None:
        await self._all("POST", "/close_communicator", [
            {"communicator_id": cid} if cid is not None else None for cid in self.communicator_ids
        ])
        self.communicator_ids = [None] * len(self.base_urls)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                await c.aclose()
            except RuntimeError:  # its loop is gone
                pass


def _error_from_response(where: str, r: Any) -> Exception:
    try:
        body = r.json()
    except ValueError:
        body = {"detail": r.text[:2000]}
    detail = body.get("detail") if isinstance(body, dict) else str(body)
    offenders = body.get("offenders") if isinstance(body, dict) else None
    if r.status_code == 400 and offenders:
        return WeightMismatchError(offenders, target=f"reward server {where}")
    if r.status_code == 503:
        return UpdateIncompleteError(f"{where}: {detail}")
    if r.status_code == 504:
        return WeightSyncTimeout(f"{where}: {detail}")
    if r.status_code == 400:
        return ValueError(f"{where}: {detail}")
    if r.status_code == 409:
        if "communicator was replaced" in str(detail):
            return CommunicatorReplacedError(f"{where}: {detail}")
        return UpdateRefusedError(f"{where}: {detail}")
    return WeightSyncError(f"{where}: HTTP {r.status_code}: {detail}")
