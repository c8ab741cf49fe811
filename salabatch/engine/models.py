"""A model reference → a checkpoint folder on disk.

A reference is `builtin:NAME` (made locally on first use, see `salabatch.demo.builtin`) or a
checkpoint folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from salabatch.demo import builtin


def resolve_model(ref: str | os.PathLike, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint folder of `ref`; `cache_dir` holds builtin models (default: the cache)."""
    if builtin.is_builtin(ref):
        return builtin.resolve(ref, cache_dir)
    return Path(ref).expanduser()
