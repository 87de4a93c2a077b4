"""``weightsync.compat.skyrl`` between real processes, driven the way skyrl-train 0.3.1 drives
its weight sync: the trainer makes the init info, runs ``create_sender`` in a thread beside the
engine client's ``init_weight_update_communicator`` (each engine gets
``init_info.for_engine(i, tp, pp)``, pickled, and builds its receiver from
``init_info.strategy_type()``), then awaits ``send_chunks``; each engine worker gets every
request pickled and iterates ``receive_weights`` to the end, as SkyRL's vLLM worker does. The
engines are plain processes (one worker each) holding what they received.

- broadcast over gloo into 2 engines: every tensor arrives exact, in the model's dtype;
- an engine told another dtype refuses with SkyRL's text and votes no: the sender and the other
  engine get errors at once, nobody waits for the group's timeout;
- IPC through shared memory into an engine process, twice (the buffers are reused);
- IPC from 2 gloo training ranks (each with its own copy, as colocated FSDP ranks): both share
  every chunk, rank 0 sends the request, the engine worker reads rank 0's copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import pickle
import time
from typing import Any

import pytest
import torch
from _sharded_sync import spawn_gloo_ranks

import weightsync.compat.skyrl as sk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CALL_TIMEOUT_S = 60.0


def _engine_main(conn: Any, model_dtype: str | None) -> None:
    """One engine worker: builds its receiver from the init info it is sent, answers each
    request with the tensors ``receive_weights`` gave (copied), or with the error."""
    receiver = None
    while True:
        op, payload = conn.recv()
        try:
            if op == "init":
                info = pickle.loads(payload)
                if model_dtype is not None:
                    info = dataclasses.replace(info, model_dtype_str=model_dtype)
                receiver = info.strategy_type().create_receiver(info)
                conn.send(("ok", None))
            elif op == "load":
                assert receiver is not None
                got = {n: t.clone() for n, t in receiver.receive_weights(pickle.loads(payload))}
                conn.send(("ok", got))
            else:
                if receiver is not None:
                    receiver.teardown()
                conn.send(("ok", None))
                return
        except Exception as e:  # the engine's answer is its error
            conn.send(("error", f"{type(e).__name__}: {e}"))


class EngineProcesses:
    """SkyRL's engine client over engine processes: what its ``InferenceEngineClient`` does
    with the two weight-sync calls (engine ``i`` gets ``for_engine(i, 1, 1)``; every engine
    gets every request; the first error is raised)."""

    def __init__(self, n: int, dtypes: list[str | None] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine_main, args=(child, (dtypes or [None] * n)[i]),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        self.requests: list[Any] = []

    def _call(self, i: int, op: str, payload: Any) -> Any:
        self.conns[i].send((op, payload))
        if not self.conns[i].poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"engine {i} did not answer {op} within {CALL_TIMEOUT_S}s")
        status, value = self.conns[i].recv()
        if status == "error":
            raise RuntimeError(f"engine {i}: {value}")
        return value

    async def _all(self, op: str, payloads: list[Any]) -> list[Any]:
        """Every engine's answer; their errors together when any failed."""
        answers = await asyncio.gather(*(asyncio.to_thread(self._call, i, op, p)
                                         for i, p in enumerate(payloads)),
                                       return_exceptions=True)
        errors = [str(a) for a in answers if isinstance(a, BaseException)]
        if errors:
            raise RuntimeError("; ".join(errors))
        return list(answers)

    async def init_weight_update_communicator(self, init_info: Any) -> None:
        await self._all("init", [pickle.dumps(init_info.for_engine(i, 1, 1))
                                 for i in range(len(self.conns))])

    async def update_named_weights(self, request: Any) -> None:
        self.requests.append(request)
        for i, got in enumerate(await self._all("load", [pickle.dumps(request)] * len(
                self.conns))):
            self.loaded[i].update(got)

    def stop(self) -> None:
        for i in range(len(self.conns)):
            try:
                self._call(i, "stop", None)
            except Exception:  # noqa: BLE001 - an engine that failed is stopped below anyway
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _params(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"model.layers.{i}.{m}.{p}.weight": torch.randn(32, 16, generator=g)
            for i in range(3) for m, p in (("self_attn", "q_proj"), ("self_attn", "k_proj"),
                                           ("mlp", "up_proj"))}


def _chunks(params: dict[str, torch.Tensor]) -> Any:
    # fp32 modules of 4 KiB (attention) and 2 KiB (mlp): one layer's two per chunk, 3 tensors
    return sk.yield_module_grouped_chunks(params, torch.float32, lambda p: p,
                                          lambda n, p, t: list(t.shape), 7000 / 2**30)


def _config(backend: str, engines: int, colocate: bool) -> Any:
    cfg = sk.get_default_config()
    g = cfg.generator
    g.weight_sync_backend, g.num_inference_engines, g.model_dtype = backend, engines, "bfloat16"
    g.inference_engine_tensor_parallel_size = 1
    cfg.trainer.placement.colocate_all = colocate
    return cfg


