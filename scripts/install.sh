#!/usr/bin/env bash
# Installs weightsync with every extra on a fresh CPU machine (only Python and pip present).
# torch is pinned to the local CPU build so that no dependency swaps it for a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -c constraints.txt -e ".[vllm,ray,train,dev,demo,megatron]"
# PyPI's torchvision is a CUDA build and torchaudio/torchcodec do not match torch 2.13: importing
# them breaks transformers. triton is unused on CPU.
python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
