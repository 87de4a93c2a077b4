#!/usr/bin/env bash
# The README's test command: install, lint, then every non-GPU test. pytest's exit code 5
# (no tests collected) fails this script like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
python -m ruff check weightsync tests benchmarks examples
python -m pytest -m "not gpu" -p no:cacheprovider "$@"
