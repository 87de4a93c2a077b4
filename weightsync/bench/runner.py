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
    """The JSON ``backend``: the broadcast backend, or ``cuda_ipc`` / ``shm`` for IPC rows."""
    strategy, _ = strategy_config(name, cfg)
    if strategy["type"] == "broadcast":
        return strategy["backend"]
    return "cuda_ipc" if cfg.device.startswith("cuda") else "shm"


#: what actually carries the bytes of a row, by its ``backend`` (the table's ``transport``)
TRANSPORTS = {"gloo": "gloo broadcast", "nccl": "NCCL broadcast", "cuda_ipc": "CUDA IPC",
              "shm": "shared memory"}


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
    from weightsync.digest import compare_digests, module_digest
    from weightsync.local import LocalEngineProcess

    strategy_cfg, extractor_cfg = strategy_config(name, cfg)
    units = Units.for_bytes(_shape_bytes(cfg))
    backend = backend_label(name, cfg)
    rec: dict[str, Any] = {
        "strategy": name, "backend": backend, "transport": TRANSPORTS[backend],
        "device": cfg.device,
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
                    f"{units.size(stats.total_bytes)} in {units.time(dt)} "
                    f"({units.rate(stats.total_bytes / dt / 1e9)}, {stats.num_chunks} chunks)")
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
            rec["memcpy_gbps"] = probe.gbps(ref_times)  # this row's samples alone
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
    from weightsync.bench.shapes import build_module, shape_specs

    log = _logger(cfg.quiet)
    validate_config(cfg)

    n_tensors = len(shape_specs(cfg.shape))
    nbytes = _shape_bytes(cfg)
    units = Units.for_bytes(nbytes)
    log(f"shape {cfg.shape}: {n_tensors} tensors, {units.size(nbytes)} ({cfg.dtype}) on "
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
                log(f"raw broadcast: {units.rate(raw_bcast)}")
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
        rec["reference_bytes"] = nbytes if on_gpu_bcast else probe.nbytes
        if on_gpu_bcast:
            rec["reference_gbps"] = raw_bcast
        if is_bcast:
            rec["raw_broadcast_gbps"] = raw_bcast
        rec.setdefault("bytes", nbytes)
        rec.setdefault("seconds", None)
        rec.setdefault("gbps", None)
        if rec.get("gbps"):
            log(f"{name}: {units.rate(rec['gbps'])} ({units.time(rec['seconds'])} per sync), "
                f"bit_exact {rec['bit_exact']}")
        records.append(rec)
    # one copy reference for every row: the median of the samples taken before each timed
    # sync of the whole run (a row's own few samples swing with the load of that moment)
    copy_ref = probe.gbps() if probe.samples else None
    log(f"{copy_name} reference: {units.rate(copy_ref)} (median of {len(probe.samples)} "
        f"samples, each the median of several copies)" if copy_ref else
        f"{copy_name} reference: no samples")
    for rec in records:
        rec.setdefault("reference_gbps", copy_ref)
        gbps, ref = rec.get("gbps"), rec["reference_gbps"]
        rec["ratio"] = gbps / ref if gbps and ref and ref == ref else None
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


def _shape_bytes(cfg: BenchConfig) -> int:
    """Bytes of the model of ``cfg.shape`` in ``cfg.dtype``."""
    import torch

    from weightsync.bench.shapes import shape_numel
    from weightsync.types import str_to_dtype

    return shape_numel(cfg.shape) * torch.empty((), dtype=str_to_dtype(cfg.dtype)).element_size()


@dataclass(frozen=True)
class Units:
    """The units that fit a model of a given size, so no figure reads 0.000 (a 214 KB model
    in KB, MB/s and ms; a 1 GB one in GB, GB/s and s). Rates are given in GB/s."""

    size_unit: str
    size_div: float
    rate_unit: str
    rate_mul: float  # from GB/s
    time_unit: str
    time_mul: float  # from seconds

    @classmethod
    def for_bytes(cls, nbytes: float) -> Units:
        if nbytes < 1e6:
            return cls("KB", 1e3, "MB/s", 1e3, "ms", 1e3)
        if nbytes < 1e8:
            return cls("MB", 1e6, "MB/s", 1e3, "ms", 1e3)
        return cls("GB", 1e9, "GB/s", 1.0, "s", 1.0)

    def size(self, nbytes: float) -> str:
        return f"{readable(nbytes / self.size_div)} {self.size_unit}"

    def rate(self, gbps: float | None) -> str:
        return "-" if gbps is None or gbps != gbps else f"{readable(gbps * self.rate_mul)} {self.rate_unit}"

    def time(self, seconds: float) -> str:
        return f"{readable(seconds * self.time_mul)} {self.time_unit}"


def readable(v: float) -> str:
    """3 significant digits without exponents: 81,100 / 214 / 34.9 / 6.14 / 0.00043."""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) >= 1e-4 or v == 0 else f"{v:.1e}"


