"""Writes the demo's documents and its answer key: four services agreements from the held-out
split of `salabatch.train.data` (company names, amount and date formats the model never saw in
training), as a .txt, a .md, a .pdf (one sentence per line, as PDF text often comes) and a long
.txt past the sparse threshold; `answers.yaml` holds each one's fields, the answers to the
demo job's questions. Deterministic: the same files every run.

    .venv/bin/python jobs/demo/make_docs.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

from salabatch.engine.tokenizer import load_tokenizer
from salabatch.models import resolve_model
from salabatch.train.data import EVAL, TaskGenerator

HERE = Path(__file__).parent
# (file suffix, generator index, prompt tokens); a file is named after the agreement's provider
DOCUMENTS = (
    (".txt", 4, 700),
    (".md", 9, 1200),
    (".pdf", 11, 900),
    ("-long.txt", 14, 6000),  # the sparse layers select blocks past 2048 tokens
)


def main() -> None:
    from make_pdf import pdf  # beside this file

    tokenizer = load_tokenizer(resolve_model("builtin:tiny"))
    generator = TaskGenerator(tokenizer, split=EVAL, seed=0, kinds=("contract",))
    key = {}
    docs = HERE / "docs"
    for old in docs.glob("*"):
        old.unlink()
    for suffix, index, tokens in DOCUMENTS:
        text, fields = generator.contract_document(index, tokens)
        name = fields["provider"].lower().replace(" ", "-") + suffix
        path = docs / name
        if path.suffix == ".pdf":
            lines = [
                line for paragraph in text.split("\n\n") for line in (*_sentences(paragraph), "")
            ]
            path.write_bytes(pdf(lines))
        else:
            path.write_text(text + "\n", encoding="utf-8")
        key[name] = fields
    header = "# The demo answer key (make_docs.py): document -> question id -> answer.\n"
    (HERE / "answers.yaml").write_text(header + yaml.safe_dump(key, sort_keys=False), "utf-8")


def _sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences, one per line (the generator's sentences end with '. ')."""
    parts = paragraph.replace("\n", " ").split(". ")
    return [p if p.endswith(".") else p + "." for p in parts]


if __name__ == "__main__":
    main()
