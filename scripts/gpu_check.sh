#!/usr/bin/env bash
# GPU checks in stages; each stage fits one 10-minute device call and ends with a short table.
#
#   bash scripts/gpu_check.sh first-hour [quickstart|demo]   a GPU user's first hour from a clean
#                                          environment holding only the gpu extra's wheels:
#                                          docs/quickstart.md's GPU section (servers side by side,
#                                          the demo), then the demo with cuda_ipc and with a CPU
#                                          trainer (scripts/gpu_first_hour.sh)
#   bash scripts/gpu_check.sh tests        gpu-marked transport / extractor tests + vLLM pooling
#                                          (tests/gpu/test_gpu_*.py, tests/integration/loaders/test_vllm_gpu.py)
#   bash scripts/gpu_check.sh tests-vllm   vLLM 0.26 generative engine: colocated cuda_ipc and
#                                          packed_cuda_ipc, eager and CUDA graphs; policy + reward
#                                          engines sharing one GPU
#   bash scripts/gpu_check.sh tests-servers broadcast (NCCL) through ws.connect from a trainer on GPU 0
#                                          into serve-reward and serve-policy on GPU 1, alone and
#                                          both on GPU 1 at once; Ludic's PyNccl trainer side into
#                                          serve-policy timed beside ours
#   bash scripts/gpu_check.sh perf         the headline: bench_vllm_sync.py on qwen2-7b and qwen2-0.5b with
#                                          the rows users take (push_broadcast, push_cuda_ipc), the
#                                          internal rows they drive and the references (ludic, vLLM
#                                          native): one 10-minute call
#   bash scripts/gpu_check.sh layouts      benchmarks/bench_broadcast_layouts.py on qwen2-7b and qwen2-0.5b: NCCL
#                                          per tensor, grouped, or packed in slices, vs one flat
#                                          broadcast (no vLLM, no control plane)
#   bash scripts/gpu_check.sh ab           the same qwen2-0.5b rows from another checkout (AB_TREE, default
#                                          /tmp/ab: a `git worktree add .ab <commit>` carried and copied
#                                          there) and from this one, untraced, in the order AB_ORDER
#                                          (default "before after after before"): a before/after on one
#                                          machine (AB_SHAPE, AB_ROWS, AB_REPEATS pick others)
#   bash scripts/gpu_check.sh copies       benchmarks/bench_copies.py on qwen2-7b and qwen2-0.5b: one batched
#                                          copy vs a copy per tensor vs split by size, into vLLM's
#                                          fused layout, against one flat copy (no vLLM)
#   bash scripts/gpu_check.sh trace        qwen2-0.5b broadcast rows with WEIGHTSYNC_TRACE_DIR set, then
#                                          benchmarks/trace_timeline.py: one push by phase, trainer
#                                          and engine worker on one clock
#   bash scripts/gpu_check.sh bench-small  benchmarks/bench_vllm_sync.py on qwen2-0.5b and qwen2-1.5b
#                                          (every row on 2+ GPUs, the colocated rows on one)
#   bash scripts/gpu_check.sh bench-7b     the same on qwen2-7b
#   bash scripts/gpu_check.sh bench-graphs qwen2-0.5b, ours only, CUDA graphs captured
#   bash scripts/gpu_check.sh bench-p2p    weightsync bench --device cuda (process to process into a
#                                          torch module, no vLLM) on qwen2-7b, 1 and 2 chunks in flight
#   bash scripts/gpu_check.sh bench-integrity weightsync bench --device cuda --integrity on qwen2-7b and
#                                          qwen2-0.5b: what checksum: true and staged: true cost
#   bash scripts/gpu_check.sh sleep        serve-reward's sleep mode (level 1 and 2): wake seconds, GiB
#                                          freed, a push while asleep, then scores = transformers
#   bash scripts/gpu_check.sh lora         LoRA adapter-only pushes (qwen2-0.5b, qwen2-7b, rank 16) vs a
#                                          full push vs vLLM's file-based adapter load, greedy tokens
#                                          checked each step (benchmarks/bench_lora_adapter.py)
#   bash scripts/gpu_check.sh adapter-slots serve-policy --enable-lora with one adapter version slot
#                                          vs two (--adapter-slots 2): an adapter push while a stream
#                                          of the adapter runs, both servers on GPU 0, tiny model
#                                          (benchmarks/bench_adapter_slots.py)
#   bash scripts/gpu_check.sh continue     serve-policy --in-flight-requests continue on GPU 1 (qwen2-7b
#                                          shape): how long generation stands still while a 7B update
#                                          lands under 4 streams (tests/gpu/test_continue_gpu.py)
#   bash scripts/gpu_check.sh trl          TRL's own VLLMClient (the installed trl package) on GPU 0 into
#                                          serve-policy --weight-transfer-config '{"backend": "nccl"}'
#                                          on GPU 1, no dev mode: init_communicator, update_model_params
#                                          and update_named_param step after step, generation checked
#                                          against transformers (tests/gpu/test_trl_client_gpu.py;
#                                          2 GPUs: the nvidia-h200-x2 kind)
#   bash scripts/gpu_check.sh fp8          FP8 targets: a bf16 trainer on the GPU pushes into vLLM engines
#                                          serving FP8 checkpoints (block 128x128, per-tensor) through
#                                          ws.connect(..., quantize=DIR); outputs = the same weights
#                                          loaded from an FP8 checkpoint (tests/gpu/test_gpu_fp8.py);
#                                          then benchmarks/bench_fp8.py on qwen2-1.5b, cuda_ipc
#   bash scripts/gpu_check.sh extras       the Megatron extractor (TP=2, NCCL) and the SGLang loader
#                                          against real engines (their wheels staged first by
#                                          scripts/stage_extras_gpu.sh)
#   bash scripts/gpu_check.sh hybrid       FSDP2 over 2 ranks + a TP=2 vLLM engine on the same 2 GPUs,
#                                          each TP worker fed by CUDA IPC from the rank on its GPU
#   bash scripts/gpu_check.sh four-gpu     trainer -> TP=2 engine over NCCL, fan-out to two engines,
#                                          FSDP2 x 2 -> TP=2 engine (needs 4 GPUs; says so and stops
#                                          on fewer)
#
# Details (JSON, logs, PNG) go under $OUT (at most 8 files per stage). vLLM must be importable
# (see the install steps in docs/benchmarks.md); the stage says so and stops if it is not.
# NVLink multicast stays off in every process (these variables are inherited).
set -u
stage=${1:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH="${PYTHONPATH:-}:."
OUT=${OUT:-/tmp/weightsync-gpu-out}; mkdir -p "$OUT"
export WEIGHTSYNC_GPU_OUT="$OUT"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

# weightsync runs from the checkout here (PYTHONPATH), not installed: register its vLLM plugin
# (the fast prefix-cache reset, pyproject's vllm.general_plugins entry point) as an install would
register_plugin() {
  local site
  site=$(python3 -c "import vllm, os; print(os.path.dirname(os.path.dirname(vllm.__file__)))" \
      2>/dev/null) || return 0
  mkdir -p "$site/weightsync_plugin-0.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: weightsync-plugin\nVersion: 0.0\n' \
      > "$site/weightsync_plugin-0.0.dist-info/METADATA"
  printf '[vllm.general_plugins]\nweightsync = weightsync._runtime.vllm_plugin:register\n' \
      > "$site/weightsync_plugin-0.0.dist-info/entry_points.txt"
}
register_plugin
echo "stage ${stage:-?}: $gpus GPU(s); $(python3 -c 'import torch; print("torch", torch.__version__)')"

need_vllm() {
  python3 -c "import vllm" 2>/dev/null && return 0
  echo "vLLM is not importable here: install it first (docs/benchmarks.md, GPU section)"; exit 2
}

# vLLM's FP8 layers and SGLang's model loader import compressed-tensors (0.17.0 for vLLM 0.26;
# it needs loguru): wheels staged under .whl/ct (carried) are installed beside vLLM
need_compressed_tensors() {
  if ! python3 -c "import compressed_tensors" 2>/dev/null; then
    ls .whl/ct/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --target /tmp/site .whl/ct/*.whl 2>&1 | grep -v "already exists"
    python3 -c "import compressed_tensors" 2>/dev/null || {
      echo "compressed_tensors is not importable: stage compressed-tensors==0.17.0 and loguru" \
           "wheels under .whl/ct and carry it (docs/benchmarks.md)"; exit 2; }
  fi
}

need_gpus() {
  if [ "$gpus" -lt "$1" ]; then
    echo "stage $stage needs $1 GPUs; this machine has $gpus: not run"; exit 3
  fi
}

pytest_stage() {  # log name, timeout, pytest arguments
  local name=$1 limit=$2; shift 2
  timeout -s ABRT "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs "$@" \
      > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "pytest $name rc=$rc"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/$name.log" | tail -15
}

bench() {  # name, timeout, then bench arguments
  local name=$1 limit=$2; shift 2
  timeout -s ABRT "$limit" python3 benchmarks/bench_vllm_sync.py --json "$OUT/$name.json" \
      --plot "$OUT/$name.png" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  echo "bench $name rc=$?"
}

# the colocated rows (trainer and engine on GPU 0): all a one-GPU machine can run
LOCAL_ROWS=push_cuda_ipc,cuda_ipc,packed_cuda_ipc,cuda_ipc_1chunk,cuda_ipc_load_weights,native_ipc,native_ipc_packed
rows_for_gpus() {  # every row on 2+ GPUs; on one GPU the colocated rows, and say so
  if [ "$gpus" -ge 2 ]; then echo all; else
    echo "one GPU: NCCL rows (push_broadcast, broadcast, per_param, ludic, native_nccl) skipped, they need 2" >&2
    echo "$LOCAL_ROWS"; fi
}

summary() {  # print every bench table written in this stage
  for f in "$OUT"/*.txt; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f" .txt)"; cat "$f"
  done
}

case "$stage" in
  first-hour)
    need_vllm
    bash scripts/gpu_first_hour.sh "${2:-all}"
    ;;
  tests)
    vllm_tests=""
    python3 -c "import vllm" 2>/dev/null && vllm_tests="tests/integration/loaders/test_vllm_gpu.py"
    pytest_stage gpu_tests 540 tests/gpu/test_gpu_transports.py \
        tests/gpu/test_gpu_deepspeed_fsdp_extractors.py tests/integration/bench/test_bench.py $vllm_tests
    ;;
  tests-vllm)
    need_vllm
    pytest_stage vllm_tests 560 tests/gpu/test_vllm_policy_gpu.py tests/gpu/test_vllm_colocated_gpu.py
    ;;
  tests-servers)
    need_vllm; need_gpus 2
    pytest_stage servers_tests 560 tests/gpu/test_servers_gpu.py
    ;;
  layouts)
    need_gpus 2
    for shape in qwen2-7b qwen2-0.5b; do
      timeout -s ABRT 150 python3 benchmarks/bench_broadcast_layouts.py --shape $shape \
          --packs 16:256,16,64,256 --json "$OUT/layouts_$shape.json" > "$OUT/layouts_$shape.txt" 2>&1
      echo "layouts $shape rc=$?"; tail -8 "$OUT/layouts_$shape.txt"
    done
    ;;
  perf)
    need_vllm; need_gpus 2
    # the internal rows first, the push rows after them on the same engine (on 2026-11-26 each
    # push row ran first after its engine started and was 8 / 4.5 ms slower at 7B)
    # (PERF_ROWS_7B / PERF_ROWS_SMALL: fewer rows when device time is short)
    bench qwen2-7b 330 --shape qwen2-7b --rows "${PERF_ROWS_7B:-broadcast,push_broadcast,broadcast_serial,broadcast_ungrouped,ludic,native_nccl,cuda_ipc,push_cuda_ipc}"
    bench qwen2-0.5b 200 --shape qwen2-0.5b --rows "${PERF_ROWS_SMALL:-broadcast,push_broadcast,broadcast_serial,broadcast_ungrouped,native_nccl,cuda_ipc,push_cuda_ipc,native_ipc}"
    summary
    ;;
  ab)
    need_vllm
    tree=${AB_TREE:-/tmp/ab}
    [ -d "$tree/weightsync" ] || { echo "no checkout at $tree (AB_TREE)"; exit 2; }
    here=$(pwd); n=0
    for who in ${AB_ORDER:-before after after before}; do
      n=$((n + 1)); name=ab_${n}_$who; dir=$here; [ "$who" = before ] && dir=$tree
      (cd "$dir" && timeout -s ABRT 150 python3 benchmarks/bench_vllm_sync.py \
          --shape "${AB_SHAPE:-qwen2-0.5b}" --repeats "${AB_REPEATS:-8}" \
          --rows "${AB_ROWS:-broadcast,push_broadcast,cuda_ipc,push_cuda_ipc}" \
          --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "/tmp/$name.log")
      echo "bench $name rc=$?"
    done
    summary
    ;;
  copies)
    # how the engine should copy an update into its weights (no vLLM): one _foreach_copy_, a
    # copy_ per tensor, or split by size, against one flat copy (benchmarks/bench_copies.py)
    for shape in qwen2-7b qwen2-0.5b; do
      timeout 240 python3 benchmarks/bench_copies.py --shape $shape \
          --json "$OUT/copies-$shape.json" > "$OUT/copies-$shape.txt" 2>&1
      echo "bench copies $shape rc=$?"; cat "$OUT/copies-$shape.txt"
    done
    ;;
  trace)
    # where one push's time goes: the 0.5B rows with the opt-in trace, then the merged timeline
    # of the last pushes (trainer and engine worker on one clock; benchmarks/trace_timeline.py)
    need_vllm; need_gpus 2
    rm -rf /tmp/ws-trace && mkdir -p /tmp/ws-trace
    (export WEIGHTSYNC_TRACE_DIR=/tmp/ws-trace
     bench qwen2-0.5b_traced 200 --shape qwen2-0.5b --rows "${TRACE_ROWS:-broadcast,push_broadcast}")
    timeout 60 python3 benchmarks/trace_timeline.py /tmp/ws-trace --last 2 --limit 80 \
        --json "$OUT/timeline.json" > "$OUT/timeline.txt" 2>&1
    summary; cat "$OUT/timeline.txt"
    ;;
  bench-small)
    need_vllm; rows=$(rows_for_gpus)
    bench qwen2-0.5b 270 --shape qwen2-0.5b --rows "$rows"
    bench qwen2-1.5b 290 --shape qwen2-1.5b --rows "$rows"
    summary
    ;;
  bench-7b)
    need_vllm; rows=$(rows_for_gpus)
    bench qwen2-7b 560 --shape qwen2-7b --rows "$rows"
    summary
    ;;
  bench-graphs)
    need_vllm
    graph_rows=push_cuda_ipc,packed_cuda_ipc,push_broadcast
    [ "$gpus" -ge 2 ] || graph_rows=push_cuda_ipc,packed_cuda_ipc
    bench qwen2-0.5b_graphs 400 --shape qwen2-0.5b --cuda-graphs --rows "$graph_rows" \
        --check-logprobs
    summary
    ;;
  bench-p2p)
    for w in 1 2; do
      timeout -s ABRT 240 python3 -m weightsync.cli bench --device cuda --repeats 5 \
          --shape qwen2-7b --bucket-mb 1024 --max-inflight "$w" \
          --strategy broadcast,cuda_ipc,packed_cuda_ipc --json "$OUT/p2p_w$w.json" \
          > "$OUT/p2p_w$w.txt" 2> "$OUT/p2p_w$w.log"
      echo "bench p2p_w$w rc=$?"
    done
    summary
    ;;
  bench-integrity)
    strategies=cuda_ipc,packed_cuda_ipc
    [ "$gpus" -ge 2 ] && strategies=broadcast,$strategies
    for shape in qwen2-7b qwen2-0.5b; do
      timeout -s ABRT 270 python3 -m weightsync.cli bench --device cuda --repeats 7 \
          --shape "$shape" --strategy "$strategies" --integrity --json "$OUT/integrity_$shape.json" \
          > "$OUT/integrity_$shape.txt" 2> "$OUT/integrity_$shape.log"
      echo "bench integrity_$shape rc=$?"
    done
    summary
    ;;
  hybrid)
    need_vllm; need_gpus 2
    pytest_stage hybrid 560 tests/gpu/test_hybrid_gpu.py
    ;;
  sleep)
    need_vllm; need_gpus 2
    pytest_stage sleep 560 tests/gpu/test_reward_sleep_gpu.py
    ;;
  lora)
    need_vllm
    strategy=broadcast; [ "$gpus" -ge 2 ] || strategy=cuda_ipc
    steps=${LORA_STEPS:-8}
    # the 0.5B run traced (its adapter pushes' timeline: where the fixed cost goes), the 7B one
    # untimed by any trace
    rm -rf /tmp/ws-trace-lora && mkdir -p /tmp/ws-trace-lora
    for shape in qwen2-0.5b qwen2-7b; do
      trace=""; [ "$shape" = qwen2-0.5b ] && trace=/tmp/ws-trace-lora
      WEIGHTSYNC_TRACE_DIR=$trace timeout -s ABRT 280 python3 benchmarks/bench_lora_adapter.py \
          --shape "$shape" --steps "$steps" --strategy "$strategy" \
          --json "$OUT/lora_$shape.json" > "$OUT/lora_$shape.txt" 2> "$OUT/lora_$shape.log"
      echo "bench lora_$shape rc=$?"
    done
    # the bench pushes: the base, the first adapter, $steps adapter steps, $steps full pushes;
    # the last three adapter steps are pushes $steps .. $steps + 2 of 2 * $steps + 2
    timeout 60 python3 benchmarks/trace_timeline.py /tmp/ws-trace-lora --last $((steps + 3)) \
        --limit 70 > "$OUT/lora_timeline.txt" 2>&1
    summary
    ;;
  lora-ipc)
    # the same bench colocated: trainer and engine on GPU 0, the adapter through CUDA IPC
    # (LORA_TRACE=1: traced, and the timeline of its last adapter pushes; tracing adds its
    # own marks and a flush at each finish to the times)
    need_vllm
    steps=${LORA_STEPS:-8}
    rm -rf /tmp/ws-trace-lora-ipc && mkdir -p /tmp/ws-trace-lora-ipc
    trace=""; [ "${LORA_TRACE:-0}" = 1 ] && trace=/tmp/ws-trace-lora-ipc
    WEIGHTSYNC_TRACE_DIR=$trace timeout -s ABRT 300 python3 \
        benchmarks/bench_lora_adapter.py --shape qwen2-7b \
        --steps "$steps" --strategy cuda_ipc --trainer-device cuda:0 \
        --engine-device cuda:0 --json "$OUT/lora_ipc_qwen2-7b.json" \
        > "$OUT/lora_ipc_qwen2-7b.txt" 2> "$OUT/lora_ipc_qwen2-7b.log"
    echo "bench lora_ipc_qwen2-7b rc=$?"
    [ -n "$trace" ] && timeout 60 python3 benchmarks/trace_timeline.py "$trace" \
        --last $((steps + 3)) --limit 70 > "$OUT/lora_ipc_timeline.txt" 2>&1
    summary
    ;;
  adapter-slots)
    need_vllm
    timeout -s ABRT 400 python3 benchmarks/bench_adapter_slots.py --rounds 5 \
        --json "$OUT/adapter_slots.json" > "$OUT/adapter_slots.txt" 2> "$OUT/adapter_slots.log"
    echo "bench adapter_slots rc=$?"
    summary
    ;;
  continue)
    need_vllm; need_gpus 2
    pytest_stage continue 560 -s tests/gpu/test_continue_gpu.py
    ;;
  trl)
    need_vllm; need_gpus 2
    trl_version=$(timeout 120 python3 -c "import trl; print(trl.__version__)" 2>/dev/null) || {
      echo "trl is not importable here: install TRL (1.16, the version whose VLLMClient speaks" \
           "vLLM's weight-transfer routes) beside vLLM first"; exit 2; }
    echo "trl $trl_version"
    pytest_stage trl 560 -s tests/gpu/test_trl_client_gpu.py
    ;;
  fp8)
    need_vllm
    need_compressed_tensors
    pytest_stage fp8 400 tests/gpu/test_gpu_fp8.py
    timeout -s ABRT 150 python3 benchmarks/bench_fp8.py --size 1.5b --device cuda \
        --strategy cuda_ipc --json "$OUT/fp8_1.5b.json" > "$OUT/fp8_1.5b.txt" 2> "$OUT/fp8_1.5b.log"
    echo "bench fp8_1.5b rc=$?"
    summary
    ;;
  extras)
    # the extra wheels staged by scripts/stage_extras_gpu.sh (.whl/extras1, .whl/extras2, carried
    # in two calls that each copy theirs to /tmp/extras/) go into /tmp/site beside vLLM; each
    # test skips, saying so, when its package does not import
    # (one copy of each wheel: /tmp/extras when the two calls put them there, else .whl/)
    wheels=$(ls /tmp/extras/*.whl 2>/dev/null || ls .whl/extras*/*.whl 2>/dev/null)
    if [ -n "$wheels" ] && ! python3 -c "import sglang, mbridge" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /tmp/site $wheels 2>&1 | grep -v "already exists" | tail -2
    fi
    # sglang 0.5.17 registers Qwen3-ASR's config with transformers, which the GPU image's 5.17
    # ships itself: without exist_ok its import fails ("'qwen3_asr' is already used by a
    # Transformers config"); the installed copy is told exist_ok (in every process it starts)
    asr=/tmp/site/sglang/srt/configs/qwen3_asr.py
    [ -f "$asr" ] && sed -i -E \
        's/AutoConfig\.register\(("qwen3_asr[a-z_]*"), (Qwen3ASR[A-Za-z]*Config)\)$/AutoConfig.register(\1, \2, exist_ok=True)/' \
        "$asr"
    need_compressed_tensors
    export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
    for m in sglang megatron.core mbridge transformer_engine; do
      python3 -c "import $m" >/dev/null 2>&1 && echo "import $m: ok" || echo "import $m: no"
    done
    pytest_stage extras 560 tests/gpu/test_gpu_megatron_extractor.py \
        tests/gpu/test_gpu_sglang_loader.py
    ;;
  four-gpu)
    need_vllm; need_gpus 4
    bench qwen2-7b_tp2 300 --shape qwen2-7b --tp 2 --rows broadcast,ludic,native_nccl --check-logprobs
    pytest_stage four_gpu 280 tests/gpu/test_four_gpu.py
    summary
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh {first-hour|perf|ab|layouts|trace|tests|tests-vllm|tests-servers|sleep|lora|lora-ipc|adapter-slots|continue|fp8|extras|bench-small|bench-7b|bench-graphs|bench-p2p|bench-integrity|hybrid|four-gpu}"
    exit 2
    ;;
esac
