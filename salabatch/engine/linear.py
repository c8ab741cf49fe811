"""The model's linear layers: `nn.Linear`, whose float32 products of a few rows on the CPU (a
decode step's batch) go to the native `rows_matmul` instead of BLAS.

OpenBLAS packs the whole weight matrix for every float32 matmul of 2+ rows; at a decode batch
of 8 that costs several times the arithmetic (benchmarks/README.md). One row stays on BLAS (its
matrix-vector product does not pack), as do longer inputs (prefill, training), other dtypes,
quantized layers (`QuantizedLinear` replaces this class) and a GPU. Same weights and names as
`nn.Linear`: checkpoints, quantization and training see no difference."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.kernels import native
from salabatch.engine.kernels.attention import on_gpu

# rows of x (all leading axes together) for which the native product is used
NATIVE_ROWS = range(2, 17)


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight
        K = x.shape[-1]
        if (
            x.size // max(K, 1) not in NATIVE_ROWS
            or K % 8
            or x.dtype != mx.float32
            or w.dtype != mx.float32
            or on_gpu()
            or native.missing()
        ):
            return super().__call__(x)
        y = native.rows_matmul(x.reshape(-1, K), w).reshape(*x.shape[:-1], w.shape[0])
        return y + self.bias if "bias" in self else y
