"""``sglang`` loader: an SGLang engine, loaded through SGLang's own weight-update API.

Runs in the process that holds the SGLang engine (``sglang.Engine``, or anything with its
methods, such as SGLang's HTTP engine adapter): a Ray actor, a ``weightsync.local`` engine, the
trainer's node. SGLang's calls (signatures of SGLang 0.5.x, ``sglang/srt/entrypoints/engine.py``)
and what this loader maps onto them:

===========================================  =================================================
weightsync                                   SGLang
===========================================  =================================================
``load_weights(named)`` (any strategy: our    ``update_weights_from_tensor(named_tensors=[(name,
receiver got the bytes into this process)     tensor), ...], load_format=, flush_cache=False)``
``finish_update`` (every chunk landed)        ``flush_cache()`` (``flush_cache: true``)
``join_update_group(sync_info, rank_offset)``  ``init_weights_update_group(master_address,
                                              master_port, rank_offset, world_size,
                                              group_name, backend)``
``receive_broadcast(request)``                ``update_weights_from_distributed(names, dtypes,
                                              shapes, group_name, flush_cache=False,
                                              load_format=)``
``leave_update_group()``                      ``destroy_weights_update_group(group_name)``
===========================================  =================================================

Two ways in:

- **through our strategies** (``load_weights``): the update reaches this process over any
  weightsync strategy (its ``WeightUpdateEndpoint`` validates the manifest first) and SGLang
  loads each chunk itself: it shards the tensors over its TP workers, fuses QKV, and returns
  once they are loaded (so the receiver may reuse its buffers afterwards). Its radix cache is
  flushed once per update, after the last chunk.
- **SGLang's own data plane** (``join_update_group`` / ``receive_broadcast``): SGLang's TP
  workers join a torch.distributed group with the trainer at ranks ``rank_offset + tp_rank``
  and receive each tensor of a ``BroadcastWeightUpdateRequest`` as one broadcast from rank 0,
  in request order (``packed: false``), as SkyRL / verl / OpenRLHF trainers send them. Our
  ``broadcast`` strategy cannot drive it: its receivers vote on every chunk (an all-reduce)
  before the bytes move, which SGLang's workers do not take part in.

Every SGLang answer ``(success, message)`` that is not a success raises ``WeightSyncError`` with
SGLang's message (an update that failed half-way leaves the endpoint torn, as any loader's).
SGLang's methods block on the engine's own event loop, so they run on one thread of their own
(``SerialLane``), never on the endpoint's loop, one at a time in call order.

``expected_metadata()``: the safetensors headers of the engine's ``server_args.model_path``
when it is a local checkpoint (names and shapes are checked before any byte moves; dtypes are
not: SGLang casts to its served dtype), else None.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.config import LoaderConfig
from weightsync.errors import WeightSyncError
from weightsync.interfaces import WeightLoader
from weightsync.strategies.broadcast import (
    BroadcastWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
)
from weightsync.types import TensorMeta, WeightUpdateFinish

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(kw_only=True)
class SGLangLoaderConfig(LoaderConfig):
    """``load_format``: SGLang's (None: the model's ``load_weights``; ``"direct"``, or the
    import path of a custom loader the engine was started with). ``flush_cache``: flush the
    radix cache once per complete update. ``group_name``: the SGLang update group this loader
    joins (``join_update_group`` without a sync info of its own)."""

    type: str = "sglang"
    load_format: str | None = None
    flush_cache: bool = True
    group_name: str = "weightsync"


class SGLangWeightLoader(WeightLoader):
    """Loads into the SGLang ``engine`` through its weight-update API (registered as
    ``sglang``); see the module docstring for the mapping."""

    config_cls = SGLangLoaderConfig

    def __init__(self, cfg: Any = None, *, engine: Any) -> None:
        from weightsync._runtime.threads import SerialLane

        missing = [m for m in ("update_weights_from_tensor", "flush_cache")
                   if not callable(getattr(engine, m, None))]
        if missing:
            raise TypeError(f"SGLangWeightLoader needs engine=<sglang.Engine>; "
                            f"{type(engine).__name__} has no {', '.join(missing)}")
        self.cfg = cfg if cfg is not None else SGLangLoaderConfig()
        self.engine = engine
        self.group_name: str | None = None  # the SGLang update group joined, if any
        self._lane = SerialLane("weightsync-sglang")
        self._meta = _checkpoint_metas(engine)
        self.loads = 0

    # -- validation ----------------------------------------------------------------------------
    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        return self._meta

    def validate(self, metas: Iterable[TensorMeta]) -> None:
        from weightsync.validation import check_metadata

        check_metadata(metas, self._meta, check_dtype=False,
                       target=f"SGLang model {_model_path(self.engine) or '?'}")

    # -- through our strategies ----------------------------------------------------------------
    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        await self._call("update_weights_from_tensor", named_tensors=list(named_tensors.items()),
                         load_format=self.cfg.load_format, flush_cache=False)
        self.loads += 1

    async def finish_update(self, finish: WeightUpdateFinish) -> None:
        if self.cfg.flush_cache:
            await self._call("flush_cache")

    # -- SGLang's own data plane -----------------------------------------------------------------
    async def join_update_group(self, sync_info: TorchDistributedWeightSyncInfo | dict,
                                rank_offset: int) -> None:
        """SGLang's TP workers join the trainer's group at ``rank_offset + tp_rank``."""
        info = (sync_info if isinstance(sync_info, TorchDistributedWeightSyncInfo)
                else TorchDistributedWeightSyncInfo.from_dict(sync_info))
        if int(rank_offset) < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got "
                             f"{rank_offset}")
        await self._call("init_weights_update_group", master_address=info.master_addr,
                         master_port=int(info.master_port), rank_offset=int(rank_offset),
                         world_size=int(info.world_size), group_name=info.group_name,
                         backend=info.backend)
        self.group_name = info.group_name

    async def receive_broadcast(self, request: BroadcastWeightUpdateRequest | dict) -> None:
        """SGLang's workers receive the request's tensors (one broadcast each from rank 0, in
        order) and load them; validated against the checkpoint first."""
        req = (request if isinstance(request, BroadcastWeightUpdateRequest)
               else BroadcastWeightUpdateRequest.from_dict(request))
        if self.group_name is None:
            raise WeightSyncError("SGLang loader: receive_broadcast before join_update_group")
        if req.packed or req.src_rank != 0:
            raise ValueError(
                f"SGLang receives one broadcast per tensor from rank 0; this request has "
                f"packed={req.packed}, src_rank={req.src_rank} (send it with packed: false "
                f"from rank 0)")
        self.validate(req.metas())
        await self._call("update_weights_from_distributed", names=list(req.names),
                         dtypes=list(req.dtypes), shapes=[list(s) for s in req.shapes],
                         group_name=self.group_name, flush_cache=False,
                         load_format=self.cfg.load_format)
        self.loads += 1

    async def leave_update_group(self) -> None:
        if self.group_name is None:
            return
        name, self.group_name = self.group_name, None
        await self._call("destroy_weights_update_group", group_name=name)

    def close(self) -> None:
        self._lane.close()

    # -- calling SGLang ----------------------------------------------------------------------------
    async def _call(self, method: str, **kwargs: Any) -> Any:
        """``engine.<method>(**kwargs)`` on the loader's own thread (a coroutine method is
        awaited here); a ``(False, message)`` answer raises with SGLang's message."""
        fn = getattr(self.engine, method, None)
        if not callable(fn):
            raise WeightSyncError(f"SGLang engine {type(self.engine).__name__} has no {method}")
        if inspect.iscoroutinefunction(fn):
            result = await fn(**kwargs)
        else:
            result = await asyncio.wrap_future(self._lane.submit(lambda: fn(**kwargs)))
        ok, message = _outcome(result)
        if not ok:
            raise WeightSyncError(f"SGLang {method} failed: {message}")
        return result


def _outcome(result: Any) -> tuple[bool, str]:
    """SGLang answers ``(success, message)`` (the offline engine) or a dict with ``success``
    and ``message`` (the HTTP adapter); anything else (``flush_cache``'s) counts as success."""
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], bool):
        return result[0], str(result[1])
    if isinstance(result, Mapping) and "success" in result:
        return bool(result["success"]), str(result.get("message", ""))
    success = getattr(result, "success", None)
    if isinstance(success, bool):
        return success, str(getattr(result, "message", ""))
    return True, ""


def _model_path(engine: Any) -> str | None:
    args = getattr(engine, "server_args", None)
    path = getattr(args, "model_path", None)
    return str(path) if path else None


def _checkpoint_metas(engine: Any) -> dict[str, TensorMeta] | None:
    """Names and shapes of the engine's local safetensors checkpoint, if it has one."""
    from weightsync._runtime.vllm_compat import checkpoint_metadata

    path = _model_path(engine)
    found = checkpoint_metadata(path) if path and os.path.isdir(path) else None
    if not found:
        return None
    return {n: TensorMeta(n, dt, shape) for n, (dt, shape) in found.items()}
