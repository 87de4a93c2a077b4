"""``weightsync bench``: move a model of a named shape through each strategy between two real
processes, check every tensor arrived bit-exact, and compare with references from the same run.

- ``runner``: ``BenchConfig``, ``run_bench`` (the records), ``format_table``.
- ``cli``: the command line (``weightsync bench --help``).
- ``shapes``: named model shapes (``tiny`` ... ``qwen2-7b``) and ``build_module``.
- ``reference``: the in-run references (memcpy, raw broadcast, device copy).
"""

from weightsync.bench.runner import (
    DEFAULT_STRATEGIES,
    NAIVE_MAX_TENSORS,
    BenchConfig,
    format_table,
    run_bench,
    validate_config,
)

__all__ = [
    "DEFAULT_STRATEGIES", "NAIVE_MAX_TENSORS", "BenchConfig", "format_table", "run_bench",
    "validate_config",
]
