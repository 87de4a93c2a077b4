"""FP8 targets: a push into an FP8 engine (block-scaled, per-tensor) beside a bf16 push, in one run.

    python benchmarks/bench_fp8.py [--size small|0.5b|1.5b|7b] [--device cpu|cuda]
        [--strategy broadcast|cuda_ipc|packed_cuda_ipc] [--repeats 5] [--json PATH]

See ``weightsync/bench/fp8.py``: the same bf16 weights pushed through ``ws.connect`` into a bf16
engine and, with ``quantize=``, into engines holding the FP8 layouts; bytes on the wire, push
milliseconds against the bf16 push, the sender's quantisation alone, and a bit-exactness check
of what landed. Exits 1 if one was not exact.
"""

from __future__ import annotations

import sys

from weightsync.bench.fp8 import main

if __name__ == "__main__":
    sys.exit(main())
