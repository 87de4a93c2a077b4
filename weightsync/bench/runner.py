"""The ``weightsync bench`` runner: move a model of a named shape through each strategy between two real
processes, check every tensor arrived bit-exact, and compare with references from the same run.

Sender: this process (a module built by ``weightsync.bench.shapes.build_module``, random
values, extracted with the ``hf`` extractor like a trainer would). Receiver: a
``weightsync.local.LocalEngineProcess`` holding a module with the same names and shapes and
different values (a constant). Per strategy: one warm-up sync (reported as ``first_seconds``),
then ``repeats`` timed syncs (the sender negates its weights before each, so every sync moves new
values); ``seconds`` is their median, wall time of ``send_chunks`` (extract, start, every chunk
received and loaded, finish). After the last sync the receiver's state digest must equal the
sender's (``bit_exact``).

References (``weightsync.bench.reference``): on CPU a memcpy of the same bytes; on CUDA a raw
device copy (IPC strategies) or a raw broadcast of one flat buffer (``broadcast``). The copy is
timed right before every timed sync and its median is the row's reference, so a busy machine
slows both alike. Broadcast rows also report the raw broadcast of one flat buffer over the same
backend (``raw_broadcast_gbps``, measured once).

Shared weights (CPU IPC rows): a trainer that calls
``weightsync.strategies.share_cpu_weights(model)`` once keeps its weights in shared memory, and the
IPC strategies then send handles to the weights themselves (zero copies on the sender, one on the
engine). The ``cuda_ipc`` / ``packed_cuda_ipc`` rows on CPU do that (``BenchConfig.share_weights``,
default on; column ``shared``, with ``shared_tensors`` in the JSON: how many tensors of the last
sync went without a sender copy); the ``cuda_ipc(copy)`` / ``packed_cuda_ipc(copy)`` rows send the
same model unshared (the sender copies into transfer buffers), as before. On CUDA the weights are
shared by CUDA IPC anyway and ``all`` skips the ``(copy)`` rows.

Integrity options (``BenchConfig.integrity``, ``--integrity``): every row's syncs alternate, in
the same process pair and the same rounds, between the plain update and the same update with
``checksum: true`` (the sender checksums every tensor, every engine verifies what it received),
``staged: true`` (engines receive into staging buffers and copy at finish) and both. The sender
reads both fields from its config per update, so the variants toggle them between syncs.
``seconds`` stays the plain syncs' median; ``integrity`` holds each variant's median and its
cost against plain (``checksum_cost`` / ``staged_cost`` in the table: 0.02 = 2% longer).

``naive`` is the per-tensor way many RL stacks start with: broadcast, one request and one
broadcast per tensor, no bucketing, no packing.

Progress goes to stderr; the table to stdout; ``--json PATH`` writes the records. The command
line (arguments -> ``BenchConfig``) is ``weightsync.bench.cli``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

NAIVE = "naive"
COPY_SUFFIX = "(copy)"  # an IPC row whose sender copies (weights not in shared memory)
IPC_STRATEGIES = ("cuda_ipc", "packed_cuda_ipc")
DEFAULT_STRATEGIES = [
    "broadcast", "cuda_ipc", f"cuda_ipc{COPY_SUFFIX}", "packed_cuda_ipc",
    f"packed_cuda_ipc{COPY_SUFFIX}", NAIVE,
]
NAIVE_MAX_TENSORS = 1000  # above this the per-tensor row takes minutes (many-small: ~30 s/sync)
PLAIN = "plain"
#: ``--integrity`` variants: name -> the strategy config fields a sync sets
INTEGRITY_VARIANTS = {
    PLAIN: {"checksum": False, "staged": False},
    "checksum": {"checksum": True, "staged": False},
    "staged": {"checksum": False, "staged": True},
    "checksum+staged": {"checksum": True, "staged": True},
}


@dataclass(kw_only=True)
class BenchConfig:
    shape: str = "qwen2-0.5b"
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    backend: str | None = None  # broadcast backend; default gloo on CPU, nccl on CUDA
    device: str = "cpu"
    dtype: str = "bfloat16"
    bucket_mb: float = 256.0
    max_inflight: int = 2  # chunks in flight per sync (strategy max_inflight_chunks)
    repeats: int = 3
    timeout_s: float = 300.0
    json_path: str | None = None
    quiet: bool = False
    # skip the naive row on shapes with more than NAIVE_MAX_TENSORS tensors (one request per
    # tensor takes minutes there); the CLI clears it when naive is asked for by name
    skip_slow_naive: bool = True
    # CPU IPC rows (without the "(copy)" suffix) send a model whose weights were moved into
    # shared memory once (``share_cpu_weights``); False: every row copies
    share_weights: bool = True
    # time every row's syncs also with checksum: true, staged: true and both (alternating)
    integrity: bool = False

    def resolved_backend(self) -> str:
        from weightsync.config import broadcast_backend

        return self.backend or broadcast_backend(self.device)


# --------------------------------------------------------------------------------------------
# one strategy
# --------------------------------------------------------------------------------------------


def strategy_config(name: str, cfg: BenchConfig) -> tuple[dict, dict]:
    """(strategy cfg, extractor cfg) for a bench row."""
    name = name.removesuffix(COPY_SUFFIX)
    common = {"bucket_size_mb": cfg.bucket_mb, "timeout_s": cfg.timeout_s,
              "max_inflight_chunks": cfg.max_inflight}
    extractor: dict[str, Any] = {"type": "hf", "bucket_size_mb": cfg.bucket_mb}
    if name == NAIVE:  # one request per tensor, one at a time
        strategy = {"type": "broadcast", "backend": cfg.resolved_backend(), "packed": False,
                    **common, "max_inflight_chunks": 1}
        extractor.update(bucket_size_mb=0, group_by_module=False)
    elif name == "broadcast":
        strategy = {"type": "broadcast", "backend": cfg.resolved_backend(), **common}
    else:
        strategy = {"type": name, **common}
    return strategy, extractor


def uses_shared_weights(name: str, cfg: BenchConfig) -> bool:
    """Whether row ``name`` sends from shared weights (CPU IPC rows, unless ``(copy)``)."""
    return cfg.share_weights and cfg.device == "cpu" and name in IPC_STRATEGIES


def backend_label(name: str, cfg: BenchConfig) -> str:
    strategy, _ = strategy_config(name, cfg)
    if strategy["type"] == "broadcast":
        return strategy["backend"]
    return "cuda_ipc" if cfg.device.startswith("cuda") else "shm"


def receiver_placement(name: str, cfg: BenchConfig) -> tuple[str, dict[str, str]]:
    """(device for the receiver's module, extra env for its process).

    IPC rows share the sender's device (the colocated case). NCCL cannot put two ranks on one
    GPU, so a broadcast receiver runs on the next GPU, made its only visible device (the
    strategy joins NCCL on the current device)."""
    if not cfg.device.startswith("cuda"):
        return cfg.device, {}
    strategy, _ = strategy_config(name, cfg)
    if strategy["type"] == "broadcast" and strategy.get("backend") == "nccl":
        import os

        import torch

        if torch.cuda.device_count() < 2:
            raise RuntimeError("broadcast over nccl needs 2 GPUs (NCCL refuses two ranks on one)")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",")] if visible else ["0", "1"]
        return "cuda", {"CUDA_VISIBLE_DEVICES": ids[1]}
    return cfg.device, {}


async def bench_strategy(
    name: str, module: Any, cfg: BenchConfig, log: Any, probe: Any = None
) -> dict[str, Any]:
    """Run one row; returns its record (``error`` set and ``bit_exact`` False on failure).

    ``probe`` (a ``MemcpyProbe``) is timed right before each timed sync; its median lands in
    ``memcpy_gbps``."""
    import torch

    from weightsync.clients import FanOutClient
    from weightsync.config import build_extractor, build_strategy
    from weightsync.local import LocalEngineProcess
    from weightsync.testing.digest import compare_digests, module_digest

    strategy_cfg, extractor_cfg = strategy_config(name, cfg)
    rec: dict[str, Any] = {
        "strategy": name, "backend": backend_label(name, cfg), "device": cfg.device,
        "shape": cfg.shape, "dtype": cfg.dtype, "bucket_mb": cfg.bucket_mb,
        "max_inflight": strategy_cfg["max_inflight_chunks"],
        "shared_weights": uses_shared_weights(name, cfg), "bit_exact": False, "error": None,
    }
    engine = client = sender = None
    try:
        log(f"{name}: starting receiver process")
        device, env = receiver_placement(name, cfg)
        engine = await asyncio.to_thread(
            LocalEngineProcess.spawn, "weightsync.bench.shapes:build_module",
            {"shape": cfg.shape, "dtype": cfg.dtype, "device": device, "fill": 0.0},
            name=f"bench-{name}", env=env or None,
        )
        client = FanOutClient([engine], timeout_s=cfg.timeout_s)
        strategy = build_strategy(strategy_cfg)
        extractor = build_extractor(extractor_cfg)
        sync_info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, sync_info)
        manifest = extractor.metadata(module)
        variants = list(INTEGRITY_VARIANTS) if cfg.integrity else [PLAIN]
        times: dict[str, list[float]] = {v: [] for v in variants}
        ref_times: list[float] = []
        version = 0
        for i in range(cfg.repeats + 1):
            for variant in variants:  # alternating: a busy moment slows every variant alike
                for key, value in INTEGRITY_VARIANTS[variant].items():
                    setattr(sender.cfg, key, value)  # read per update by the sender
                _negate_(module)  # every sync moves values the receiver does not hold yet
                if probe is not None and i > 0 and variant == PLAIN:
                    ref_times.append(probe.once())
                version += 1
                t0 = time.perf_counter()
                stats = await sender.send_chunks(
                    extractor.extract_weights(module), client, version=version,
                    manifest=manifest,
                )
                dt = time.perf_counter() - t0
                if i == 0 and variant == PLAIN:
                    rec["first_seconds"] = dt
                elif i > 0:
                    times[variant].append(dt)
                label = "" if variant == PLAIN else f" [{variant}]"
                log(f"{name}: sync {i + 1}/{cfg.repeats + 1}{label}"
                    f"{' (warm-up)' if i == 0 else ''} "
                    f"{stats.total_bytes / 1e9:.3f} GB in {dt:.3f} s "
                    f"({stats.total_bytes / dt / 1e9:.2f} GB/s, {stats.num_chunks} chunks)")
        plain = statistics.median(times[PLAIN])
        rec.update(
            bytes=stats.total_bytes, num_tensors=stats.num_tensors, num_chunks=stats.num_chunks,
            seconds=plain, seconds_all=times[PLAIN], gbps=stats.total_bytes / plain / 1e9,
            version=stats.versions[0] if stats.versions else None,
        )
        if cfg.integrity:
            rec["integrity"] = {
                v: {"seconds": statistics.median(t), "seconds_all": t,
                    "cost": statistics.median(t) / plain - 1.0}
                for v, t in times.items()
            }
            rec["checksum_cost"] = rec["integrity"]["checksum"]["cost"]
            rec["staged_cost"] = rec["integrity"]["staged"]["cost"]
        if hasattr(sender, "shared_tensors"):  # IPC senders count tensors sent without a copy
            rec["shared_tensors"] = sender.shared_tensors // version
        if probe is not None:
            rec["memcpy_gbps"] = probe.gbps(ref_times)
        log(f"{name}: checking digests")
        if cfg.device.startswith("cuda"):
            torch.cuda.synchronize()
        received, sent = await asyncio.gather(
            engine.call("state_digest"), asyncio.to_thread(module_digest, module)
        )
        bad = compare_digests(sent, received)
        rec["bit_exact"] = not bad
        rec["mismatched"] = bad[:10]
        if bad:
            log(f"{name}: {len(bad)} tensors differ, e.g. {bad[:3]}")
    except Exception as e:  # a failed row is reported, the others still run
        rec["error"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"{name}: FAILED: {rec['error']}")
    finally:
        if sender is not None:
            await _quietly(sender.close())
        if client is not None:
            await _quietly(client.close_weight_transfer())
        if engine is not None:
            await _quietly(asyncio.to_thread(engine.stop))
    return rec


def _negate_(module: Any) -> None:
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.neg_()


async def _quietly(aw: Any) -> None:
    try:
        await asyncio.wait_for(aw, 30)
    except Exception:
        pass


# --------------------------------------------------------------------------------------------
# the whole run
# --------------------------------------------------------------------------------------------


async def run_bench_async(cfg: BenchConfig) -> list[dict[str, Any]]:
    from weightsync.bench.reference import MemcpyProbe, raw_broadcast_gbps
    from weightsync.bench.shapes import build_module, shape_numel, shape_specs

    log = _logger(cfg.quiet)
    validate_config(cfg)
    import torch

    n_tensors = len(shape_specs(cfg.shape))
    nbytes = shape_numel(cfg.shape) * torch.empty((), dtype=_dtype(cfg.dtype)).element_size()
    log(f"shape {cfg.shape}: {n_tensors} tensors, {nbytes / 1e9:.3f} GB ({cfg.dtype}) on "
        f"{cfg.device}; bucket {cfg.bucket_mb:g} MB; {cfg.repeats} repeats")
    log("building sender model")
    module = build_module(shape=cfg.shape, dtype=cfg.dtype, seed=0, device=cfg.device)

    copy_name = "device copy" if cfg.device.startswith("cuda") else "memcpy"
    log(f"allocating the {copy_name} reference (timed before every timed sync)")
    probe = MemcpyProbe(nbytes, cfg.device)
    raw_bcast: float | None = None

    shared_module = shared = None
    records = []
    for name in cfg.strategies:
        if name.endswith(COPY_SUFFIX) and cfg.device.startswith("cuda"):
            log(f"{name}: skipped (on CUDA the IPC rows share the weights by CUDA IPC)")
            continue
        if name == NAIVE and cfg.skip_slow_naive and n_tensors > NAIVE_MAX_TENSORS:
            log(f"{name}: skipped ({n_tensors} tensors > {NAIVE_MAX_TENSORS}; ask for "
                f"--strategy naive to run it)")
            continue
        strategy_cfg, _ = strategy_config(name, cfg)
        is_bcast = strategy_cfg["type"] == "broadcast"
        if is_bcast and raw_bcast is None:
            log(f"measuring raw {cfg.resolved_backend()} broadcast reference")
            try:
                receiver_placement(name, cfg)  # raises if this backend cannot run here
                peer = "cuda:1" if cfg.resolved_backend() == "nccl" else cfg.device
                raw_bcast = raw_broadcast_gbps(
                    nbytes, cfg.resolved_backend(), cfg.device, cfg.repeats,
                    peer_device=peer, timeout_s=min(cfg.timeout_s, 120.0),
                )
                log(f"raw broadcast: {raw_bcast:.2f} GB/s")
            except Exception as e:
                log(f"raw broadcast reference failed: {type(e).__name__}: {e}")
                raw_bcast = float("nan")
        source = module
        if uses_shared_weights(name, cfg):
            if shared_module is None:
                from weightsync.strategies import share_cpu_weights

                log("building a second sender model with its weights in shared memory")
                shared_module = build_module(shape=cfg.shape, dtype=cfg.dtype, seed=0,
                                             device=cfg.device)
                shared = share_cpu_weights(shared_module)
                log(f"shared: {shared}")
            source = shared_module
        rec = await bench_strategy(name, source, cfg, log, probe)
        on_gpu_bcast = is_bcast and cfg.device.startswith("cuda")
        rec["reference"] = f"raw {cfg.resolved_backend()} broadcast" if on_gpu_bcast else copy_name
        rec["reference_gbps"] = raw_bcast if on_gpu_bcast else rec.get("memcpy_gbps")
        rec["reference_bytes"] = nbytes if on_gpu_bcast else probe.nbytes
        if is_bcast:
            rec["raw_broadcast_gbps"] = raw_bcast
        gbps, ref = rec.get("gbps"), rec["reference_gbps"]
        rec["ratio"] = gbps / ref if gbps and ref and ref == ref else None
        rec.setdefault("bytes", nbytes)
        rec.setdefault("seconds", None)
        rec.setdefault("gbps", None)
        if rec.get("gbps"):
            log(f"{name}: {rec['gbps']:.2f} GB/s, {copy_name} {rec.get('memcpy_gbps', 0):.2f} "
                f"GB/s, ratio {rec['ratio']:.2f}, bit_exact {rec['bit_exact']}")
        records.append(rec)
    probe.close()
    if shared is not None:
        shared.close()
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(records, f, indent=2)
        log(f"wrote {cfg.json_path}")
    return records


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    return asyncio.run(run_bench_async(cfg))


def validate_config(cfg: BenchConfig) -> None:
    """Raise ``ValueError`` naming the bad field and the valid values."""
    from weightsync.bench.shapes import get_shape

    get_shape(cfg.shape)
    valid = valid_strategy_names()
    copies = copy_row_names()
    unknown = [s for s in cfg.strategies if s not in valid and s not in copies]
    if unknown or not cfg.strategies:
        raise ValueError(
            f"unknown strategy {', '.join(unknown) or '(none)'}; valid: all, {', '.join(valid)} "
            f"(and {', '.join(copies)}: the IPC rows with the sender copying, weights not shared)"
        )
    if cfg.backend not in (None, "gloo", "nccl"):
        raise ValueError(f"unknown backend {cfg.backend!r}; valid: gloo, nccl")
    if cfg.dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"unsupported dtype {cfg.dtype!r}; valid: bfloat16, float32, float16")
    if not isinstance(cfg.share_weights, bool):
        raise ValueError(f"share_weights must be True or False, got {cfg.share_weights!r}")
    if not (cfg.device == "cpu" or cfg.device.startswith("cuda")):
        raise ValueError(f"unknown device {cfg.device!r}; valid: cpu, cuda")
    if cfg.backend == "nccl" and not cfg.device.startswith("cuda"):
        raise ValueError("backend nccl moves CUDA tensors: use it with --device cuda (or gloo)")
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA device")
    if cfg.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {cfg.repeats}")
    if cfg.bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {cfg.bucket_mb}")
    if cfg.max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {cfg.max_inflight}")


def valid_strategy_names() -> list[str]:
    from weightsync.registry import RECEIVER_ONLY_STRATEGIES, STRATEGIES

    return [*(n for n in STRATEGIES.names() if n not in RECEIVER_ONLY_STRATEGIES), NAIVE]


def copy_row_names() -> list[str]:
    """The IPC rows whose sender copies (weights not shared), also valid ``--strategy`` names."""
    from weightsync.registry import STRATEGIES

    return [f"{n}{COPY_SUFFIX}" for n in IPC_STRATEGIES if n in STRATEGIES.names()]


def _dtype(name: str) -> Any:
    from weightsync.types import str_to_dtype

    return str_to_dtype(name)


def _logger(quiet: bool) -> Any:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not quiet:
            print(f"[bench {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


# --------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------

_COLUMNS = [
    ("strategy", "strategy", "{}"), ("backend", "backend", "{}"), ("device", "device", "{}"),
    ("bytes", "bytes", "{:,}"), ("num_tensors", "tensors", "{}"), ("num_chunks", "chunks", "{}"),
    ("seconds", "seconds", "{:.3f}"), ("gbps", "GB/s", "{:.2f}"),
    ("reference", "reference", "{}"), ("reference_gbps", "ref GB/s", "{:.2f}"),
    ("ratio", "ratio", "{:.2f}"), ("raw_broadcast_gbps", "raw bcast GB/s", "{:.2f}"),
    ("first_seconds", "first s", "{:.3f}"), ("shared_weights", "shared", "{}"),
    ("bit_exact", "bit_exact", "{}"),
]
#: shown when the records have them (``--integrity``), before ``bit_exact``
_INTEGRITY_COLUMNS = [("checksum_cost", "checksum cost", "{:+.1%}"),
                      ("staged_cost", "staged cost", "{:+.1%}")]


def format_table(records: list[dict[str, Any]]) -> str:
    columns = list(_COLUMNS)
    if any("checksum_cost" in r for r in records):
        columns[-1:-1] = _INTEGRITY_COLUMNS
    rows = [[h for _, h, _ in columns]]
    for r in records:
        row = []
        for key, _, fmt in columns:
            v = r.get(key)
            row.append("-" if v is None or v != v else fmt.format(v))
        if r.get("error"):
            row[-1] = "ERROR"
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    errors = [f"{r['strategy']}: {r['error']}" for r in records if r.get("error")]
    return "\n".join(lines + ([""] + errors if errors else []))
