"""salabatch: batch question answering over long documents with MiniCPM-SALA on Apple MLX.

The Python API mirrors mlx-lm's (see `salabatch.api`): `load`, `generate`, `stream_generate`,
`batch_generate`, `choose` (answers among choices, with their probabilities) and `score` (a
text's token log-probabilities). Importing salabatch stays light (no MLX): they are looked up on
first use.
"""

from salabatch._version import __version__

_API = (
    "load",
    "generate",
    "stream_generate",
    "batch_generate",
    "choose",
    "score",
    "GenerationResponse",
)


def __getattr__(name: str):
    if name in _API:
        from salabatch import api

        return getattr(api, name)
    raise AttributeError(f"module 'salabatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["__version__", *_API]
