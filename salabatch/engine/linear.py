"""The model's linear layers: `nn.Linear`, whose float32 products of a few rows on the CPU (a
decode step's batch) go to the native `rows_matmul` instead of BLAS.

OpenBLAS packs the whole weight matrix for every float32 matmul of 2+ rows; at a decode batch
of 8 that costs several times the arithmetic (benchmarks/README.md). The native product reads
the weights as they lie and splits a large one between the cores, which also makes it ~1.6×
BLAS's matrix-vector product for one row; a small weight's one row stays on BLAS (as fast, no
hand-off). Longer inputs (prefill, training), other dtypes, quantized layers (`QuantizedLinear`
replaces this class) and a GPU stay on MLX's matmul. Same weights and names as `nn.Linear`:
checkpoints, quantization and training see no difference."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.kernels import native
from salabatch.engine.kernels.attention import on_gpu

# rows of x (all leading axes together) for which the native product is used
NATIVE_ROWS = range(1, 17)


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if not self._native(x):
            return super().__call__(x)
        w = self.weight
        K = x.shape[-1]
        y = native.rows_matmul(x.reshape(-1, K), w).reshape(*x.shape[:-1], w.shape[0])
        return y + self.bias if "bias" in self else y

    def _native(self, x: mx.array) -> bool:
        w = self.weight
        K = x.shape[-1]
        if x.dtype != mx.float32 or w.dtype != mx.float32 or K % 8 or on_gpu() or native.missing():
            return False
        rows = x.size // max(K, 1)
        return rows in NATIVE_ROWS and (rows > 1 or w.size >= native.split_floats())
