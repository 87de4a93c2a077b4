#!/usr/bin/env bash
# A GPU user's first hour, on the GPU machine, as a user meets it (bash scripts/gpu_check.sh
# first-hour runs it):
#   1. a fresh virtual environment on the image's Python (its torch is the one vLLM 0.26.0 pins)
#      that holds only the GPU extra's wheels: vLLM's CUDA build and what it needs beyond the
#      image (staged, installed into $SITE by device_install.sh: that machine reaches no
#      registry), and weightsync's own wheel (.stage/ws); the gpu extra's requirements are
#      checked against it;
#   2. in that environment alone, started with `env -i` (nothing a test harness exports reaches
#      it): docs/quickstart.md's GPU section (tests/gpu/test_docs_quickstart_gpu.py): the demo on
#      one GPU, then serve-reward and serve-policy side by side, both answering;
#   3. `weightsync demo --device cuda --strategy cuda_ipc` and `weightsync demo` (trainer on CPU,
#      servers on the GPU), each with its record under $OUT.
# The GPU's memory is read before and after: nothing may stay held.
set -u
OUT=${OUT:-/tmp/weightsync-gpu-out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
VENV=${VENV:-/tmp/wsenv}
repo=$(pwd)
py=$(command -v python3)
ls .stage/ws/weightsync-*.whl >/dev/null 2>&1 || { echo "no weightsync wheel in .stage/ws"; exit 2; }
[ -d "$SITE/vllm" ] || { echo "no vLLM in $SITE: run .stage/t/device_install.sh first"; exit 2; }

if [ ! -x "$VENV/bin/weightsync" ]; then
  "$py" -m venv "$VENV" || exit 2
  pyver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  # the staged wheels, then the image's packages (its python3 is itself a virtual environment,
  # whose packages a --system-site-packages environment would not see)
  { echo "$SITE"; (cd /tmp && "$py" -c 'import site; print("\n".join(site.getsitepackages()))'); } \
      > "$VENV/lib/python$pyver/site-packages/staged-wheels.pth"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile .stage/ws/weightsync-*.whl \
      || exit 2
fi
# the user's environment: what a login shell has, and this machine's rules (NVLink multicast off;
# flashinfer, which vLLM's sampler would use, is not among the staged wheels)
clean=(env -i "PATH=$VENV/bin:/usr/local/bin:/usr/bin:/bin" "HOME=$HOME" "LANG=C.UTF-8"
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
       VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1)

(cd /tmp && "${clean[@]}" python -) <<'PY' | tee "$OUT/extra_check.txt"
# every requirement of the gpu extra (and the base ones) is met in this environment
from importlib.metadata import PackageNotFoundError, distribution, requires, version
from packaging.requirements import Requirement
import weightsync, sys
bad = []
for raw in requires("weightsync"):
    req = Requirement(raw)
    if req.marker and not req.marker.evaluate({"extra": "gpu"}):
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        bad.append(f"{req.name}: missing"); continue
    ok = req.specifier.contains(have, prereleases=True)
    print(f"  {req.name}{req.specifier or ''}: {have} {'ok' if ok else 'NOT OK'}")
    ok or bad.append(f"{req.name} {have} not {req.specifier}")
print("weightsync from", weightsync.__file__)
eps = [e.value for e in distribution("weightsync").entry_points if e.group == "vllm.general_plugins"]
print("vLLM plugin registered:", eps)
print("extra check:", "PASS" if not bad else "FAIL " + "; ".join(bad))
PY

stage=${1:-all}
free_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
echo "GPU memory used before: $(free_mib) MiB"
if [ "$stage" = all ] || [ "$stage" = quickstart ]; then
  # the test's own helpers (tests/integration/docs/_markdown.py) on its path; the test leaves that
  # variable out of the commands it runs
  (cd /tmp && "${clean[@]}" PYTHONPATH="$repo/tests/integration/docs" timeout -s ABRT 560 python -m pytest -q -p no:cacheprovider \
      -o addopts="" --rootdir "$repo" -c "$repo/pyproject.toml" -m gpu -rs \
      "$repo/tests/gpu/test_docs_quickstart_gpu.py" > "$OUT/quickstart_gpu.log" 2>&1)
  echo "quickstart GPU section: rc=$?"; tail -5 "$OUT/quickstart_gpu.log"
  echo "GPU memory used after: $(free_mib) MiB"
fi
if [ "$stage" = all ] || [ "$stage" = demo ]; then
  mkdir -p /tmp/demo && cd /tmp/demo || exit 2
  for run in "cuda_ipc --device cuda --strategy cuda_ipc" "cpu_trainer"; do
    name=${run%% *}; args=${run#"$name"}
    start=$(date +%s)
    "${clean[@]}" timeout -s INT 280 weightsync demo $args --out "/tmp/demo/$name" \
        > "$OUT/demo_$name.log" 2>&1
    rc=$?
    echo "demo $name ($args): rc=$rc in $(( $(date +%s) - start )) s; GPU memory used after: $(free_mib) MiB"
    grep -E "placement|result|policy sync ms|mean reward first|servers ready" "$OUT/demo_$name.log" | tail -6
    cp "/tmp/demo/$name/weightsync-demo.json" "$OUT/demo_$name.json" 2>/dev/null
  done
fi
