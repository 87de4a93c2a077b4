"""Weight sync into a real vLLM engine: a thin wrapper over ``weightsync.bench.vllm_sync``.

    python benchmarks/bench_vllm_sync.py --shape qwen2-7b --json out.json --plot out.png
    python benchmarks/bench_vllm_sync.py --device cpu --shape tiny --dtype float32

One table per run: ours per strategy end to end, vLLM's own weight-transfer engine and the
transport ceiling (flat broadcast / device copy) measured in the same run, the stage split of a
profiled sync, peak extra memory on each side, every row checked bit-exact. See
``python benchmarks/bench_vllm_sync.py --help``.
"""

from __future__ import annotations

import sys

from weightsync.bench.vllm_sync import main

if __name__ == "__main__":
    sys.exit(main())
