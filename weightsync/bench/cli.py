"""Command line of ``weightsync bench``: arguments -> ``BenchConfig`` -> ``run_bench`` -> table.

Called by the ``weightsync`` dispatcher (``weightsync.cli``) with the arguments after ``bench``.
Bad values exit 2 with a message naming the flag and listing the valid values.
"""

from __future__ import annotations

import argparse
import sys

from weightsync.bench.runner import (
    DEFAULT_STRATEGIES,
    NAIVE_MAX_TENSORS,
    BenchConfig,
    format_table,
    run_bench,
    validate_config,
)
from weightsync.bench.shapes import shape_names


def build_parser(prog: str = "weightsync bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Move a model of a named shape through each weight-transfer strategy between "
        "two real processes; check bit-exactness; compare with references measured in the same "
        "run. Prints a table (sizes and rates in units that fit the shape), then a one-line "
        "verdict naming the fastest strategy.",
    )
    d = BenchConfig()
    p.add_argument("--shape", default=d.shape,
                   help=f"model shape: {', '.join(shape_names())} (default {d.shape})")
    p.add_argument("--strategy", default="all",
                   help=f"'all' ({', '.join(DEFAULT_STRATEGIES)}; naive skipped above "
                        f"{NAIVE_MAX_TENSORS} tensors) or comma-separated names (any registered "
                        f"strategy, or 'naive') (default all)")
    p.add_argument("--backend", default=None,
                   help="broadcast backend: gloo or nccl (default: gloo on cpu, nccl on cuda)")
    p.add_argument("--device", default=d.device, help=f"cpu or cuda (default {d.device})")
    p.add_argument("--dtype", default=d.dtype,
                   help=f"bfloat16, float32 or float16: the model's dtype (default {d.dtype})")
    p.add_argument("--bucket-mb", type=float, default=d.bucket_mb, metavar="MB",
                   help=f"bucket (chunk) size in MB for extractor and transfer buffers "
                        f"(default {d.bucket_mb:g} MB)")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight, metavar="N",
                   help=f"chunks in flight per sync; 1 = one chunk at a time (default "
                        f"{d.max_inflight})")
    p.add_argument("--repeats", type=int, default=d.repeats, metavar="N",
                   help=f"timed syncs per strategy, after one warm-up; the table shows their "
                        f"median (default {d.repeats})")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, metavar="SECONDS",
                   help=f"per-call timeout (default {d.timeout_s:g} s)")
    p.add_argument("--integrity", action="store_true",
                   help="also time every row with checksum: true, staged: true and both "
                        "(syncs alternate; columns: their cost against the plain syncs) "
                        "(default off)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="also write the records to this JSON file (default: none)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (default: progress lines)")
    return p


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> BenchConfig:
    """argv -> ``BenchConfig``; bad values exit 2 via ``parser.error`` with the valid ones."""
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    everything = ns.strategy.strip() == "all"
    strategies = (
        list(DEFAULT_STRATEGIES) if everything
        else [s.strip() for s in ns.strategy.split(",") if s.strip()]
    )
    cfg = BenchConfig(
        shape=ns.shape, strategies=strategies, backend=ns.backend, device=ns.device,
        dtype=ns.dtype, bucket_mb=ns.bucket_mb, max_inflight=ns.max_inflight,
        repeats=ns.repeats, timeout_s=ns.timeout_s,
        json_path=ns.json_path, quiet=ns.quiet, skip_slow_naive=everything,
        integrity=ns.integrity,
    )
    try:
        validate_config(cfg)
    except ValueError as e:
        parser.error(_argument_hint(str(e)))
    return cfg


def _argument_hint(msg: str) -> str:
    for word, flag in (("shape", "--shape"), ("strategy", "--strategy"),
                       ("backend", "--backend"), ("dtype", "--dtype"), ("device", "--device"),
                       ("repeats", "--repeats"), ("bucket_mb", "--bucket-mb"),
                       ("max_inflight", "--max-inflight")):
        if word in msg.split(" ", 3)[:3] or msg.startswith(word):
            return f"argument {flag}: {msg}"
    return msg


def main(argv: list[str] | None = None) -> int:
    """``weightsync bench ARGS`` -> exit code (0: every row bit-exact and without error)."""
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    records = run_bench(cfg)
    print(format_table(records))
    ok = bool(records) and all(r.get("bit_exact") and not r.get("error") for r in records)
    return 0 if ok else 1
