"""The builtin models, so everything runs with no download:

* `builtin:tiny`: a small MiniCPM-SALA trained by `salabatch train` on synthetic documents
  (contracts, key → value facts), shipped in the package (`salabatch/demo/tiny/`, with its
  MODEL_CARD.md). It answers questions of that kind from a document; it knows nothing else.
* `builtin:random`: the same architecture family with random (deterministic) weights, for tests
  and benchmarks: its text is meaningless. Both layer kinds are present and its sparse layers
  switch to InfLLM-v2 at 2048 tokens, so a document of a few thousand tokens exercises the real
  long-context path. Built once into `<cache dir>/models/builtin-random-v2/` (config.json,
  model.safetensors, tokenizer files), the same bytes on every machine. Where the cache dir
  cannot take it (read-only, full, no permission) it is built into a private temporary folder
  instead, removed when the process exits, with one warning (CacheWarning): a run never fails
  for its cache.

A reference `builtin:NAME` becomes one of these in `salabatch.models`, the one place that reads
model references; this module makes the folder of a NAME.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from salabatch import files
from salabatch.errors import CacheWarning, CheckpointError, error_text

MODELS = ("tiny", "random")
SHIPPED = Path(__file__).parent / "tiny"  # builtin:tiny's checkpoint folder
# Bump when the recipe of builtin:random changes: old builds stay where they are, unused.
# v2: the demo tokenizer is trained by tokenizers' BpeTrainer.
VERSION = 2
NOTES = {
    "tiny": "builtin:tiny is a 1.35M-parameter model trained on synthetic contracts and facts "
    "(salabatch/demo/tiny/MODEL_CARD.md): it answers only questions of that kind",
    "random": "builtin:random is an untrained test model: its answers are meaningless text",
}


def checkpoint(name: str, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint folder of the builtin model NAME (one of MODELS): the package's folder for
    tiny, random built (once) in `cache_dir` (default: the salabatch cache)."""
    if name == "tiny":
        if not (SHIPPED / "model.safetensors").is_file():
            raise CheckpointError(
                "builtin:tiny's weights are missing from this installation of salabatch "
                "(reinstall it)",
                path=SHIPPED,
            )
        return SHIPPED
    root = Path(cache_dir or files.cache_dir()).expanduser()
    dest = root / "models" / f"builtin-{name}-v{VERSION}"
    try:
        if not (dest / "model.safetensors").is_file():
            _build(dest)
        return dest
    except (OSError, RuntimeError) as e:  # MLX reports a failed write as a RuntimeError
        return _build_private(dest, error_text(e))


def _build_private(dest: Path, reason: str) -> Path:
    """Builds `dest`'s model into a temporary folder removed at exit, since the cache dir
    cannot take it (`reason`); CheckpointError if that fails too."""
    try:
        private = Path(tempfile.mkdtemp(prefix=f"salabatch-{dest.name}-"))
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        warnings.warn(
            f"{dest.parent}: cannot build the builtin model there ({reason}); "
            f"it is built in {private} instead, removed when this process ends",
            CacheWarning,
            stacklevel=3,
        )
        _build(private / dest.name)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(
            f"cannot build the builtin model here ({reason}) nor in a temporary folder "
            f"({error_text(e)})",
            path=dest.parent,
        ) from None
    return private / dest.name


def random_config(vocab_size: int, eos: list[int]) -> dict:
    """builtin:random's config: 6 layers (3 sparse), hidden 256, sparse from 2048 tokens."""
    from salabatch.demo.checkpoint import sala_config

    return sala_config(
        vocab=vocab_size,
        hidden=256,
        intermediate=640,
        layers=6,
        heads=8,
        kv_heads=2,
        head_dim=32,
        sparse_layers=(0, 3, 5),
        dim_model_base=16,  # logits ÷ 16, as in the 9B
        # 4 local blocks and 8 chosen: 12 blocks per query in all
        sparse={"window_size": 256, "topk": 8, "dense_len": 2048},
        eos=eos,
        note=NOTES["random"],
    )


def _build(dest: Path) -> None:
    """Writes the model into a private folder, then renames it into place (another process
    building at the same time loses the race harmlessly)."""
    from salabatch.demo.checkpoint import write_random_checkpoint
    from salabatch.demo.tokenizer import TAIL_TOKENS, build_byte_tokenizer

    tmp = files.temp_path(dest)
    tmp.mkdir(parents=True)
    try:
        vocab = build_byte_tokenizer(tmp, vocab_size=1024)
        im_end = vocab - len(TAIL_TOKENS)  # <|im_end|> is the first of the last 8 ids
        write_random_checkpoint(tmp, random_config(vocab, [2, im_end]))
        try:
            os.rename(tmp, dest)
        except OSError:  # someone else finished first
            if not (dest / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left there after the rename
