"""The run behind ``weightsync.bench.vllm_sync``: the trainer's module, the references, one vLLM
engine at a time and the rows against it (see ``vllm_sync``'s docstring for what is measured).

``Bench(cfg).run()`` returns ``{meta, references, rows, stages}`` and rewrites ``cfg.json_path``
after every row, so a run cut short still leaves what it measured. The pieces are usable one by
one (tests do): ``build_trainer_model``, ``measure_references``, ``start``, ``run_rows``,
``verify``, ``logprob_check``, ``negate``.

Runs in the bench (trainer) process; vLLM, torch and transformers are imported where used.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from weightsync.bench.probes import ProbeClient, device_sync, timed_chunks, timed_sync_fn
from weightsync.bench.vllm_config import (
    LUDIC,
    NATIVE,
    PER_PARAM,
    PUSH,
    REMOTE_ROWS,
    VllmBenchConfig,
    validate,
)


class Bench:
    """One benchmark run: the trainer's module, the references, one engine at a time."""

    def __init__(self, cfg: VllmBenchConfig) -> None:
        validate(cfg)
        self.cfg = cfg
        t0 = time.perf_counter()
        self._t0 = t0
        self.rows: list[dict[str, Any]] = []
        self.stages: dict[str, dict[str, float]] = {}
        self.references: dict[str, dict[str, Any]] = {}
        self.module: Any = None
        self.trainer_device = "cuda:0" if cfg.on_cuda else "cpu"

    def log(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[bench-vllm {time.perf_counter() - self._t0:6.1f}s] {msg}", file=sys.stderr,
                  flush=True)

    # -- set-up --------------------------------------------------------------------------------
    def build_trainer_model(self) -> None:
        import torch

        from weightsync.bench.shapes import build_module, shape_numel, shape_specs

        if self.cfg.on_cuda:
            torch.cuda.set_device(0)
        self.nbytes = shape_numel(self.cfg.shape) * torch.empty(
            (), dtype=getattr(torch, self.cfg.dtype)).element_size()
        self.ntensors = len(shape_specs(self.cfg.shape))
        self.log(f"shape {self.cfg.shape}: {self.ntensors} tensors, {self.nbytes / 1e9:.3f} GB "
                 f"{self.cfg.dtype}; building the trainer's module on {self.trainer_device}")
        self.module = build_module(shape=self.cfg.shape, dtype=self.cfg.dtype, seed=0,
                                   device=self.trainer_device)
        _model_like_scale_(self.module)

    def measure_references(self) -> None:
        from weightsync.bench.reference import MemcpyProbe, raw_broadcast_gbps

        cfg = self.cfg
        probe = MemcpyProbe(self.nbytes, self.trainer_device)
        try:
            secs = statistics.median(probe.once() for _ in range(max(cfg.repeats, 3)))
        finally:
            probe.close()
        gbps = probe.nbytes / secs / 1e9
        name = "device_copy" if cfg.on_cuda else "memcpy"
        self.references[name] = {"seconds": self.nbytes / gbps / 1e9, "gbps": gbps,
                                 "note": f"one copy_ of {probe.nbytes / 1e9:.2f} GB, scaled"}
        self.log(f"{name}: {gbps:.1f} GB/s -> {self.nbytes / gbps / 1e9 * 1e3:.2f} ms for all bytes")
        if any(r in REMOTE_ROWS for r in cfg.rows):
            backend = "nccl" if cfg.on_cuda else "gloo"
            tp = cfg.tensor_parallel_size
            peers = [f"cuda:{1 + i}" for i in range(tp)] if cfg.on_cuda else ["cpu"] * tp
            try:
                gbps = raw_broadcast_gbps(self.nbytes, backend, self.trainer_device,
                                          max(cfg.repeats, 3), peer_device=peers,
                                          timeout_s=min(cfg.timeout_s, 180.0))
                self.references["flat_broadcast"] = {
                    "seconds": self.nbytes / gbps / 1e9, "gbps": gbps,
                    "note": f"one {backend} broadcast of one flat buffer to {tp} peer(s) "
                            f"({', '.join(peers)})",
                }
                self.log(f"flat {backend} broadcast: {gbps:.1f} GB/s")
            except Exception as e:  # reported, the rows still run
                self.references["flat_broadcast"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                self.log(f"flat broadcast reference failed: {e}")

    def engine_groups(self) -> list[tuple[str, list[str], str | None]]:
        """``(device, rows, native backend)`` per engine, in run order."""
        cfg = self.cfg
        rows = [r for r in cfg.rows if cfg.on_cuda or r not in NATIVE]
        if not cfg.on_cuda:
            return [("cpu", rows, None)] if rows else []
        remote = [r for r in rows if r in REMOTE_ROWS]
        local = [r for r in rows if r not in REMOTE_ROWS]
        out = []
        if remote:
            out.append(("cuda:1", remote, "nccl" if "native_nccl" in remote else None))
        if local:
            native = "ipc" if any(r.startswith("native_ipc") for r in local) else None
            out.append(("cuda:0", local, native))
        return out

    def start(self, device: str, native: str | None) -> Any:
        from weightsync.bench.vllm_engine import EngineSpec, start_engine

        cfg = self.cfg
        if native == "ipc":
            from weightsync.bench.native import prepare_native_env

            prepare_native_env()
        spec = EngineSpec(
            model_dir=self.model_dir, device=device, dtype=cfg.dtype,
            enforce_eager=not cfg.cuda_graphs, tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization, native_backend=native,
        )
        self.log(f"starting vLLM on {device} (TP={cfg.tensor_parallel_size}, "
                 f"{'CUDA graphs' if cfg.cuda_graphs else 'eager'}, native backend {native})")
        t0 = time.perf_counter()
        llm = start_engine(spec)
        self.log(f"vLLM up in {time.perf_counter() - t0:.1f} s")
        return llm

    # -- helpers -----------------------------------------------------------------------------
    def negate(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.module.parameters():
                p.neg_()
        device_sync(self.trainer_device)

    def sender_memory(self, reset: bool) -> int | None:
        if not self.cfg.on_cuda:
            return None
        import torch

        torch.cuda.synchronize()
        if reset:
            torch.cuda.reset_peak_memory_stats(0)
            return int(torch.cuda.memory_allocated(0))
        return int(torch.cuda.max_memory_allocated(0))

    @staticmethod
    def engine_memory(llm: Any, reset: bool) -> int | None:
        answers = llm.collective_rpc("bench_memory", args=(reset,))
        if not answers or answers[0] is None:
            return None
        key = "allocated" if reset else "peak"
        return max(int(a[key]) for a in answers)

    def noop_rpc_seconds(self, llm: Any, n: int = 20) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            llm.collective_rpc("bench_noop")
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    # -- verification --------------------------------------------------------------------------
    def verify(self, llm: Any) -> dict[str, Any]:
        from weightsync.bench.vllm_checks import verify_engine

        return verify_engine(llm, self.module)

    def logprob_check(self, llm: Any) -> dict[str, Any]:
        from weightsync.bench.vllm_checks import logprob_check

        return logprob_check(llm, self.module, self.model_dir, dtype=self.cfg.dtype,
                             device=self.trainer_device)

    # -- rows ----------------------------------------------------------------------------------
    def ours_config(self, row: str) -> tuple[dict, dict]:
        cfg = self.cfg
        common: dict[str, Any] = {"bucket_size_mb": cfg.bucket_mb, "timeout_s": cfg.timeout_s}
        if cfg.max_inflight is not None:
            common["max_inflight_chunks"] = cfg.max_inflight
        extractor: dict[str, Any] = {"type": "hf", "bucket_size_mb": cfg.bucket_mb}
        backend = "nccl" if cfg.on_cuda else "gloo"
        if row == PER_PARAM:
            strategy = {"type": "broadcast", "backend": backend, "packed": False, **common,
                        "max_inflight_chunks": 1}
            extractor.update(bucket_size_mb=0, group_by_module=False)
        elif row == "broadcast":
            strategy = {"type": "broadcast", "backend": backend, **common}
        elif row == "broadcast_ungrouped":
            strategy = {"type": "broadcast", "backend": backend, "group_calls": False, **common}
        elif row == "broadcast_serial":
            strategy = {"type": "broadcast", "backend": backend, "overlap_chunks": False,
                        **common}
        elif row == "broadcast_staged":
            strategy = {"type": "broadcast", "backend": backend, "staged": True, **common}
        elif row == "cuda_ipc_load_weights":
            strategy = {"type": "cuda_ipc", **common}
        elif row == "cuda_ipc_1chunk":  # one chunk: a bucket larger than the model
            whole = 2 * self.nbytes / (1 << 20) + 1
            strategy = {"type": "cuda_ipc", **common, "bucket_size_mb": whole}
            extractor["bucket_size_mb"] = whole
        else:
            strategy = {"type": row, **common}
        return strategy, extractor

    async def run_ours(self, row: str, llm: Any) -> dict[str, Any]:
        from weightsync.bench.vllm_engine import rpc_one
        from weightsync.clients import FanOutClient
        from weightsync.config import build_extractor, build_strategy

        cfg = self.cfg
        strategy_cfg, extractor_cfg = self.ours_config(row)
        rec: dict[str, Any] = {"row": row, "kind": "ours", "strategy": strategy_cfg}
        client = ProbeClient(FanOutClient([llm], timeout_s=cfg.timeout_s))
        extractor = build_extractor(extractor_cfg)
        if row == "cuda_ipc_load_weights":  # the loader without its copy plan, for this row
            llm.collective_rpc("weightsync_setup", args=({"copy_plan": False},))
        manifest = extractor.metadata(self.module)
        version = int(rpc_one(llm, "weightsync_version"))
        engine_base = self.engine_memory(llm, reset=True)
        sender_base = self.sender_memory(reset=True)
        strategy = build_strategy(strategy_cfg)
        info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, info)
        try:
            async def one(v: int) -> Any:
                return await sender.send_chunks(extractor.extract_weights(self.module), client,
                                                version=v, manifest=manifest)

            version = await self.timed_syncs(row, llm, rec, version, one, engine_base,
                                             sender_base)
            version += 1
            self.stages[row] = await self.profiled_sync(row, sender, extractor, client, llm,
                                                       version, manifest)
        finally:
            await sender.close()
            with contextlib.suppress(Exception):
                await client.close_weight_transfer()
            if row == "cuda_ipc_load_weights":
                llm.collective_rpc("weightsync_setup", args=({},))
        return rec

    async def timed_syncs(self, row: str, llm: Any, rec: dict[str, Any], version: int,
                          one: Any, engine_base: int | None, sender_base: int | None) -> int:
        """``cfg.warmup`` then ``cfg.repeats`` syncs of new values (``one(version)`` each, the
        trainer's weights negated first), each checked for the version the engine published;
        fills ``rec`` (median seconds, sizes, the engine's load path, extra memory on both
        sides). Returns the last version sent."""
        from weightsync.bench.vllm_engine import rpc_one

        cfg = self.cfg
        times: list[float] = []
        fronts: list[dict[str, float]] = []
        for i in range(cfg.warmup + cfg.repeats):
            self.negate()
            version += 1
            t0 = time.perf_counter()
            stats = await one(version)
            dt = time.perf_counter() - t0
            if stats is None or stats.versions != [version]:
                raise RuntimeError(f"engine published {stats and stats.versions}, expected "
                                   f"[{version}]")
            (times if i >= cfg.warmup else rec.setdefault("warmup_s", [])).append(dt)
            if i >= cfg.warmup and stats.front_ms:
                fronts.append(stats.front_ms)
            self.log(f"{row}: sync {i + 1}/{cfg.warmup + cfg.repeats} {dt * 1e3:.1f} ms "
                     f"({stats.num_chunks} chunks)")
        if fronts:  # a push row: the front door's split (SyncStats.front_ms), median per part
            rec["front_ms"] = {k: statistics.median(f[k] for f in fronts) for k in fronts[0]}
        rec.update(seconds=statistics.median(times), seconds_all=times,
                   num_chunks=stats.num_chunks, num_tensors=stats.num_tensors,
                   bytes=stats.total_bytes)
        state = rpc_one(llm, "weightsync_state")
        rec["engine_load"] = {"load_mode": state.get("load_mode"),
                              "copy_plan": state.get("copy_plan")}
        peak, epeak = self.sender_memory(reset=False), self.engine_memory(llm, reset=False)
        rec["sender_extra_bytes"] = None if peak is None else peak - sender_base
        rec["engine_extra_bytes"] = None if epeak is None else epeak - engine_base
        return version

    async def profiled_sync(self, row: str, sender: Any, extractor: Any, client: ProbeClient,
                            llm: Any, version: int, manifest: Any) -> dict[str, float]:
        """One more sync with every stage timed and synchronised (see the module docstring)."""
        dev = self.trainer_device
        llm.collective_rpc("bench_probe", args=(True,))
        times: dict[str, float] = {}
        patched = {"create_request": timed_sync_fn(sender.create_request, times, "pack_s", dev)}
        if hasattr(sender, "_send_data"):
            patched["_send_data"] = timed_sync_fn(sender._send_data, times, "send_data_s", dev)
        for k, v in patched.items():
            setattr(sender, k, v)
        client.times, client.recording = {}, True
        self.negate()
        try:
            t0 = time.perf_counter()
            stats = await sender.send_chunks(
                timed_chunks(extractor.extract_weights(self.module), times, dev), client,
                version=version, manifest=manifest,
            )
            total = time.perf_counter() - t0
        finally:
            client.recording = False
            for k in patched:
                sender.__dict__.pop(k, None)
            engine = llm.collective_rpc("bench_probe", args=(False,))
        worker = max(engine, key=lambda e: e.get("chunk_s", 0.0))
        out = {"total_s": total, "chunks": stats.num_chunks, **times, **client.times}
        out.update({f"engine_{k}": v for k, v in worker.items() if k != "chunks"})
        out["engine_receive_s"] = out.get("engine_chunk_s", 0.0) - out.get("engine_load_s", 0.0)
        # the chunk's round trip (or the one call that carried it) minus the engine's time in it
        out["chunk_overhead_s"] = out.get("chunk_rpc_s", out.get("apply_rpc_s", 0.0)) - out.get(
            "engine_chunk_s", 0.0)
        # every round trip minus the endpoint's own time in it: collective_rpc, serialisation,
        # thread hops, and the prefix-cache reset after the finish
        control = sum(out.get(k, 0.0) for k in ("start_rpc_s", "chunk_rpc_s", "finish_rpc_s",
                                                 "apply_rpc_s"))
        engine = sum(out.get(k, 0.0) for k in ("engine_start_s", "engine_chunk_s",
                                                "engine_finish_s"))
        out["control_overhead_s"] = control - engine
        out["noop_rpc_s"] = self.noop_rpc_seconds(llm)
        # vLLM's prefix-cache reset alone (the channel runs it after every finished update; its
        # cost grows with the number of KV-cache blocks: a Python loop over all of them)
        from weightsync._runtime import vllm_compat as compat

        t0 = time.perf_counter()
        compat.reset_prefix_cache(llm)
        out["prefix_reset_s"] = time.perf_counter() - t0
        self.log(f"{row}: profiled sync {total * 1e3:.1f} ms: " + ", ".join(
            f"{k} {v * 1e3:.1f}" for k, v in out.items() if k.endswith("_s") and k != "total_s"))
        return out

    async def run_push(self, row: str, llm: Any) -> dict[str, Any]:
        """A headline row: the trainer's module pushed as users push it, through the front door
        (``ws.connect([llm], strategy)`` once, then ``push(module, version=)`` per sync)."""
        import weightsync as ws
        from weightsync.bench.vllm_engine import rpc_one

        cfg = self.cfg
        strategy = {"type": row.removeprefix("push_"), "bucket_size_mb": cfg.bucket_mb,
                    "timeout_s": cfg.timeout_s}
        rec: dict[str, Any] = {"row": row, "kind": "ours", "strategy": strategy,
                               "note": "ws.connect(...).push(model)"}
        version = int(rpc_one(llm, "weightsync_version"))
        engine_base = self.engine_memory(llm, reset=True)
        sender_base = self.sender_memory(reset=True)
        async with ws.connect([llm], strategy) as sync:
            async def one(v: int) -> Any:
                return await sync.push(self.module, version=v)

            await self.timed_syncs(row, llm, rec, version, one, engine_base, sender_base)
        return rec

    def run_reference_row(self, row: str, llm: Any) -> dict[str, Any]:
        """A row driven by someone else's protocol: vLLM's native engines, the Ludic client."""
        from weightsync.bench.native import GIB, NativeIpcSync, NativeNcclSync
        from weightsync.bench.vllm_engine import rpc_one

        cfg = self.cfg
        rec: dict[str, Any] = {"row": row, "kind": "ludic" if row == LUDIC else "native"}
        named = list(self.module.state_dict().items())
        largest = max(t.numel() * t.element_size() for _, t in named)
        engine_base = self.engine_memory(llm, reset=True)
        sender_base = self.sender_memory(reset=True)
        version = int(rpc_one(llm, "weightsync_version"))
        if row == LUDIC:
            from weightsync.bench.ludic import LudicTrainerSync

            native: Any = LudicTrainerSync(llm, device=self.trainer_device,
                                           timeout_s=cfg.timeout_s)
        elif row == "native_nccl":
            native = NativeNcclSync(llm, timeout_s=cfg.timeout_s)
        else:
            native = NativeIpcSync(llm, packed=row == "native_ipc_packed", buffer_bytes=GIB,
                                   largest_tensor_bytes=largest)
        rec["note"] = native.note
        try:
            times = []
            for i in range(cfg.warmup + cfg.repeats):
                self.negate()
                t0 = time.perf_counter()
                if row == LUDIC:
                    version += 1
                    published = native.sync(named, version)
                    if published != [version] * len(published):
                        raise RuntimeError(f"engine published {published}, expected {version}")
                else:
                    native.sync(named)
                dt = time.perf_counter() - t0
                (times if i >= cfg.warmup else rec.setdefault("warmup_s", [])).append(dt)
                self.log(f"{row}: sync {i + 1}/{cfg.warmup + cfg.repeats} {dt * 1e3:.1f} ms")
            peak = self.sender_memory(reset=False)
            epeak = self.engine_memory(llm, reset=False)
            rec.update(seconds=statistics.median(times), seconds_all=times, bytes=self.nbytes,
                       num_tensors=len(named))
            rec["sender_extra_bytes"] = None if peak is None else peak - sender_base
            rec["engine_extra_bytes"] = None if epeak is None else epeak - engine_base
        finally:
            native.close()
        return rec

    async def run_engine_rows(self, device: str, rows: list[str], native: str | None) -> None:
        from weightsync.bench.vllm_engine import stop_engine

        llm = self.start(device, native)
        try:
            await self.run_rows(llm, rows, device)
        finally:
            stop_engine(llm)

    async def run_rows(self, llm: Any, rows: list[str], device: str) -> None:
        """Run ``rows`` against the started engine ``llm``; each row's record is appended (and
        the JSON rewritten) as soon as it is measured and checked."""
        for row in rows:
            if row == PER_PARAM and self.ntensors > self.cfg.per_param_max_tensors:
                self.log(f"{row}: skipped ({self.ntensors} tensors)")
                continue
            rec: dict[str, Any] = {"row": row, "engine_device": device}
            try:
                if row in NATIVE or row == LUDIC:
                    rec.update(self.run_reference_row(row, llm))
                elif row in PUSH:
                    rec.update(await self.run_push(row, llm))
                else:
                    rec.update(await self.run_ours(row, llm))
                rec["check"] = self.verify(llm)
                if self.cfg.logprobs_wanted():
                    rec["logprobs"] = self.logprob_check(llm)
            except Exception as e:  # the row fails, the others still run
                rec["error"] = f"{type(e).__name__}: {e}"[:1500]
                self.log(f"{row}: FAILED: {rec['error']}")
            rec["engine_device"] = device
            self.finish_row(rec)
            self.rows.append(rec)
            self.write_json()  # results exist as soon as they are measured

    def finish_row(self, rec: dict[str, Any]) -> None:
        secs = rec.get("seconds")
        check = rec.get("check") or {}
        lp = rec.get("logprobs")
        rec["bit_exact"] = bool(check.get("bit_exact"))
        rec["verified"] = rec["bit_exact"] and (not check.get("num_unreadable") or bool(lp and lp["ok"]))
        if not secs:
            return
        rec["gbps"] = self.nbytes / secs / 1e9
        ref_name = "flat_broadcast" if rec["row"] in REMOTE_ROWS else (
            "device_copy" if self.cfg.on_cuda else "memcpy")
        ref = self.references.get(ref_name, {})
        rec["reference"] = ref_name
        rec["x_reference"] = secs / ref["seconds"] if ref.get("seconds") else None
        if rec.get("kind") == "ours":
            self.log(f"{rec['row']}: {secs * 1e3:.1f} ms, {rec['gbps']:.1f} GB/s, "
                     f"{rec['x_reference'] or 0:.2f}x {ref_name}, verified {rec['verified']}")

    def native_comparison(self) -> None:
        by = {r["row"]: r for r in self.rows if r.get("seconds")}
        pairs = {"push_broadcast": "native_nccl", "broadcast": "native_nccl",
                 "broadcast_ungrouped": "native_nccl", "broadcast_serial": "native_nccl",
                 "broadcast_staged": "native_nccl",
                 "per_param": "native_nccl", "ludic": "native_nccl",
                 "push_cuda_ipc": "native_ipc", "cuda_ipc": "native_ipc",
                 "packed_cuda_ipc": "native_ipc", "cuda_ipc_1chunk": "native_ipc",
                 "cuda_ipc_load_weights": "native_ipc"}
        for row, ref in pairs.items():
            if row in by and ref in by:
                by[row]["x_native"] = by[row]["seconds"] / by[ref]["seconds"]
                by[row]["native"] = ref
        for fast in ("push_broadcast", "broadcast"):  # against the per-tensor ways
            for slow in ("per_param", "ludic"):
                if slow in by and fast in by:
                    by[fast][f"{slow}_speedup"] = by[slow]["seconds"] / by[fast]["seconds"]
        for slow, key in (("broadcast_ungrouped", "grouped_speedup"),  # one NCCL group call
                          ("broadcast_serial", "overlap_speedup")):  # overlapping chunks
            if "broadcast" in by and slow in by:
                by["broadcast"][key] = by[slow]["seconds"] / by["broadcast"]["seconds"]
        for push, inner in (("push_broadcast", "broadcast"), ("push_cuda_ipc", "cuda_ipc")):
            if push in by and inner in by:  # what the front door adds to the path it drives
                by[push]["x_internal"] = by[push]["seconds"] / by[inner]["seconds"]

    def meta(self) -> dict[str, Any]:
        import platform

        import torch

        m: dict[str, Any] = {
            "config": asdict(self.cfg), "bytes": getattr(self, "nbytes", None),
            "tensors": getattr(self, "ntensors", None), "torch": torch.__version__,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with contextlib.suppress(Exception):
            import vllm

            m["vllm"] = vllm.__version__
        if self.cfg.on_cuda:
            m["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return m

    def write_json(self) -> None:
        if self.cfg.json_path:
            with open(self.cfg.json_path, "w") as f:
                json.dump(self.result(), f, indent=2, default=str)

    def result(self) -> dict[str, Any]:
        return {"meta": self.meta(), "references": self.references, "rows": self.rows,
                "stages": self.stages}

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        with contextlib.ExitStack() as stack:
            work = cfg.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ws-bv-"))
            from weightsync.bench.vllm_engine import write_model_dir

            self.model_dir = write_model_dir(cfg.shape, os.path.join(work, "model"), cfg.dtype)
            self.build_trainer_model()
            self.measure_references()
            self.write_json()
            for device, rows, native in self.engine_groups():
                await self.run_engine_rows(device, rows, native)
            self.native_comparison()
            self.write_json()
        return self.result()


def _model_like_scale_(module: Any) -> None:
    """Give the random values a trained model's scale (norm weights near 1, the rest within
    +-0.05, as HF initialises), so that a forward pass is numerically sane in bf16 and the
    logprob check compares meaningful numbers (uniform [-1, 1] weights overflow a 24-layer
    model into chaos). Values stay random and distinct per tensor."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(0.1).add_(1.0)
            else:
                p.mul_(0.05)