def _logger(quiet: bool) -> Any:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not quiet:
            print(f"[bench {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


# --------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------

def _columns(u: Units) -> list[tuple[str, str, Any]]:
    """(record key, header, formatter) of the table, in the units ``u``."""
    def num(mul: float = 1.0) -> Any:
        return lambda v: readable(v * mul)

    return [
        ("strategy", "strategy", str), ("transport", "transport", str), ("device", "device", str),
        ("bytes", u.size_unit, num(1 / u.size_div)),
        ("num_tensors", "tensors", str), ("num_chunks", "chunks", str),
        ("seconds", f"{u.time_unit}/sync", num(u.time_mul)),
        ("gbps", u.rate_unit, num(u.rate_mul)),
        ("reference", "reference", str), ("reference_gbps", f"ref {u.rate_unit}",
                                          num(u.rate_mul)),
        ("ratio", "ratio", "{:.2g}".format),
        ("raw_broadcast_gbps", f"raw bcast {u.rate_unit}", num(u.rate_mul)),
        ("first_seconds", f"first {u.time_unit}", num(u.time_mul)),
        ("shared_weights", "shared", str), ("bit_exact", "bit_exact", str),
    ]


#: shown when the records have them (``--integrity``), before ``bit_exact``
_INTEGRITY_COLUMNS = [("checksum_cost", "checksum cost", "{:+.1%}".format),
                      ("staged_cost", "staged cost", "{:+.1%}".format)]

SHM_NOTE = ("on CPU the cuda_ipc and packed_cuda_ipc rows move the tensors through POSIX shared "
            "memory (/dev/shm), not CUDA IPC (that needs a GPU); 'shared': the sender's weights "
            "already live in shared memory (share_cpu_weights), so it sends handles, no copy")


def format_table(records: list[dict[str, Any]]) -> str:
    """The records as a table in units that fit the model's size, then the failed rows' errors,
    a note when IPC rows ran over shared memory, and the verdict (``verdict``)."""
    units = Units.for_bytes(max((r.get("bytes") or 0 for r in records), default=0))
    columns = _columns(units)
    if any("checksum_cost" in r for r in records):
        columns[-1:-1] = _INTEGRITY_COLUMNS
    rows = [[h for _, h, _ in columns]]
    for r in records:
        row = []
        for key, _, fmt in columns:
            v = r.get(key)
            row.append("-" if v is None or v != v else fmt(v))
        if r.get("error"):
            row[-1] = "ERROR"
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    errors = [f"{r['strategy']}: {r['error']}" for r in records if r.get("error")]
    notes = [SHM_NOTE] if any(r.get("backend") == "shm" for r in records) else []
    return "\n".join(lines + ([""] + errors if errors else []) + [""] + notes
                     + [verdict(records)])


def verdict(records: list[dict[str, Any]]) -> str:
    """One line: which strategy moved the model fastest (median per sync), by how much over
    the next best and over the slowest, and which rows failed or were not bit-exact."""
    good = sorted((r for r in records if r.get("seconds") and r.get("bit_exact")
                   and not r.get("error")), key=lambda r: r["seconds"])
    bad = [r["strategy"] for r in records if r not in good]
    failed = f"; failed or not bit-exact: {', '.join(bad)}" if bad else ""
    if not good:
        return "verdict: no strategy completed bit-exact" + failed
    units = Units.for_bytes(good[0].get("bytes") or 0)
    best = good[0]
    line = (f"verdict: {best['strategy']} ({best.get('transport', best.get('backend'))}) is "
            f"fastest, {units.time(best['seconds'])} per sync of {units.size(best['bytes'])}")
    if len(good) > 1:
        line += (f", {good[1]['seconds'] / best['seconds']:.2f}x faster than the next best "
                 f"({good[1]['strategy']}), {good[-1]['seconds'] / best['seconds']:.1f}x faster "
                 f"than the slowest ({good[-1]['strategy']})")
    if best.get("ratio"):
        line += f"; {best['ratio']:.2g}x the {best['reference']} reference"
    return line + (failed or "; every row bit-exact")
