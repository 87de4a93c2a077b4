#!/usr/bin/env bash
# Stage what the `extras` stage of scripts/gpu_check.sh needs beside vLLM on the GPU machine
# (no network there): SGLang 0.5.17 (the newest release that pins torch 2.11.0, the GPU image's
# torch) with its kernel package slimmed, and Megatron-Core 0.16.1 + mbridge 0.15.1.
#
#   bash scripts/stage_extras_gpu.sh        (here, from the checkout; downloads ~65 MB)
#
# Result: .whl/extras1 (sglang, sglang-kernel) and .whl/extras2 (the rest), each under the
# device's 64 MiB per call; both git-ignored. Carry them to the device in two calls beside the
# vLLM parts (each call copies its directory to /tmp/extras/, which survives while the machine
# is warm); the stage then installs /tmp/extras/*.whl with --no-deps into /tmp/site.
#
# What is left out, and why (sizes on PyPI, 2026-11-26):
# - sglang-kernel 0.4.5's FlashAttention-3 library (326 MiB) and its Blackwell (sm100) ops: the
#   kernel wheel is repacked without them (18 MB), so SGLang runs with attention_backend
#   "triton" and sampling_backend "pytorch" (tests/gpu/test_gpu_sglang_loader.py passes both);
# - SGLang's other pins (openai 2.6.1, xgrammar 0.2.1, openai-harmony 0.0.4, apache-tvm-ffi
#   0.1.11, transformers 5.12.1) differ from what vLLM 0.26 and the image bring; the names
#   SGLang imports from them exist in the newer versions, so vLLM's and the image's stay;
# - Megatron-Bridge 0.3.1 pins transformers < 5 and imports Transformer Engine, whose torch
#   extension is built from source: not stageable. mbridge builds Transformer Engine layers too;
#   without TE the test builds Megatron-Core's local layers and tells mbridge their names (as the
#   CPU test does).
# IPython and its small dependencies come because sglang imports IPython.display at import.
set -euo pipefail
REPO=$(git rev-parse --show-toplevel)
cd "$REPO"
PLATS=""
for t in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do PLATS="$PLATS --platform ${t}_x86_64"; done
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS"
ONE="sglang==0.5.17 sglang-kernel==0.4.5"
TWO="flashinfer-python==0.6.15.post1 torch-memory-saver==0.0.9.post1 dill==0.4.1 gguf==0.19.0
orjson==3.11.9 ipython==9.17.1 ipython-pygments-lexers==1.1.1 asttokens==3.0.2 executing==2.2.1
jedi==0.20.0 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0
prompt-toolkit==3.0.53 pure-eval==0.2.4 stack-data==0.6.3 traitlets==5.16.1 wcwidth==0.9.1
megatron-core==0.16.1 mbridge==0.15.1"
mkdir -p .git/info
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl/extras1 .whl/extras2 /tmp/ws-extras-dl
mkdir -p .whl/extras1 .whl/extras2 /tmp/ws-extras-dl
for spec in $ONE; do $DL -d /tmp/ws-extras-dl "$spec"; done
for spec in $TWO; do $DL -d .whl/extras2 "$spec"; done
mv /tmp/ws-extras-dl/sglang-0.5.17-*.whl .whl/extras1/
# the kernel wheel without FA3 and sm100 (RECORD rewritten: a valid wheel)
python3 - /tmp/ws-extras-dl/sglang_kernel-0.4.5-*.whl .whl/extras1 <<'PY'
import os, sys, zipfile
src, outdir = sys.argv[1], sys.argv[2]
drop = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/", "sgl_kernel/infllm_ops.")
out = os.path.join(outdir, os.path.basename(src))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        if info.filename.startswith(drop):
            continue
        data = zi.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            keep = [ln for ln in data.decode().splitlines() if not ln.startswith(drop)]
            data = ("\n".join(keep) + "\n").encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{out}: {os.path.getsize(out)} bytes")
PY
rm -rf /tmp/ws-extras-dl
for d in .whl/extras1 .whl/extras2; do
  size=$(du -sb "$d" | cut -f1)
  echo "$d: $(ls "$d" | wc -l) wheels, $size bytes"
  [ "$size" -lt $((62 * 1024 * 1024)) ] || { echo "$d is over 62 MiB: split it" >&2; exit 1; }
done
