#!/usr/bin/env bash
# One device call that checks and times the GPU paths: the gpu-marked tests, then
# `weightsync bench --device cuda` on the 7B shape with 1 and 2 chunks in flight at 1024 MB
# buckets (about 160 s each, most of it the bit-exact digests), and the 0.5B shape. Writes details under $OUT and prints a short table last.
# Needs torch with CUDA; vLLM only for tests/integration/test_vllm_gpu.py (skipped when vLLM is
# absent). Run on nvidia-h200-x2 to include the NCCL rows.
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
bench() {  # name, then bench arguments
  local name=$1; shift
  PYTHONFAULTHANDLER=1 timeout -s ABRT 240 python3 -m weightsync.cli bench --device cuda --repeats 5 --json "$OUT/$name.json" \
      "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  echo "bench $name rc=$?"
}
for bucket in ${BUCKETS:-1024}; do  # 256 too: BUCKETS="256 1024" (then split the call: 600 s limit)
  for w in ${INFLIGHT:-1 2}; do
    bench "qwen2-7b_b${bucket}_w${w}" --shape qwen2-7b --bucket-mb "$bucket" --max-inflight "$w" \
        --strategy broadcast,cuda_ipc,packed_cuda_ipc
  done
done
bench qwen2-0.5b_all --shape qwen2-0.5b --strategy all
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    data = json.loads(p.read_text())
    for r in data.get("records", data) if isinstance(data, dict) else data:
        rows.append(r)
print(f"{'shape':11} {'bucket':>6} {'infl':>4} {'strategy':22} {'chunks':>6} {'s':>7} {'GB/s':>7} {'ref GB/s':>8} {'ratio':>5} exact")
for r in rows:
    print(f"{r.get('shape',''):11} {r.get('bucket_mb',0):6g} {r.get('max_inflight','-'):>4} "
          f"{r.get('strategy',''):22} {r.get('num_chunks','-'):>6} {r.get('seconds') or 0:7.3f} "
          f"{r.get('gbps') or 0:7.1f} {r.get('reference_gbps') or 0:8.1f} {r.get('ratio') or 0:5.2f} "
          f"{r.get('bit_exact')}")
PY
