"""Weight-sync bandwidth benchmark: a thin wrapper over ``weightsync bench``.

    python benchmarks/bench_sync.py --shape qwen2-0.5b --strategy all --json sync.json
    python benchmarks/bench_sync.py --shape many-small --strategy cuda_ipc,packed_cuda_ipc

Every figure is a ratio against a reference measured in the same run (memcpy on CPU; device copy
or raw NCCL broadcast on GPU). See ``weightsync bench --help`` for the options.
"""

from __future__ import annotations

import sys

from weightsync.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
