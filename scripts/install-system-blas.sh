#!/bin/sh
# Installs an optimized BLAS on Debian/Ubuntu when we may (root + apt). MLX's Linux CPU wheel links
# a reference BLAS; salabatch loads this one in its place (see salabatch/engine/blas.py).
# OpenBLAS rather than BLIS: fp32 GEMM (prefill) measured 161 vs 100 GFLOP/s on 2 cores; BLIS
# reads weights faster in decode (14 vs 9 GB/s), but prefill dominates long documents.
[ "$(uname -s)" = Linux ] || exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
[ "$(id -u)" = 0 ] || { echo "note: not root, skipping the system BLAS"; exit 0; }
dpkg -s libopenblas0-pthread >/dev/null 2>&1 && exit 0
apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
