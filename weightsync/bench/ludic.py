"""The trainer side of the Ludic / TRL weight-sync protocol, as the per-parameter reference row
(``ludic``) of ``weightsync.bench.vllm_sync``.

What a Ludic/TRL trainer does per update: announce the whole batch's metadata
(``/update_param_batch {metadata, version}``), then one broadcast per tensor from its rank (the
last of the group), then a barrier, then poll until the server's background task is done. The
engine side here is ours as a server runs it: every vLLM worker holds the ``ludic_broadcast``
receiver inside its ``WeightUpdateEndpoint`` (manifest validated first, tensors loaded in
batches, version published at finish). The control calls go through ``collective_rpc`` in
process instead of HTTP (a few ms per update less than a server; the per-tensor data plane is the
same); finish stands in for the polling.

Group flavours as the protocol defines them: ``nccl`` = vLLM's ``StatelessProcessGroup`` +
``PyNcclCommunicator`` (GPU), ``gloo`` = vLLM's stateless gloo group (CPU). Worker ``i`` is rank
``i`` and hosts nothing but rank 0 hosts the store; the trainer is rank ``W``.

Runs in the bench (trainer) process.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any


class LudicTrainerSync:
    def __init__(self, llm: Any, *, device: str, timeout_s: float = 300.0) -> None:
        from weightsync.config import broadcast_backend
        from weightsync.testing.servers import free_port

        self.llm = llm
        self.device = device
        self.timeout_s = timeout_s
        self.backend = broadcast_backend(device)
        self.world = len(llm.collective_rpc("bench_noop"))  # engine workers
        port = free_port()
        strategy = {"type": "ludic_broadcast", "backend": self.backend, "timeout_s": timeout_s,
                    "bucket_size_mb": 256}
        info = {"type": "stateless_group", "host": "127.0.0.1", "port": port,
                "world_size": self.world + 1, "backend": self.backend, "timeout_s": timeout_s}
        errors: list[BaseException] = []

        def engines_join() -> None:
            try:
                self._call("init_weight_transfer", strategy_cfg=strategy, sync_info=info,
                           rank_offset=0)  # worker i -> rank i
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        t = threading.Thread(target=engines_join, daemon=True)
        t.start()
        self._join(port)
        t.join(timeout_s)
        if t.is_alive() or errors:
            raise errors[0] if errors else TimeoutError("engines did not join the Ludic group")
        self.note = (f"Ludic/TRL protocol: one announce per update, one {self.backend} broadcast "
                     f"per tensor from the trainer, barrier; our ludic_broadcast receiver")

    def _join(self, port: int) -> None:
        rank, world = self.world, self.world + 1
        if self.backend == "nccl":
            import torch
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            self.spg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank,
                                                    world_size=world,
                                                    store_timeout=int(self.timeout_s))
            self.comm = PyNcclCommunicator(self.spg, device=torch.device(self.device))
        else:
            from weightsync._runtime.vllm_compat import stateless_gloo_group

            self.pg = stateless_gloo_group("127.0.0.1", port, rank, world, self.timeout_s)

    def _call(self, method: str, **kwargs: Any) -> Any:
        from weightsync.loaders.vllm_worker import raise_for_results

        answers = self.llm.collective_rpc("weightsync_call", args=(method, kwargs))
        return raise_for_results(answers, engine="vLLM engine (ludic row)")

    def _broadcast_all(self, named: list[tuple[str, Any]]) -> None:
        src = self.world
        if self.backend == "nccl":
            import torch

            stream = torch.cuda.current_stream()
            for _, t in named:
                self.comm.broadcast(t, src=src, stream=stream)
            stream.synchronize()
            self.spg.barrier()
        else:
            import datetime

            timeout = datetime.timedelta(seconds=self.timeout_s)
            for _, t in named:
                self.pg.broadcast(t, root=src, timeout=timeout).wait()
            self.pg.barrier(timeout=timeout).wait()

    def sync(self, named: list[tuple[str, Any]], version: int) -> list[int]:
        from weightsync.strategies.ludic_broadcast import LudicWeightUpdateRequest
        from weightsync.types import TensorMeta, WeightUpdateFinish, WeightUpdateStart, dtype_to_str

        metas = [TensorMeta(n, dtype_to_str(t.dtype), list(t.shape)) for n, t in named]
        update_id = f"ludic-{uuid.uuid4().hex[:12]}"
        self._call("start_weight_update", start=WeightUpdateStart(
            update_id=update_id, version=version, manifest=metas).to_dict())
        chunk = LudicWeightUpdateRequest(
            names=[m.name for m in metas], dtypes=[m.dtype for m in metas],
            shapes=[list(m.shape) for m in metas], update_id=update_id, chunk_index=0,
            is_last=True, version=version, src_rank=self.world,
        ).to_dict()
        errors: list[BaseException] = []

        def engines_receive() -> None:
            try:
                self._call("update_named_weights", request=chunk)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        t = threading.Thread(target=engines_receive, daemon=True)
        t.start()
        self._broadcast_all(named)
        t.join(self.timeout_s)
        if t.is_alive() or errors:
            raise errors[0] if errors else TimeoutError("engines did not finish the Ludic batch")
        finish = WeightUpdateFinish(update_id=update_id, version=version, num_chunks=1, ok=True)
        return self._call("finish_weight_update", finish=finish.to_dict())

    def close(self) -> None:
        try:
            self._call("close_weight_transfer")
        finally:
            pg = getattr(self, "pg", None)
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception:  # noqa: BLE001 - best effort
                    pass
            self.comm = self.spg = self.pg = None
