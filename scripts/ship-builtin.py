"""Ships a checkpoint written by `salabatch train` as `builtin:tiny`: its weights and config into
salabatch/demo/tiny/ (the config's note pointing at MODEL_CARD.md), with the tokenizer files of
builtin:random (the tokenizer every training run copies). MODEL_CARD.md is written by hand.

    .venv/bin/python scripts/ship-builtin.py /path/to/checkpoint
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from salabatch.demo import builtin

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main(source: Path) -> None:
    dest = builtin.SHIPPED
    dest.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["salabatch_note"] = builtin.NOTES["tiny"]
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(source / "model.safetensors", dest / "model.safetensors")
    tokenizer = builtin.checkpoint("random")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, dest / name)
    size = sum(f.stat().st_size for f in dest.iterdir()) / 2**20
    print(f"{dest}: {size:.1f} MB")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
