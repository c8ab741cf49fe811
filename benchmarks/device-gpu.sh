#!/usr/bin/env bash
# The GPU section of benchmarks/README.md in one device call (a lent H100/H200, MLX's CUDA
# backend). Prepare here with benchmarks/device-prep.sh (../shared/tools/device-mlx-cuda.sh, and
# outlines-core, which the CLI imports and the GPU image lacks: without it every `bench long`
# exits at once), make the shared tool's first call (carry .device/p1), then run this as the
# second (carry .device/p2):
#
#     bash benchmarks/device-gpu.sh
#
# It checks the custom CUDA kernels' parity (each kernel that passes is used by what follows),
# runs benchmarks/device-profile.py (where a prefill chunk's and a decode step's time goes;
# PROFILE_ARGS: its contexts), then `salabatch bench long` one context at a time (SALA then
# the peer, so each context's ratio exists even if the device's time runs out before the next),
# and, with TEST_S > 0 (a call on the warm machine: TEST_S=300 CONTEXTS= PROFILE_S=0), the
# GPU-path parity tests (float32, TF32 off); the JSON files and the log land in $OUT. Every
# step has its own time limit. A process that meets new shapes spends most of its time
# compiling kernels (NVRTC; kept in MLX_PTX_CACHE_DIR for later processes, and brought back as
# $OUT/ptx.tar.gz). On a fresh H100 (2026-11-26, third GPU session) the first call, with
# CONTEXTS="32K:300" PROFILE_ARGS=32768 PROFILE_S=110 KERNEL_S=75, ran 421 s: the stage-1
# parity 12 s, the profile cut at 110 s (its first lightning layer compiled for 33 s), the
# first `bench long 32K` 199 s; on the warm machine then, 256K alone took 86 s and 32K + 128K
# with the peer 94-106 s. So the first call warms the machine, and calls right after it time
# the rest (the machine stays warm ~30 s between calls), with KERNELS set to the list the
# first call logged as SALABATCH_CUDA_KERNELS (the kernels' parity then runs no more):
#
#     CONTEXTS= PROFILE_S=0 KERNEL_S=80 bash benchmarks/device-gpu.sh     (first: parity only)
#     KERNELS=stage1,gla CONTEXTS="32K:150 128K:150" PROFILE_S=0 bash benchmarks/device-gpu.sh
#
# On 2026-11-27 (fourth GPU session, 15 minutes) the machine started in 31 s; the parity of the
# six kernels, in parallel processes, took 93 s (the slowest, gla's); a first `bench long 32K`
# with the peer did not finish in 170 s, then 128K took 98 s and, in a later process, 32K 55 s.
# The plan for the next: call 2 `PROFILE_ARGS="32768 131072" PROFILE_S=240 CONTEXTS=
# KERNEL_S=110` (parity, then each stage's kernel beside its MLX ops, then
# benchmarks/choose-kernels.py's pick kept in /tmp), call 3 at once `KERNELS=auto
# CONTEXTS="32K:240 128K:150" PROFILE_S=0`. Keep $OUT's file names free of commas (such files
# do not come back). Since 2026-11-27 (session 58) `bench long` runs SALA as `salabatch run`
# holds a document, within its memory plan (MLX's limit at the plan, the tiles in turn): the
# first timings after it say whether the bound costs a GPU anything: side by side, `salabatch
# bench long --contexts 32K --no-peer` with and without `--no-bound` (last measured unbounded,
# H100: 32K prefill 1.81 s, peak 41.6 GB).
#
# `bench long` reports a process's first prefill as prefill_first_s and times a second one.
#
# On 2026-11-28 (H200, 15 minutes) call 2 `PROFILE_ARGS="32768 131072" PROFILE_S=240 CONTEXTS=
# KERNEL_S=110` ran 357 s (parity: `norm` and `rows` cut at 110 s while compiling; the profile
# cut at 240 s after the decode step's parts), call 3 `KERNELS=auto CONTEXTS="32K:230 128K:170"
# PROFILE_S=0` 160 s (32K 88 s, 128K 70 s). The machine goes back after ~30 s idle: have every
# call's command written before the first, and make them back to back (a fourth call, 256K,
# found it cold and the session's time too short to start another).
#
# Next (session 73's plan): the decode target is the nearest. Pipelined, as `salabatch run`
# decodes, the H200's 32K step was 119.5 against the peer's 105.3 tok/s (1.13×, 1.2× wanted),
# and the profile's small products ran far under the bandwidth (attention out, 4096 × 4096:
# 1.07 TB/s; gate+up 2.75): the `rows` kernel is for them, untested. Call 2 the defaults with
# `norm` and `rows` added where their parity passes (their decode-step tests now compile one
# model fewer): `KERNELS=stage1,stage2,decode PARITY="norm rows" KERNEL_S=200 CONTEXTS="32K:200"
# PROFILE_S=0`; call 3 the defaults alone, the baseline of the same machine and the 128K and
# 256K rows: `KERNELS=stage1,stage2,decode CONTEXTS="32K:150 128K:150 256K:200" PROFILE_S=0`.
#
# With SPEC_S > 0, `salabatch bench spec`'s cost workload (issue 38: the 9B in bf16 over a
# 32K-token document, off / lookup / auto at batch 1 and 8, and a verify pass's time in plain
# steps) runs after `bench long`; best on the warm machine, alone:
#
#     CONTEXTS= PROFILE_S=0 KERNEL_S=40 SPEC_S=240 bash benchmarks/device-gpu.sh
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

