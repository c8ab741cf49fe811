"""The MiniCPM-SALA engine on MLX.

The BLAS is swapped in first: MLX binds `cblas_sgemm` when `mlx.core` is first imported, and
every module below imports it (see `blas.py`).
"""

from salabatch.engine.blas import activate as _activate

_activate()


def __getattr__(name: str):
    # lazy, so `salabatch.engine.blas` can be imported without loading the model code
    if name == "load_model":
        from salabatch.engine.load import load_model

        return load_model
    raise AttributeError(f"module 'salabatch.engine' has no attribute {name!r}")


__all__ = ["load_model"]
