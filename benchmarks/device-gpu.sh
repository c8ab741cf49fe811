#!/usr/bin/env bash
# The GPU section of benchmarks/README.md in one device call (a lent H100/H200, MLX's CUDA
# backend). Prepare here with ../shared/tools/device-mlx-cuda.sh, make its first call (carry
# .device/p1), then run this as the second (carry .device/p2):
#
#     bash benchmarks/device-gpu.sh
#
# It runs `salabatch bench long` one context at a time (SALA then the peer, so each context's
# ratio exists even if the device's time runs out before the next), then
# benchmarks/device-profile.py (where a prefill chunk's and a decode step's time goes), and,
# with TEST_S > 0 (a second call on the warm machine: TEST_S=300 CONTEXTS= PROFILE_S=0), the
# GPU-path parity tests (float32, TF32 off); the JSON files and the log land in $OUT. Every
# step has its own time limit; the defaults fit a 10-minute call. A process that meets new
# shapes spends most of its time compiling kernels (NVRTC; they are kept on the machine for
# later processes): on a fresh H100 (2026-11-26) the first `bench long 32K` did not finish in
# 230 s nor the first 128K in 150 s, while 256K and the profile then ran in 80 and 68 s; on
# the warm machine 32K and 128K took 35 and 66 s. So the first call warms the machine (its
# 256K and profile count), and a second call right after it times 32K and 128K:
#
#     CONTEXTS="32K:140 128K:150" PROFILE_S=0 bash benchmarks/device-gpu.sh
#
# `bench long` reports a process's first prefill as prefill_first_s and times a second one.
#
# With SPEC_S > 0, `salabatch bench spec`'s cost workload (issue 38: the 9B in bf16 over a
# 32K-token document, off / lookup / auto at batch 1 and 8, and a verify pass's time in plain
# steps) runs after `bench long`; best on the warm machine, alone:
#
#     CONTEXTS= PROFILE_S=0 SPEC_S=240 bash benchmarks/device-gpu.sh
set -u
# the first call on a machine installs MLX's CUDA wheels; a later call on the warm machine finds
# them in /tmp/site (install.sh deletes the first part it joins) and only sets the environment
if [ -d /tmp/site/mlx ]; then source .device/p2/env.sh; else source .device/p2/install.sh; fi
# Timings run as users run: MLX's default (TF32 in float32 matmuls on CUDA: SALA's lightning
# recurrence is float32); the parity tests run with MLX_ENABLE_TF32=0 (tests/conftest.py).
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/salabatch-gpu}
mkdir -p "$out"
# MLX's compiled CUDA kernels (NVRTC, minutes on a fresh machine): kept in one folder that
# comes back as $OUT/ptx.tar.gz; keep it as .device/ptx.tar.gz here and carry it next time
# (beside .device/p2) to start warm.
export MLX_PTX_CACHE_DIR=/tmp/mlx-ptx
mkdir -p "$MLX_PTX_CACHE_DIR"
[ -f .device/ptx.tar.gz ] && tar xzf .device/ptx.tar.gz -C "$MLX_PTX_CACHE_DIR"
log="$out/log.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv \
    | tee -a "$log"

step() {  # step SECONDS NAME COMMAND...: run with a time limit, log its output and its time
    local limit=$1 name=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "== $name: rc ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$log"
}

for spec in ${CONTEXTS-32K:230 128K:150 256K:80}; do
    ctx=${spec%%:*} limit=${spec##*:}
    peer=--peer
    [ "$ctx" = 256K ] && peer=--no-peer  # the TTFT target; the dense peer's 256K prefill is long
    step "$limit" "bench long $ctx" python3 -m salabatch.cli bench long --contexts "$ctx" \
        "$peer" --steps 32 --out "$out/long-gpu-$ctx.json" --chart "/tmp/long-gpu-$ctx.png"
done
[ "${SPEC_S:-0}" -gt 0 ] && step "$SPEC_S" "bench spec cost" python3 -m salabatch.cli bench spec \
    --workloads cost --batches 1,8 --drafts off,lookup,auto --rounds 2 \
    --out "$out/spec-gpu.json" --chart /tmp/spec-gpu.png
[ "${PROFILE_S:-120}" -gt 0 ] && step "${PROFILE_S:-120}" "profile" python3 benchmarks/device-profile.py
[ "${TEST_S:-0}" -gt 0 ] && MLX_ENABLE_TF32=0 step "$TEST_S" "GPU-path parity tests" python3 -m pytest -q -p no:cacheprovider \
    --timeout 150 -rfE -k "not 9b_layout" \
    tests/engine/test_decode.py tests/engine/test_gpu_prefill_model.py \
    tests/engine/kernels/test_gpu_prefill.py tests/engine/kernels/test_sparse_kernels.py \
    tests/engine/test_no_host_sync.py

nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$log"
tar czf "$out/ptx.tar.gz" -C "$MLX_PTX_CACHE_DIR" . && ls -la "$out/ptx.tar.gz" | tee -a "$log"
