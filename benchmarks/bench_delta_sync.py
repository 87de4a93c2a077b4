"""Full vs delta pushes after real fine-tuning steps, bytes and seconds, in one run.

    python benchmarks/bench_delta_sync.py [--hidden-size 256] [--layers 4] [--vocab-size 4096]
        [--steps 5] [--lr 1e-5,1e-6] [--strategy broadcast|cuda_ipc|packed_cuda_ipc]
        [--json PATH]

See ``weightsync/bench/delta.py``: a small Qwen2 causal LM fine-tuned with AdamW on a real
next-token loss, pushed in bf16 after every step to two engine processes, as a full update and
as a delta; every delta checked bit for bit against the trainer's bf16 cast. Exits 1 if one was
not exact.
"""

from __future__ import annotations

import sys

from weightsync.bench.delta import main

if __name__ == "__main__":
    sys.exit(main())