# The custom CUDA kernels' parity first, each in its own process (seconds once compiled): the benches
# below run with those that pass (SALABATCH_CUDA_KERNELS), the others' dispatchers on their
# MLX-op forms; timings through a kernel that disagrees with its reference would mean nothing.
# What the GPU path takes from MLX's own kernels without a reference beside it: a bf16 rope
# rounds once (the lightning prefill's one-kernel rope). Logged; a failure means the lightning
# prefill must upcast again (`attention.rotates_in_float32`).
[ -z "${KERNELS:-}" ] && MLX_PTX_CACHE_DIR=/tmp/mlx-ptx-rope MLX_ENABLE_TF32=0 timeout "${KERNEL_S:-90}" \
    python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/engine/test_lightning_gpu.py \
    > "$out/parity-rope.txt" 2>&1 &
# KERNELS=stage1,gla (say): the kernels an earlier call on this machine found passing, used
# as they are, their parity not run again.
passed=()
# KERNELS=auto: what choose-kernels.py picked from an earlier call's parity and profile on this
# machine (kept in /tmp, which a warm machine keeps between calls)
[ "${KERNELS:-}" = auto ] && KERNELS=$(cat /tmp/salabatch-kernels.txt 2>/dev/null || echo stage1,decode)
[ -n "${KERNELS:-}" ] && passed=("$KERNELS")
# each kernel's parity in its own process, all at once (NVRTC compiles on the CPU's cores), each
# with its own compiled-kernel folder: two processes writing one cache file would race
# (PARITY: a narrower list, e.g. PARITY="norm rows" with KERNEL_S=240 for the slow compilers)
# With KERNELS and PARITY both: PARITY's kernels are tested, and those that pass are added.
kernels=(${PARITY:-stage1 scores stage2 decode gla norm rows}) pids=()
[ -n "${KERNELS:-}" ] && [ -z "${PARITY:-}" ] && kernels=()
for kernel in "${kernels[@]}"; do
    MLX_PTX_CACHE_DIR="/tmp/mlx-ptx-$kernel" MLX_ENABLE_TF32=0 timeout "${KERNEL_S:-90}" \
        python3 -m pytest -q -p no:cacheprovider -rfE "tests/engine/kernels/test_${kernel}_cuda.py" \
        > "$out/parity-$kernel.txt" 2>&1 &
    pids+=($!)
done
for i in "${!kernels[@]}"; do
    wait "${pids[$i]}"
    rc=$? kernel=${kernels[$i]}
    tail -5 "$out/parity-$kernel.txt" | tee -a "$log"
    [ $rc -eq 0 ] && passed+=("$kernel")
    echo "== kernel $kernel: parity rc $rc" | tee -a "$log"
done
wait  # the rope check
[ -f "$out/parity-rope.txt" ] && tail -3 "$out/parity-rope.txt" | tee -a "$log"
export SALABATCH_CUDA_KERNELS=$(IFS=,; echo "${passed[*]:-none}")
echo "== SALABATCH_CUDA_KERNELS=$SALABATCH_CUDA_KERNELS" | tee -a "$log"
# where a chunk's and a step's time goes first (PROFILE_ARGS: its contexts, default 32K 64K
# 128K): it times each custom kernel beside its MLX-op form, and it warms the kernels the
# benches then use
[ "${PROFILE_S:-120}" -gt 0 ] && step "${PROFILE_S:-120}" "profile" \
    python3 benchmarks/device-profile.py ${PROFILE_ARGS:-}
# the kernels that passed and won in the profile, for a later call's KERNELS=auto
if [ "${PROFILE_S:-120}" -gt 0 ]; then
    python3 benchmarks/choose-kernels.py "$log" 2>&1 >/tmp/salabatch-kernels.txt | tee -a "$log"
    echo "== chosen: $(cat /tmp/salabatch-kernels.txt)" | tee -a "$log"
fi
for spec in ${CONTEXTS-32K:300}; do
    ctx=${spec%%:*} limit=${spec##*:}
    peer=--peer
    [ "$ctx" = 256K ] && peer=--no-peer  # the TTFT target; the dense peer's 256K prefill is long
    step "$limit" "bench long $ctx" python3 -m salabatch.cli bench long --contexts "$ctx" \
        "$peer" --steps 32 --out "$out/long-gpu-$ctx.json" --chart "/tmp/long-gpu-$ctx.png"
done
[ "${SPEC_S:-0}" -gt 0 ] && step "$SPEC_S" "bench spec cost" python3 -m salabatch.cli bench spec \
    --workloads cost --batches 1,8 --drafts off,lookup,auto --rounds 2 \
    --out "$out/spec-gpu.json" --chart /tmp/spec-gpu.png
[ "${TEST_S:-0}" -gt 0 ] && MLX_ENABLE_TF32=0 step "$TEST_S" "GPU-path parity tests" python3 -m pytest -q -p no:cacheprovider \
    --timeout 150 -rfE -k "not 9b_layout" \
    tests/engine/test_decode.py tests/engine/test_gpu_prefill_model.py \
    tests/engine/kernels/test_gpu_prefill.py tests/engine/kernels/test_sparse_kernels.py \
    tests/engine/test_no_host_sync.py

nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$log"
tar czf "$out/ptx.tar.gz" -C "$MLX_PTX_CACHE_DIR" . && ls -la "$out/ptx.tar.gz" | tee -a "$log"
