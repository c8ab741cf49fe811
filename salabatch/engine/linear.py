"""The model's linear layers: `nn.Linear`, whose float32 products of a few rows on the CPU (a
decode step's batch, a verify pass) go to the native `rows_matmul` instead of BLAS.

OpenBLAS packs the whole weight matrix for every float32 matmul of 2+ rows; at a decode batch
of 8 that costs several times the arithmetic (benchmarks/HISTORY.md). The native product reads
the weights as they lie and splits a large one between the cores, which also makes it ~1.6×
BLAS's matrix-vector product for one row; a small weight's one row stays on BLAS (as fast, no
hand-off). Longer inputs (prefill, training), other dtypes, quantized layers (`QuantizedLinear`
replaces this class) and a GPU stay on MLX's matmul. Same weights and names as `nn.Linear`:
checkpoints, quantization and training see no difference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from salabatch.engine.kernels import attention, native, norm_cuda, rows_cuda
from salabatch.engine.kernels.attention import on_gpu

# rows of x (all leading axes together) for which the native product is used: a decode batch,
# and a verify pass of drafted tokens (8 rows × 5 positions = 40; 8 × 9 at 8 drafts), where
# OpenBLAS's packing of the whole weight costs several times the product (10-16x at 24-128 rows
# on the 2-core VM, `bench spec`'s history in benchmarks/HISTORY.md)
NATIVE_ROWS = range(1, 129)


def product(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T, the one dispatcher of a float layer's product without bias: on CUDA with the
    rows kernel on (`rows_cuda`), a decode step's few rows stream the weight through it; else
    MLX's matmul (its matrix-vector kernel for one row on a GPU, BLAS on the CPU)."""
    if rows_cuda.available() and rows_cuda.supports(x, w):
        return rows_cuda.product(x, w)
    return x @ w.T


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if not self._native(x):
            return super().__call__(x) if "bias" in self else product(x, self.weight)
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


class Fused:
    """Linear layers that read one input, run as one matmul: what a decode step on a GPU wants
    (it pays per kernel). Their weights, and the scales and biases of quantized layers, become
    the rows of one buffer each, and every layer's own arrays are views of its rows: nothing is
    stored twice, and the layers load, save and run on their own as before.

    `arrays()` are the buffers, which a compiled step takes as inputs; `apply(x, arrays)` is the
    product, split per layer. New weights loaded into the layers make it stale: the model drops
    it then (`Model.update`)."""

    NAMES = ("weight", "scales", "biases", "bias")

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        first = self.layers[0]
        self.quant = (
            dict(group_size=first.group_size, bits=first.bits, mode=first.mode)
            if isinstance(first, nn.QuantizedLinear)
            else None
        )
        self.names = [n for n in self.NAMES if n in first]
        self.sizes = [layer.weight.shape[0] for layer in self.layers]
        self.buffers = [mx.concatenate([layer[n] for layer in self.layers]) for n in self.names]
        mx.eval(self.buffers)
        ends = list(itertools.accumulate(self.sizes))
        for layer, a, b in zip(self.layers, [0, *ends[:-1]], ends, strict=True):
            for name, buf in zip(self.names, self.buffers, strict=True):
                setattr(layer, name, buf[a:b])
        mx.eval([layer[n] for layer in self.layers for n in self.names])

    @staticmethod
    def fusable(layers: Sequence[nn.Module]) -> bool:
        """Layers of one kind, width, dtype, arrays and quantization (no per-layer bits)."""
        first = layers[0]
        kinds = {type(layer) for layer in layers}
        if len(kinds) != 1 or not kinds <= {Linear, nn.Linear, nn.QuantizedLinear}:
            return False

        def signature(layer: nn.Module) -> tuple:
            names = tuple(n for n in Fused.NAMES if n in layer)
            quant = (layer.group_size, layer.bits, layer.mode) if "scales" in layer else ()
            return names, layer.weight.shape[1], layer.weight.dtype, quant

        return all(signature(layer) == signature(first) for layer in layers)

    def arrays(self) -> tuple[mx.array, ...]:
        return tuple(self.buffers)

    def apply(self, x: mx.array, arrays: Sequence[mx.array]) -> list[mx.array]:
        """x [..., in] → each layer's output [..., out_i], views of one `product`."""
        y = self.product(x, arrays)
        ends = list(itertools.accumulate(self.sizes))
        return [y[..., a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]

    def product(self, x: mx.array, arrays: Sequence[mx.array]) -> mx.array:
        """x [..., in] → the layers' outputs side by side [..., Σ out_i]."""
        a = dict(zip(self.names, arrays, strict=True))
        if self.quant is not None:
            y = mx.quantized_matmul(
                x, a["weight"], a["scales"], a.get("biases"), transpose=True, **self.quant
            )
        elif "bias" in a:
            y = mx.addmm(a["bias"], x, a["weight"].T)
        else:
            y = product(x, a["weight"])
        return y


def fuse(layers: Sequence[nn.Module]) -> Fused | None:
    """`Fused` of these layers where they can share buffers, else None (they run one by one)."""
    return Fused(layers) if Fused.fusable(layers) else None


def add_product(
    h: mx.array, layer: nn.Module, x: mx.array, scale: float, split_on_cuda: bool = False
) -> mx.array:
    """h + scale · layer(x) for a decode step's few rows x: one `addmm` for a float layer
    without bias (a GPU step pays per kernel; Metal runs an addmm of a few rows as its
    matrix-vector product with the add in the epilogue), the product then the sum otherwise.
    `split_on_cuda`: on CUDA the product then the sum too. MLX's CUDA backend runs an addmm of
    a few rows as a cuBLAS GEMM: for the MLP's down projection on an H100, 0.35-0.6x as fast as
    its own product of the same rows, where one add costs a kernel (benchmarks/HISTORY.md). Where
    the rows kernel takes the product (`rows_cuda`), it is plain too, through that kernel."""
    plain = isinstance(layer, nn.QuantizedLinear) or "bias" in layer
    through_rows = not plain and rows_cuda.available() and rows_cuda.supports(x, layer.weight)
    if plain or (split_on_cuda and attention.on_cuda()) or through_rows:
        return h + scale * layer(x)
    return mx.addmm(h, x, layer.weight.T, alpha=scale)


def add_product_norm(
    h: mx.array,
    layer: nn.Module,
    x: mx.array,
    scale: float,
    norm: nn.RMSNorm,
    split_on_cuda: bool = False,
) -> tuple[mx.array, mx.array]:
    """(h + scale · layer(x), `norm` of it): a decode step's residual add and the norm that
    reads it next. On CUDA with its kernel on (`norm_cuda`), the plain product (an `addmm` of
    a few rows is a slower GEMM there) then one launch for the add and the norm; else
    `add_product` (`split_on_cuda` as it takes it), then the norm."""
    if norm_cuda.available() and norm_cuda.supports(h):
        return tuple(norm_cuda.add_rms_norm(h, layer(x), scale, norm.weight, norm.eps))
    h = add_product(h, layer, x, scale, split_on_cuda)
    return h, norm(h)