async def _connect(cfg: Any, engines: EngineProcesses | None) -> Any:
    """SkyRL's ``Worker.init_weight_sync_state`` on one training rank (``engines`` None: a
    rank other than 0, which leaves the engines to rank 0)."""
    strategy = sk.get_transfer_strategy_cls(cfg)
    info = strategy.create_init_info(cfg)
    if isinstance(info, sk.BroadcastInitInfo):  # Ray's node address may not be routable here
        info = dataclasses.replace(info, master_addr="127.0.0.1")
    tasks = [asyncio.to_thread(strategy.create_sender, init_info=info, inference_client=engines)]
    if engines is not None:
        tasks.append(engines.init_weight_update_communicator(info))
    return (await asyncio.gather(*tasks))[0]


def test_broadcast_over_gloo_into_two_engines_is_exact() -> None:
    cfg = _config("gloo", engines=2, colocate=False)
    assert sk.get_transfer_strategy_cls(cfg) is sk.BroadcastTransferStrategy
    engines = EngineProcesses(2)
    try:
        sender = asyncio.run(_connect(cfg, engines))
        for step in (1, 2):
            params = _params(step)
            asyncio.run(sender.send_chunks(_chunks(params)))
            for loaded in engines.loaded:
                assert loaded.keys() == params.keys()
                for name, t in params.items():
                    assert torch.equal(loaded[name], t.to(torch.bfloat16)), name
        req = engines.requests[-1]
        assert isinstance(req, sk.BroadcastWeightUpdateRequest) and len(engines.requests) == 6
        assert len(req) == 3 and req.dtypes == ["bfloat16"] * 3 and req.shapes[0] == [32, 16]
        sender.teardown()
    finally:
        engines.stop()


def test_an_engine_told_another_dtype_votes_no_and_nobody_waits() -> None:
    cfg = _config("gloo", engines=2, colocate=False)
    engines = EngineProcesses(2, dtypes=[None, "float16"])
    try:
        sender = asyncio.run(_connect(cfg, engines))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            asyncio.run(sender.send_chunks(_chunks(_params(1))))
        # well inside the group's 30 s collective timeout: the refusing engine voted no
        assert time.monotonic() - t0 < 20
        assert "engine 1: ValueError: dtype mismatch: request bfloat16, model torch.float16" \
            in str(err.value)
        assert "engine 0: WeightSyncError: chunk 0 was rejected by another engine" \
            in str(err.value)
        assert engines.loaded == [{}, {}] and len(engines.requests) == 1
        sender.teardown()
    finally:
        engines.stop()


def test_ipc_through_shared_memory_into_an_engine_process() -> None:
    cfg = _config("nccl", engines=1, colocate=True)  # SkyRL's choice for colocated engines
    assert sk.get_transfer_strategy_cls(cfg) is sk.CudaIpcTransferStrategy
    engines = EngineProcesses(1)
    try:
        sender = asyncio.run(_connect(cfg, engines))
        for step in (1, 2):
            params = _params(step)
            asyncio.run(sender.send_chunks(_chunks(params)))
            for name, t in params.items():
                assert torch.equal(engines.loaded[0][name], t.to(torch.bfloat16)), name
        req = engines.requests[-1]
        assert isinstance(req, sk.CudaIpcWeightUpdateRequest)
        assert req.sizes == [512] * 3 and req.ipc_handles["rank0"][0]["kind"] == "shm"
        sender.teardown()
    finally:
        engines.stop()


async def _ipc_rank(rank: int, world: int, out: str) -> None:
    engines = EngineProcesses(1) if rank == 0 else None
    report: dict[str, Any] = {"rank": rank}
    try:
        sender = await _connect(_config("nccl", engines=1, colocate=True), engines)
        params = {n: t + 10 * rank for n, t in _params(1).items()}  # each rank's copy differs
        await sender.send_chunks(_chunks(params))
        if engines is not None:
            report["reads_rank"] = [
                r for r in range(world)
                if all(torch.equal(engines.loaded[0][n], (t + 10 * (r - rank)).to(torch.bfloat16))
                       for n, t in params.items())]
            report["copies"] = sorted(engines.requests[-1].ipc_handles)
            report["requests"] = len(engines.requests)
        sender.teardown()
    finally:
        if engines is not None:
            engines.stop()
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(report, f)


def test_ipc_from_two_training_ranks_each_sharing_its_copy(tmp_path) -> None:
    out = str(tmp_path / "ipc")
    spawn_gloo_ranks(_ipc_rank, out)
    r0, r1 = (json.loads((tmp_path / f"ipc.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["reads_rank"] == [0]  # worker 0 of the engine reads training rank 0's copy
    assert r0["copies"] == ["rank0", "rank1"] and r0["requests"] == 3
    assert r1 == {"rank": 1}  # rank 1 shared every chunk and left with rank 0
