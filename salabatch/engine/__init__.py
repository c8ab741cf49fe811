"""The MiniCPM-SALA engine on MLX.

Importing it changes nothing in the process. On Linux CPU, call `activate_blas()` once before
anything imports `mlx.core` so MLX runs on an optimized BLAS (see `blas.py`); the `salabatch`
command does so at start, and `salabatch.load` before it loads a model.
"""

from salabatch.engine.blas import activate_blas


def __getattr__(name: str):
    # lazy: `load_model` imports mlx.core, which must come after `activate_blas()`
    if name == "load_model":
        from salabatch.engine.load import load_model

        return load_model
    raise AttributeError(f"module 'salabatch.engine' has no attribute {name!r}")


__all__ = ["activate_blas", "load_model"]
