#!/usr/bin/env bash
# Prepares, here, the two device calls benchmarks/device-gpu.sh needs (its header): MLX's CUDA
# wheels by ../shared/tools/device-mlx-cuda.sh into .device/, then the wheels salabatch needs
# that the shared tool leaves out (the GPU image has no package index): outlines-core, which
# the CLI imports (structured outputs). Run from the project's root:
#
#     bash benchmarks/device-prep.sh
set -euo pipefail
../shared/tools/device-mlx-cuda.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/p2 \
    "outlines-core>=0.2.10,<0.3"
ls .device/p2/outlines_core-*.whl
