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
# step has its own time limit; the defaults fit a 10-minute call. Seen on an H200: a process
# that meets new shapes spends most of its time compiling kernels (NVRTC; the kernels are kept
# on the machine for later processes): a fresh machine's first `bench long 32K` took over 140
# s, the same run on the warm machine 36 s. `bench long` reports a process's first prefill as
# prefill_first_s and times a second one.
set -u
source .device/p2/install.sh
# Timings run as users run: MLX's default (TF32 in float32 matmuls on CUDA: SALA's lightning
# recurrence is float32); the parity tests run with MLX_ENABLE_TF32=0 (tests/conftest.py).
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/salabatch-gpu}
mkdir -p "$out"
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

for spec in ${CONTEXTS-32K:220 128K:170 256K:90}; do
    ctx=${spec%%:*} limit=${spec##*:}
    peer=--peer
    [ "$ctx" = 256K ] && peer=--no-peer  # the TTFT target; the dense peer's 256K prefill is long
    step "$limit" "bench long $ctx" python3 -m salabatch.cli bench long --contexts "$ctx" \
        "$peer" --steps 32 --out "$out/long-gpu-$ctx.json" --chart "/tmp/long-gpu-$ctx.png"
done
[ "${PROFILE_S:-110}" -gt 0 ] && step "${PROFILE_S:-110}" "profile" python3 benchmarks/device-profile.py
[ "${TEST_S:-0}" -gt 0 ] && MLX_ENABLE_TF32=0 step "$TEST_S" "GPU-path parity tests" python3 -m pytest -q -p no:cacheprovider \
    --timeout 150 -rfE -k "not 9b_layout" \
    tests/engine/test_decode.py tests/engine/test_gpu_prefill_model.py \
    tests/engine/kernels/test_gpu_prefill.py tests/engine/kernels/test_sparse_kernels.py \
    tests/engine/test_no_host_sync.py

nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$log"
