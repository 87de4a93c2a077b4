"""What a ``weightsync.bench.vllm_sync`` run measures: the row names, where each row's engine
runs, and the typed config with its checks (``validate`` raises ``ValueError`` naming the field
and the valid values). No heavy imports; torch only to count GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field

# cuda_ipc_1chunk: cuda_ipc with the whole model in one chunk (handles to the trainer's own CUDA
# tensors cost no buffer, so nothing bounds the chunk: one request instead of one per bucket;
# cuda_ipc coalesces such chunks itself now, so the two rows should agree)
# cuda_ipc_load_weights: cuda_ipc with the loader's copy plan off (vLLM's load_weights for every
# tensor of every sync): what the copy plan saves
# broadcast_ungrouped: broadcast with group_calls off (one NCCL call per tensor, not one group
# call per chunk): what the group call saves; broadcast_serial: with overlap_chunks off (one
# chunk at a time on both sides): what overlapping the chunks saves; broadcast_staged: with
# staged on (the engine keeps the update beside its weights until the finish; vLLM's direct
# mode swaps it in by pointer on an eager engine): what an update that never tears costs
OURS = ("broadcast", "broadcast_ungrouped", "broadcast_serial", "broadcast_staged", "cuda_ipc",
        "packed_cuda_ipc", "cuda_ipc_1chunk", "cuda_ipc_load_weights")
# the headline rows: the path users take, ``ws.connect([llm], strategy).push(model, version=)``
# (NCCL to an engine on the next GPU; CUDA IPC into an engine on the trainer's GPU)
PUSH = ("push_broadcast", "push_cuda_ipc")
PER_PARAM = "per_param"  # ours, one chunk (announce + broadcast + load) per tensor
LUDIC = "ludic"  # the Ludic/TRL protocol: one announce, one broadcast per tensor, barrier
NATIVE = ("native_nccl", "native_ipc", "native_ipc_packed")
ALL_ROWS = (*PUSH, *OURS, PER_PARAM, LUDIC, *NATIVE)
# engine on another GPU (NCCL)
REMOTE_ROWS = ("push_broadcast", "broadcast", "broadcast_ungrouped", "broadcast_serial",
               "broadcast_staged", PER_PARAM, LUDIC, "native_nccl")


@dataclass(kw_only=True)
class VllmBenchConfig:
    shape: str = "qwen2-0.5b"
    device: str = "cuda"  # "cuda" (trainer on cuda:0) or "cpu"
    dtype: str = "bfloat16"
    rows: list[str] = field(default_factory=lambda: list(ALL_ROWS))
    bucket_mb: float = 1024.0
    max_inflight: int | None = None  # None: each strategy's default
    warmup: int = 1
    repeats: int = 4
    cuda_graphs: bool = False
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    check_logprobs: bool | None = None  # None: on for CPU, off for CUDA
    per_param_max_tensors: int = 2000
    timeout_s: float = 300.0
    json_path: str | None = None
    plot_path: str | None = None
    workdir: str | None = None
    quiet: bool = False

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def logprobs_wanted(self) -> bool:
        return (not self.on_cuda) if self.check_logprobs is None else bool(self.check_logprobs)


def validate(cfg: VllmBenchConfig) -> None:
    from weightsync.bench.shapes import DecoderShape, get_shape

    if not isinstance(get_shape(cfg.shape), DecoderShape):
        raise ValueError(f"shape {cfg.shape!r} is not a decoder model; vLLM needs one")
    unknown = [r for r in cfg.rows if r not in ALL_ROWS]
    if unknown or not cfg.rows:
        raise ValueError(f"unknown rows {unknown or '(none)'}; valid: {', '.join(ALL_ROWS)}")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {cfg.device!r}")
    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")
    if cfg.repeats < 1 or cfg.warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {cfg.repeats}, {cfg.warmup}")
    if cfg.bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {cfg.bucket_mb}")
    if cfg.on_cuda:
        import torch

        need = 1 + cfg.tensor_parallel_size if any(r in REMOTE_ROWS for r in cfg.rows) else 1
        have = torch.cuda.device_count()
        if have < max(need, cfg.tensor_parallel_size):
            raise ValueError(
                f"rows {[r for r in cfg.rows if r in REMOTE_ROWS]} need {need} GPUs (trainer on "
                f"GPU 0, engine on the next {cfg.tensor_parallel_size}); torch sees {have}: drop "
                f"them with --rows or run on a machine with more GPUs"
            )
