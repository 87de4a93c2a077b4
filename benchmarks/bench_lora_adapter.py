"""LoRA adapter-only pushes vs a full push vs vLLM's file-based adapter load, in one run.

    python benchmarks/bench_lora_adapter.py [--hidden-size 256] [--layers 4] [--rank 16]
        [--steps 5] [--strategy broadcast|cuda_ipc|packed_cuda_ipc] [--json PATH]

See ``weightsync/bench/lora_adapter.py``: one in-process vLLM engine with LoRA enabled, a PEFT
adapter trained for real, and per step the adapter push, a full push and vLLM's own
save-then-load of the adapter timed side by side; the pushed adapter's greedy tokens checked
against transformers. Exits 1 if one was not equal.
"""

from __future__ import annotations

import sys

from weightsync.bench.lora_adapter import main

if __name__ == "__main__":
    sys.exit(main())
