#!/usr/bin/env bash
# One device call that checks and times the GPU paths: the gpu-marked tests, then
# `weightsync bench --device cuda` on the 7B and 0.5B shapes. Writes details under $OUT and
# prints a short table last. Needs torch with CUDA; vLLM only for tests/integration/test_vllm_gpu.py
# (skipped when vLLM is absent). Run on nvidia-h200-x2 to include the NCCL rows.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:."
OUT=${OUT:-/tmp/weightsync-gpu-out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
vllm_tests=""
python3 -c "import vllm" 2>/dev/null && vllm_tests="tests/integration/test_vllm_gpu.py"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/integration/test_bench.py \
    $vllm_tests > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
for shape in qwen2-7b qwen2-0.5b; do
  timeout 200 python3 -m weightsync.cli bench --device cuda --shape "$shape" --strategy all \
      --repeats 5 --json "$OUT/bench_$shape.json" > "$OUT/bench_$shape.txt" 2> "$OUT/bench_$shape.err"
  echo "bench $shape rc=$?"
done
cat "$OUT"/bench_*.txt
