"""The Ludic / TRL trainer protocol on our servers, translated into our update lifecycle.

Callers: ``weightsync.servers.control_routes`` (in a server process), when a body has the
Ludic shape: ``POST /init_communicator {host, port, world_size}`` and
``POST /update_param_batch {metadata: [{name, dtype, shape}], version?, training_mode?}``.
It is not a second update path: the workers run the ``ludic_broadcast`` receiver inside the
same ``WeightUpdateEndpoint`` (same validation before any byte, torn handling, version rules),
driven through the same ``UpdateControl`` (same gate, pause, prefix-cache reset) as our own
dialect.

What the trainer sees (its client is single-threaded: each HTTP call must return before it
can join a group or broadcast):

* ``/init_communicator`` answers ``{"status": "ok"}`` at once; the workers join the group in
  the background (rank ``i`` = worker ``i``, the trainer last) while the trainer joins it, and
  model requests are served meanwhile. A trainer that never joins (or dies joining) holds
  nothing: the join ends at ``group_timeout_s``, or at once when another ``/init_communicator``
  (for another group: the same one again keeps the join going) or a ``/close_communicator``
  comes. An abandoned join keeps its port until its timeout (a join on a helper thread cannot
  be interrupted), so a new group on that address is refused with that reason meanwhile;
* ``/update_param_batch`` waits at most ``JOIN_SETTLE_S`` for a join still under way (the
  trainer has joined by then, so ours completes at the same moment), else 409; it answers
  only after the engine checked the whole manifest against the served model: a bad name /
  shape / dtype (with ``--monotonic-versions``, a version that does not increase; with
  ``--strict-training-mode``, a tensor its ``training_mode`` forbids: ``servers._update_policy``)
  is a 4xx naming it, nothing changes, and the trainer does not enter its broadcast. Accepted:
  ``{"status": "ok", "batch_id": ...}``, and a background task receives the tensors (one
  broadcast each from the trainer's rank, in the metadata's order), loads them, joins the
  trainer's barrier, publishes ``version`` (default: current + 1), resets the prefix cache;
* ``/get_num_background_tasks`` is 0 once that is done; ``/runtime_version`` then shows the
  new version (or the old one and ``"state": "torn"`` if the transfer failed part-way);
* ``GET /batch_ready/{batch_id}`` -> ``{"ready": bool}`` (Ludic's ready signal: true once the
  receive was handed to the workers).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from typing import Any

from weightsync.servers.control import ServiceError, UpdateControl
from weightsync.types import TrainingMode

log = logging.getLogger(__name__)

_REMEMBERED_BATCHES = 64
#: how long ``/update_param_batch`` waits for the workers' join to complete: the trainer posts
#: it after its own join returned, when ours is done too (up to a poll of the workers later)
JOIN_SETTLE_S = 5.0


class LudicDialect:
    """``backend``: the group flavour when the trainer names none (``gloo`` on CPU servers,
    ``nccl`` on GPU ones). ``group_timeout_s``: joining the group and each collective."""

    def __init__(
        self,
        control: UpdateControl,
        *,
        backend: str,
        group_timeout_s: float = 120.0,
        bucket_size_mb: float = 256,
    ) -> None:
        self.control = control
        self.backend = backend
        self.group_timeout_s = group_timeout_s
        self.bucket_size_mb = bucket_size_mb
        self._joining: asyncio.Task | None = None
        self._group: tuple = ()  # (host, port, world_size, backend) of the last join
        self._communicator_id = 0  # the control's id of the trainer group (0: none)
        self._world_size = 0
        self._batches: OrderedDict[str, bool] = OrderedDict()  # batch id -> handed to workers

    # -- /init_communicator {host, port, world_size} ---------------------------------------------
    async def init_communicator(self, body: dict) -> dict:
        """Answer at once; the join runs in the background (a join still under way from an
        earlier call is abandoned by it: ``UpdateControl.init_communicator``)."""
        host, port, world_size, backend = await self._parse_init(body)
        from weightsync.strategies.ludic_broadcast import ludic_group

        task = self._joining
        if (task is not None and not task.done()
                and self._group == (host, port, world_size, backend)):
            return {"status": "ok"}  # the same group again (a trainer retrying): keep joining
        strategy, sync_info = ludic_group(host, port, world_size, backend=backend,
                                          timeout_s=self.group_timeout_s,
                                          bucket_size_mb=self.bucket_size_mb)
        self._communicator_id = 0
        self._world_size = world_size
        self._group = (host, port, world_size, backend)

        async def join() -> None:
            self._communicator_id = await self.control.init_communicator(strategy, sync_info, 0)

        self._joining = self.control.spawn(join(), f"joining the trainer's group at {host}:{port}")
        return {"status": "ok"}

    async def _parse_init(self, body: dict) -> tuple[str, int, int, str]:
        from weightsync.servers._http import field

        unknown = sorted(set(body) - {"host", "port", "world_size", "backend"})
        if unknown:
            raise ServiceError(400, f"unknown field(s) {unknown}; the trainer-group form takes "
                                    "host, port, world_size (and optionally backend)")
        host = field(body, "host", str)
        port = field(body, "port", int)
        world_size = field(body, "world_size", int)
        backend = field(body, "backend", str, required=False, default=self.backend)
        if not host.strip():
            raise ServiceError(400, "host: empty; give the address where rank 0 (this server's "
                                    "first worker) opens the group's store")
        if not 0 < port < 65536:
            raise ServiceError(400, f"port: must be in 1..65535, got {port}")
        workers = await self.control.world_size()
        if world_size != workers + 1:
            raise ServiceError(400, f"world_size: expected {workers + 1} (this server's {workers} "
                                    f"worker(s) + the trainer as the last rank), got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ServiceError(400, f"backend: must be 'gloo' or 'nccl', got {backend!r}")
        return host, port, world_size, backend

    async def _require_group(self) -> None:
        task = self._joining
        if task is not None:
            if not task.done():
                await asyncio.wait({task}, timeout=JOIN_SETTLE_S)
            if not task.done():
                host, port = self._group[:2]
                raise ServiceError(409, f"the workers are still joining the trainer's group at "
                                        f"{host}:{port} (waited {JOIN_SETTLE_S:g}s more): the "
                                        f"trainer joins it, as rank {self._world_size - 1}, "
                                        f"before POST /update_param_batch")
            if not task.cancelled() and task.exception() is not None:
                e = task.exception()
                why = e.message if isinstance(e, ServiceError) else f"{type(e).__name__}: {e}"
                raise ServiceError(409, f"the trainer's group was not formed ({why}); POST "
                                        f"/init_communicator again and join the group")
        if not self._communicator_id or self._communicator_id != self.control.communicator_id:
            raise ServiceError(409, "no trainer group on this server (never initialised, closed, "
                                    "or replaced by another sender); POST /init_communicator "
                                    "{host, port, world_size} first")

    # -- /update_param_batch {metadata: [...], version, training_mode} ----------------------------
    async def update_param_batch(
        self, metadata: list, version: int | None, training_mode: TrainingMode | None
    ) -> dict:
        from weightsync.strategies.ludic_broadcast import ludic_update

        metas = parse_metadata(metadata)
        await self._require_group()
        update_id = f"ludic-{uuid.uuid4().hex[:12]}"
        start, chunk, finish = ludic_update(metas, version, self._world_size - 1, update_id)
        await self.control.start(start, training_mode, version)  # 4xx: nothing moved
        self._remember(update_id, False)
        self.control.spawn(self._transfer(update_id, chunk, finish, training_mode),
                           f"receiving batch {update_id}")
        return {"status": "ok", "batch_id": update_id, "version": self.control.version}

    async def _transfer(
        self, update_id: str, chunk: dict, finish: dict, mode: TrainingMode | None,
    ) -> None:
        self._remember(update_id, True)
        try:
            await self.control.chunk(chunk, mode)
        except Exception as e:  # the endpoint marked the weights torn if any byte landed
            why = e.message if isinstance(e, ServiceError) else f"{type(e).__name__}: {e}"
            log.error("batch %s failed: %s", update_id, why)
            await self.control.abort(update_id, f"receiving batch {update_id} failed: {why}")
            return
        await self.control.finish(finish, finish.get("version"))

    def _remember(self, batch_id: str, ready: bool) -> None:
        self._batches[batch_id] = ready
        self._batches.move_to_end(batch_id)
        while len(self._batches) > _REMEMBERED_BATCHES:
            self._batches.popitem(last=False)

    def batch_ready(self, batch_id: str) -> dict:
        if batch_id not in self._batches:
            raise ServiceError(404, f"batch_id: {batch_id!r} is not a recent batch of this server")
        return {"ready": self._batches[batch_id]}


def parse_metadata(metadata: list) -> list[Any]:
    """``[{name, dtype, shape}]`` -> ``TensorMeta`` list; dtypes as ``str(tensor.dtype)``
    (``"torch.bfloat16"``) or plain (``"bfloat16"``). 400 naming the item otherwise."""
    from weightsync.types import TensorMeta

    if not metadata:
        raise ServiceError(400, "metadata: empty list; nothing to update")
    out = []
    for i, item in enumerate(metadata):
        if not isinstance(item, dict):
            raise ServiceError(400, f"metadata[{i}]: expected an object {{name, dtype, shape}}, "
                                    f"got {type(item).__name__}")
        unknown = sorted(set(item) - {"name", "dtype", "shape"})
        if unknown:
            raise ServiceError(400, f"metadata[{i}]: unknown field(s) {unknown}; expected name, "
                                    "dtype, shape")
        try:
            out.append(TensorMeta.from_dict(item))
        except ValueError as e:
            raise ServiceError(400, f"metadata[{i}]: {e}") from None
    return out
