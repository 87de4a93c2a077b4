"""The ``weightsync`` command: ``bench``, ``demo``, ``serve-reward``.

``bench`` is parsed here and runs ``weightsync.bench``; ``demo`` and ``serve-reward`` hand their
remaining arguments to ``weightsync.demo:main(argv)`` and ``weightsync.reward.server:main(argv)``
(imported only when chosen, so ``weightsync bench --help`` stays fast). Bad arguments exit with
status 2 and a message that names the argument and lists the valid values.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

_SUBCOMMANDS = {
    "demo": ("weightsync.demo", "main", "train -> sync -> score cycle on CPU (the main job)"),
    "serve-reward": (
        "weightsync.reward.server", "main", "serve a reward model on vLLM with weight-sync endpoints"
    ),
}


def build_bench_parser(prog: str = "weightsync bench") -> argparse.ArgumentParser:
    from weightsync.bench import DEFAULT_STRATEGIES, NAIVE_MAX_TENSORS
    from weightsync.bench.shapes import shape_names

    p = argparse.ArgumentParser(
        prog=prog,
        description="Move a model of a named shape through each weight-transfer strategy between "
        "two real processes; check bit-exactness; compare with references measured in the same "
        "run.",
    )
    p.add_argument("--shape", default="qwen2-0.5b",
                   help=f"model shape: {', '.join(shape_names())} (default qwen2-0.5b)")
    p.add_argument("--strategy", default="all",
                   help=f"'all' ({', '.join(DEFAULT_STRATEGIES)}; naive skipped above "
                        f"{NAIVE_MAX_TENSORS} tensors) or comma-separated names (any registered "
                        f"strategy, or 'naive')")
    p.add_argument("--backend", default=None,
                   help="broadcast backend: gloo or nccl (default: gloo on cpu, nccl on cuda)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float32 or float16")
    p.add_argument("--bucket-mb", type=float, default=256.0,
                   help="bucket (chunk) size in MB for extractor and transfer buffers (256)")
    p.add_argument("--max-inflight", type=int, default=2,
                   help="chunks in flight per sync (2; 1 = one chunk at a time)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per strategy (3)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-call timeout (300)")
    p.add_argument("--json", dest="json_path", default=None, help="write records to this path")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_bench_args(argv: list[str], parser: argparse.ArgumentParser | None = None):
    """argv -> ``BenchConfig``; bad values exit 2 via ``parser.error`` with the valid ones."""
    from weightsync.bench import DEFAULT_STRATEGIES, BenchConfig, validate_config

    parser = parser or build_bench_parser()
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


def bench_main(argv: list[str]) -> int:
    from weightsync.bench import format_table, run_bench

    cfg = parse_bench_args(argv)
    records = run_bench(cfg)
    print(format_table(records))
    ok = bool(records) and all(r.get("bit_exact") and not r.get("error") for r in records)
    return 0 if ok else 1


def _delegate(name: str) -> Callable[[list[str]], int | None]:
    module, attr, _ = _SUBCOMMANDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        missing = e.name or ""
        if missing and (module == missing or module.startswith(missing + ".")):
            raise SystemExit(
                f"weightsync {name}: module {module} is missing from this installation "
                f"({e}); reinstall weightsync from a complete checkout"
            ) from None
        raise SystemExit(
            f"weightsync {name}: importing {module} failed: {e}; install the extra it needs: "
            f"pip install 'weightsync[vllm]'"
        ) from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise SystemExit(f"weightsync {name}: {module} has no {attr}(argv) entry point")
    return fn


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="weightsync",
        description="Move freshly trained weights into running inference engines.",
    )
    sub = top.add_subparsers(dest="command", metavar="{bench,demo,serve-reward}")
    sub.add_parser("bench", help="weight-sync bandwidth benchmark", add_help=False)
    for name, (_, _, help_) in _SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        return bench_main(rest)
    if command in _SUBCOMMANDS:
        rc = _delegate(command)(rest)
        return int(rc or 0)
    top.error(
        f"unknown command {command!r}; valid commands: bench, {', '.join(_SUBCOMMANDS)}"
    )
    return 2  # pragma: no cover - error() exits


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
