#!/bin/sh
# Builds salabatch's native CPU kernels (salabatch/engine/native) into
# salabatch/engine/kernels/_native*.so, against the MLX installed for the given Python:
#   sh scripts/build-native.sh .venv/bin/python
# Needs a C++17 compiler; cmake and nanobind come from pip. The build log is
# build/native/build.log. Without the module salabatch runs the same steps as MLX-op graphs.
set -eu
PY=${1:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD="$ROOT/build/native"
mkdir -p "$BUILD"
LOG="$BUILD/build.log"
"$PY" -m pip install -q "nanobind>=3.0,<4" "cmake>=3.24" >"$LOG" 2>&1
MLX_DIR=$("$PY" -c "import mlx, os; print(os.path.join(mlx.__path__[0], 'share', 'cmake', 'MLX'))")
MLX_VERSION=$("$PY" -c "import mlx.core as mx; print(mx.__version__)")
NB_DIR=$("$PY" -m nanobind --cmake_dir)
CMAKE="$(dirname "$PY")/cmake"
rm -f "$ROOT"/salabatch/engine/kernels/_native*.so
if ! { "$CMAKE" -S "$ROOT/salabatch/engine/native" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE="$PY" -DMLX_DIR="$MLX_DIR" -Dnanobind_DIR="$NB_DIR" \
        -DSALABATCH_MLX_VERSION="$MLX_VERSION" &&
       "$CMAKE" --build "$BUILD" -j 2; } >>"$LOG" 2>&1; then
    tail -n 20 "$LOG" >&2
    echo "native kernels: build failed, log in $LOG" >&2
    exit 1
fi
cp "$BUILD"/_native*.so "$ROOT/salabatch/engine/kernels/"
echo "native kernels: built $(basename "$ROOT"/salabatch/engine/kernels/_native*.so)"
