"""Weight sync into a real vLLM engine: ours per strategy against the transport ceiling and
vLLM's own weight-transfer engine, in one run, one table.

    python benchmarks/bench_vllm_sync.py --shape qwen2-7b --json out.json --plot out.png
    python -m weightsync.bench.vllm_sync --device cpu --shape tiny --dtype float32

The trainer is this process: a module of the named shape (``weightsync.bench.shapes``, random
values, HF names) on ``cuda:0`` (or the CPU). The engine is an in-process ``vllm.LLM`` with dummy
weights of the same shape (``weightsync.bench.vllm_engine``), TP=1 by default, eager unless
``--cuda-graphs``. Placement on CUDA: the NCCL rows (``broadcast``, ``per_param``, ``ludic``,
``native_nccl``) go to an engine on the next GPU(s); the IPC rows (``cuda_ipc``,
``packed_cuda_ipc``, ``native_ipc``, ``native_ipc_packed``) to an engine on the trainer's GPU
(colocated). On the CPU one engine takes every row (gloo broadcast, shared-memory IPC); vLLM's
own engine exists only on GPU, so its rows are skipped there.

Rows (``--rows``):

* ours, end to end (extract -> transfer -> ``load_weights`` in vLLM -> version published), through
  ``FanOutClient`` + ``build_strategy`` + ``send_chunks``: ``broadcast``, ``cuda_ipc``,
  ``packed_cuda_ipc``, ``cuda_ipc_1chunk`` (``cuda_ipc`` with the whole model in one chunk:
  its handles point at the trainer's own tensors, so no buffer bounds the chunk) and
  ``cuda_ipc_load_weights`` (``cuda_ipc`` with the loader's copy plan off);
* ``per_param``: ours made per-parameter (one announce, one broadcast and one ``load_weights``
  per tensor), through the same client with one chunk per tensor and no packing;
* ``ludic``: the Ludic / TRL client's protocol (``weightsync.bench.ludic``): one announce of the
  whole batch, one broadcast per tensor from the trainer, a barrier, into our
  ``ludic_broadcast`` receivers in the same engine (control calls in process, not HTTP);
* ``native_nccl`` / ``native_ipc`` / ``native_ipc_packed``: vLLM's own engine through its own
  API (``weightsync.bench.native``), into the same engine;
* references measured in the same run: ``flat_broadcast`` (one broadcast of all bytes as one
  flat buffer to a spawned peer, NCCL GPU 0 -> GPU 1, gloo on CPU) and ``device_copy`` (one copy
  of all bytes on the trainer's device).

Every row: ``--warmup`` syncs, then ``--repeats`` timed ones (each moves new values: the trainer
negates its weights first); ``seconds`` is their median. Then, for ours, one more *profiled*
sync split by stage (extract, pack, sender data plane, start / chunk / finish round trips or the
one ``apply_update`` call, and in the engine worker: start, chunk handling, ``load_weights`` or
the copy plan, finish), every stage bracketed by device
synchronisations, so its total is a little slower than the median. After each row every engine
parameter is compared with what the trainer holds by on-device checksums
(``weightsync.bench.checksum``); on CPU, where vLLM repacks linear weights and they cannot be
read back, the logprobs of a few prompts are compared with transformers too (``--check-logprobs``).
Peak extra memory: ``torch.cuda.max_memory_allocated`` over the timed syncs minus what was
allocated before, in this process and in the engine worker.

``--json PATH`` writes ``{meta, rows, stages, references}``; ``--plot PATH`` a PNG (needs
matplotlib, optional). The table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from weightsync.bench.vllm_config import ALL_ROWS, VllmBenchConfig, validate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_vllm_sync",
        description="Weight sync into a real vLLM engine: ours per strategy, vLLM's own engine "
                    "and the transport ceiling, measured in one run.",
    )
    p.add_argument("--shape", default="qwen2-0.5b", help="tiny, qwen2-0.5b, qwen2-1.5b, qwen2-7b")
    p.add_argument("--device", default="cuda", help="cuda (trainer on GPU 0) or cpu")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32")
    p.add_argument("--rows", default="all",
                   help=f"'all' or comma-separated: {', '.join(ALL_ROWS)}")
    p.add_argument("--bucket-mb", type=float, default=1024.0, help="bucket size (1024)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="chunks in flight (default: each strategy's own)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=4, help="timed syncs per row (4)")
    p.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (not eager)")
    p.add_argument("--tp", type=int, default=1, help="engine tensor parallel size (1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--check-logprobs", action=argparse.BooleanOptionalAction, default=None,
                   help="compare prompt logprobs with transformers (default: on for cpu)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", dest="plot_path", default=None, help="PNG (needs matplotlib)")
    p.add_argument("--workdir", default=None, help="keep the model directory here")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv: list[str]) -> VllmBenchConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    rows = list(ALL_ROWS) if ns.rows.strip() == "all" else [
        r.strip() for r in ns.rows.split(",") if r.strip()]
    cfg = VllmBenchConfig(
        shape=ns.shape, device=ns.device, dtype=ns.dtype, rows=rows, bucket_mb=ns.bucket_mb,
        max_inflight=ns.max_inflight, warmup=ns.warmup, repeats=ns.repeats,
        cuda_graphs=ns.cuda_graphs, tensor_parallel_size=ns.tp,
        gpu_memory_utilization=ns.gpu_memory_utilization, check_logprobs=ns.check_logprobs,
        timeout_s=ns.timeout_s, json_path=ns.json_path, plot_path=ns.plot_path,
        workdir=ns.workdir, quiet=ns.quiet,
    )
    try:
        validate(cfg)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def main(argv: list[str] | None = None) -> int:
    from weightsync.bench.vllm_report import format_table, plot
    from weightsync.bench.vllm_runner import Bench

    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    result = asyncio.run(Bench(cfg).run())
    if cfg.plot_path and not plot(result, cfg.plot_path):
        print("(no plot: matplotlib is not installed)", file=sys.stderr)
    print(format_table(result))
    ok = bool(result["rows"]) and all(r.get("verified") and not r.get("error")
                                      for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
