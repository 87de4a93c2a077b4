"""The vLLM side of ``weightsync.bench.vllm_sync``: a config-only model directory, an in-process
``LLM`` on a chosen device with dummy weights, and a worker extension with the probes the
benchmark reads (checksums, memory, stage timers).

* ``write_model_dir(shape, path, dtype)``: ``config.json`` of a Qwen2-style generative model of a
  named shape (``weightsync.bench.shapes``) and nothing else. The engine starts with
  ``load_format="dummy"`` (random weights, no checkpoint); our loader then derives the names and
  shapes it accepts from the config (``weightsync._runtime.vllm_compat.config_metadata``).
* ``start_engine(spec)``: ``LLM(...)`` with ``BenchWorkerExtension`` on ``spec.device``. On CUDA
  the engine's process is started with ``CUDA_VISIBLE_DEVICES`` naming only that GPU (and the
  next ones for tensor parallelism), so a trainer on GPU 0 can own an engine on GPU 1 (the NCCL
  rows) or share GPU 0 with it (the IPC rows); its memory share is the one asked for, capped to
  what is free (``fit_memory_utilization``). ``spec.native_backend`` turns on vLLM's own
  weight-transfer engine (``weight_transfer_config``) in the same engine.
* ``BenchWorkerExtension`` (runs in every vLLM worker): our ``WeightSyncWorkerExtension`` plus
  ``bench_checksums`` (bit-exact check on the device, see ``weightsync.bench.checksum``),
  ``bench_memory`` (``torch.cuda`` allocated / peak bytes, peak reset on request),
  ``bench_probe`` (per-stage times of our endpoint: start, each chunk, ``load_weights``, finish,
  each bracketed by a device synchronisation; only for the one profiled sync, never for timed
  ones) and ``bench_noop`` (the cost of one ``collective_rpc`` round trip).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from weightsync._runtime import vllm_compat as compat
from weightsync.loaders.vllm_worker import WeightSyncWorkerExtension

BENCH_EXTENSION = "weightsync.bench.vllm_engine.BenchWorkerExtension"


# --------------------------------------------------------------------------------------------
# model directory
# --------------------------------------------------------------------------------------------


def write_model_dir(shape: str, path: str, dtype: str = "bfloat16", max_positions: int = 4096) -> str:
    """Write ``config.json`` of a ``Qwen2ForCausalLM`` of the named decoder shape into ``path``."""
    from weightsync.bench.shapes import DecoderShape, get_shape

    s = get_shape(shape)
    if not isinstance(s, DecoderShape):
        raise ValueError(f"shape {shape!r} is not a decoder; vLLM needs a model architecture")
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "vocab_size": s.vocab,
        "tie_word_embeddings": s.tie_embeddings, "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False,
    }
    if not s.qkv_bias:
        raise ValueError(f"shape {shape!r} has no q/k/v bias; Qwen2 needs it (use a qwen2-* shape)")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


# --------------------------------------------------------------------------------------------
# engine start
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EngineSpec:
    model_dir: str
    device: str = "cpu"  # "cpu" or "cuda:N" (N as this process sees it)
    dtype: str = "bfloat16"
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 512
    cpu_kv_cache_bytes: int = 64 << 20
    native_backend: str | None = None  # "nccl" / "ipc": vLLM's own weight-transfer engine
    extension: str = BENCH_EXTENSION
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # more ``LLM(...)`` arguments


def physical_gpu_ids(first: int, count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``count`` GPUs starting at this process's index ``first``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    chosen = []
    for i in range(first, first + count):
        if ids is None:
            chosen.append(str(i))
        elif i < len(ids):
            chosen.append(ids[i])
        else:
            raise ValueError(f"GPU {i} is not visible (CUDA_VISIBLE_DEVICES={visible})")
    return ",".join(chosen)


@contextlib.contextmanager
def scoped_env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, remove) environment variables for the ``with`` block only: what an
    engine's processes inherit when they are started inside it."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fit_memory_utilization(device_index: int, wanted: float, *, reserve_bytes: int = 1 << 30,
                           floor: float = 0.05) -> float:
    """``wanted`` (vLLM's ``gpu_memory_utilization``: a fraction of the whole card) capped to what
    is free on GPU ``device_index`` now, less ``reserve_bytes``: vLLM refuses to start when the
    fraction asks for more than is free, which is the case next to a trainer (a 7B trainer's 15
    GB and the earlier rows' buffers leave ~21 GB of an 80 GB card, under 0.3 of it)."""
    import torch

    free, total = torch.cuda.mem_get_info(device_index)
    fits = (free - reserve_bytes) / total
    return round(max(min(float(wanted), fits), floor), 3)


def start_engine(spec: EngineSpec) -> Any:
    """An in-process ``LLM`` (its engine core and workers are child processes)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec.model_dir, load_format="dummy", dtype=spec.dtype, skip_tokenizer_init=True,
        max_model_len=spec.max_model_len, enforce_eager=spec.enforce_eager,
        worker_extension_cls=spec.extension, seed=spec.seed,
        tensor_parallel_size=spec.tensor_parallel_size,
    )
    kwargs.update(spec.engine_args)
    if spec.native_backend:
        kwargs["weight_transfer_config"] = {"backend": spec.native_backend}
    env: dict[str, str | None] = {}
    if spec.device.startswith("cuda"):
        import torch

        first = torch.device(spec.device).index or 0
        env["CUDA_VISIBLE_DEVICES"] = physical_gpu_ids(first, spec.tensor_parallel_size)
        kwargs["gpu_memory_utilization"] = min(
            fit_memory_utilization(first + i, spec.gpu_memory_utilization)
            for i in range(spec.tensor_parallel_size))
        if torch.cuda.is_initialized():
            env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        kwargs["kv_cache_memory_bytes"] = spec.cpu_kv_cache_bytes
    with scoped_env(**env):
        return LLM(**kwargs)


def stop_engine(llm: Any) -> None:
    with contextlib.suppress(Exception):
        compat.shutdown_llm(llm)


def rpc_one(llm: Any, method: str, *args: Any) -> Any:
    """``collective_rpc`` answered by worker 0."""
    return llm.collective_rpc(method, args=args)[0]


# --------------------------------------------------------------------------------------------
# worker extension with probes
# --------------------------------------------------------------------------------------------


_STAGES = ("start_s", "chunk_s", "load_s", "finish_s")


class BenchWorkerExtension(WeightSyncWorkerExtension):
    """``WeightSyncWorkerExtension`` plus the benchmark's probes (JSON-safe answers)."""

    _bench_times: dict[str, float] | None = None
    _bench_wrapped: bool = False

    def bench_noop(self) -> int:
        return 0

    def bench_receiver_attr(self, name: str) -> Any:
        """An attribute of this worker's receiver (e.g. ``last_replica``: which training rank's
        copy an every_rank IPC receiver read last); None without a receiver."""
        receiver = self._ws().receiver
        return None if receiver is None else getattr(receiver, name, None)

    def bench_packed_mapping(self) -> dict[str, list[str]]:
        return compat.packed_modules_mapping(self)

    def bench_tp(self) -> list[int]:
        rank, size = compat.worker_rank_and_size(self)
        return [rank, size]

    def bench_checksums(self, expected_by_rank: list[dict[str, list[int]]]) -> dict[str, Any]:
        """Checksums of this worker's parameters named in ``expected_by_rank[tp rank]`` (narrowed
        to the given shapes: vLLM pads vocabularies). ``unreadable``: parameters whose shape
        cannot hold the expected one (vLLM on CPU repacks linear weights for oneDNN to shape
        [0]); ``extra``: parameters nobody expected."""
        import torch

        from weightsync.bench.checksum import tensor_checksums

        expected = expected_by_rank[compat.worker_rank_and_size(self)[0]]
        params = dict(compat.get_model(self).named_parameters())
        missing, unreadable, take = [], [], []
        for name, shape in expected.items():
            p = params.get(name)
            if p is None:
                missing.append(name)
                continue
            if p.dim() != len(shape) or any(p.shape[d] < shape[d] for d in range(len(shape))):
                unreadable.append(f"{name}: engine shape {list(p.shape)}, expected {shape}")
                continue
            v = p.detach()
            for d, n in enumerate(shape):
                v = v.narrow(d, 0, n)
            take.append((name, v))
        with torch.no_grad():
            sums = tensor_checksums(take)
        return {
            "checksums": {k: str(v) for k, v in sums.items()},  # str: msgpack-safe int64
            "missing": missing, "unreadable": unreadable,
            "extra": sorted(n for n in params if n not in expected),
        }

    def bench_memory(self, reset: bool = False) -> dict[str, int] | None:
        if compat.worker_device(self) != "cuda":
            return None
        import torch

        torch.cuda.synchronize()
        out = {
            "allocated": int(torch.cuda.memory_allocated()),
            "peak": int(torch.cuda.max_memory_allocated()),
            "reserved": int(torch.cuda.memory_reserved()),
        }
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return out

    def bench_probe(self, enable: bool) -> dict[str, float]:
        """Return the stage times collected since the last call and reset them; ``enable``
        wraps (True) or unwraps (False) the endpoint's methods with synchronised timers."""
        endpoint = self._ws()
        report = dict(self._bench_times or {})
        self._bench_times = dict.fromkeys((*_STAGES, "chunks"), 0.0)
        if enable and not self._bench_wrapped:
            for method, key in (("start_weight_update", "start_s"),
                                ("update_named_weights", "chunk_s"),
                                ("finish_weight_update", "finish_s")):
                setattr(endpoint, method, self._bench_timed(getattr(endpoint, method), key))
            endpoint.loader.load_weights = self._bench_timed(endpoint.loader.load_weights, "load_s")
            self._bench_wrapped = True
        elif not enable and self._bench_wrapped:
            for method in ("start_weight_update", "update_named_weights", "finish_weight_update"):
                endpoint.__dict__.pop(method, None)
            endpoint.loader.__dict__.pop("load_weights", None)
            self._bench_wrapped = False
        return report

    def _bench_timed(self, fn: Any, key: str) -> Any:
        device = compat.worker_device(self)

        def sync() -> None:
            if device == "cuda":
                import torch

                torch.cuda.synchronize()

        async def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                sync()
                times = self._bench_times
                if times is not None:
                    times[key] = times.get(key, 0.0) + time.perf_counter() - t0
                    if key == "chunk_s":
                        times["chunks"] = times.get("chunks", 0.0) + 1
        return timed
