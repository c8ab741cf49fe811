"""Answers scored against the ones a person expected: `salabatch inspect RESULTS --expected KEY`.

The key is a YAML mapping, document → question id → expected answer:

    contract-a.txt:
      supplier: Harbor Lane Ltd
      amount: "$12,400"

A document is named by its file name, by the end of its path ("q3/contract-a.txt") when two
folders hold the same name, or by its doc_id (a record of a .jsonl file). Every name must match
exactly one document of the results, and every question id must be one the results hold, or
the key is refused with the entry named; so is a name given twice in one mapping (with its
lines), which YAML would otherwise settle silently by keeping the last. An answer is right
when it equals the expected one up to case, spacing and the punctuation around it ("harbor lane
ltd." for "Harbor Lane Ltd"): what a model that answers with the value says.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from salabatch.errors import JobSpecError
from salabatch.jobs.spec.job_yaml import read_yaml

_EDGE_PUNCTUATION = " \t\n.,;:!?\"'`()[]"
_ANSWER_CHARS = 60


@dataclass(frozen=True)
class Scored:
    """One expected answer beside the one given."""

    document: str
    question_id: str
    expected: str
    answer: str | None  # None: the row failed (its error is the answer shown)
    error: str | None

    @property
    def right(self) -> bool:
        return self.answer is not None and normalize(self.answer) == normalize(self.expected)


def normalize(text: str) -> str:
    """Lower case, one space between words, no punctuation or quotes around the whole."""
    return " ".join(text.split()).strip(_EDGE_PUNCTUATION).casefold()


def read_answer_key(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """The key file as {document: {question_id: expected}}; JobSpecError naming the entry."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise JobSpecError(f"cannot read the answer key: {e.strerror or e}", path=path) from None
    except UnicodeDecodeError as e:
        reason = f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise JobSpecError(reason, path=path) from None
    raw, _, problems = read_yaml(text, path, as_text=True)  # `010` is "010", not 10
    if problems:
        # a key given twice: safe_load would keep the last answer silently, as in a job file
        raise JobSpecError("; ".join(problems), path=path)
    if not isinstance(raw, dict) or not raw:
        raise JobSpecError(
            "must map documents to {question id: expected answer}",
            path=path,
            got=type(raw).__name__,
        )
    key: dict[str, dict[str, str]] = {}
    for doc, answers in raw.items():
        if not isinstance(answers, dict) or not answers:
            raise JobSpecError(
                "must map question ids to expected answers", path=path, field=str(doc)
            )
        for qid, expected in answers.items():
            if isinstance(expected, (dict, list)) or expected is None:
                raise JobSpecError(
                    "an expected answer must be text or a number",
                    path=path,
                    field=f"{doc}.{qid}",
                    got=expected,
                )
        key[str(doc)] = {str(q): str(a) for q, a in answers.items()}
    return key


def score(table: pa.Table, key: dict[str, dict[str, str]], key_path: str | os.PathLike) -> list:
    """Every expected answer beside its row of `table`, in the key's order."""
    columns = ["doc_id", "doc_path", "question_id", "answer", "status", "error"]
    rows = table.select(columns).to_pylist()
    documents = dict(sorted((r["doc_id"], r["doc_path"]) for r in rows))
    question_ids = {r["question_id"] for r in rows}
    by_request = {(r["doc_id"], r["question_id"]): r for r in rows}
    scored = []
    for doc, answers in key.items():
        doc_id = _document(doc, documents, key_path)
        for qid, expected in answers.items():
            if qid not in question_ids:
                raise JobSpecError(
                    "no such question in the results",
                    path=key_path,
                    field=f"{doc}.{qid}",
                    expected=", ".join(sorted(question_ids)),
                    got=qid,
                )
            row = by_request.get((doc_id, qid))
            if row is None:  # a request the run has not reached (yet)
                scored.append(Scored(doc, qid, expected, None, "not answered yet"))
            elif row["status"] != "ok":
                scored.append(Scored(doc, qid, expected, None, row["error"] or row["status"]))
            else:
                scored.append(Scored(doc, qid, expected, row["answer"] or "", None))
    return scored


def report(scored: list[Scored]) -> str:
    """One line per expected answer (✓ or ✗, document, question, expected, given), then the
    count correct."""
    width_doc = max(len(s.document) for s in scored)
    width_q = max(len(s.question_id) for s in scored)
    lines = []
    for s in scored:
        given = s.answer if s.error is None else f"(error: {s.error})"
        lines.append(
            f"{'✓' if s.right else '✗'} {s.document:<{width_doc}}  {s.question_id:<{width_q}}  "
            f"expected {_quote(s.expected)}  got {_quote(given)}"
        )
    right = sum(s.right for s in scored)
    lines.append(f"{right} of {len(scored)} answers correct")
    return "\n".join(lines)


def _document(name: str, documents: dict[str, str], key_path: str | os.PathLike) -> str:
    """The doc_id of the one document `name` names: its doc_id, its path or the path's last
    components."""
    parts = Path(name).parts
    found = [d for d, p in documents.items() if Path(p).parts[-len(parts) :] == parts]
    if name in documents:  # a doc_id; ambiguous where its path's end names another document
        found = [name, *(d for d in found if d != name)]
    if len(found) == 1:
        return found[0]
    if not found:
        names = sorted({Path(p).name for p in documents.values()})
        known = ", ".join(names[:8]) + (" …" if len(names) > 8 else "")
        raise JobSpecError(
            "no document of the results has this name",
            path=key_path,
            field=name,
            expected=known or "a document (the results hold none)",
            got=name,
        )
    raise JobSpecError(
        f"names {len(found)} documents ({', '.join(found[:3])}): give more of the path or a doc_id",
        path=key_path,
        field=name,
    )


def _quote(text: str) -> str:
    flat = re.sub(r"\s+", " ", text).strip()
    if len(flat) > _ANSWER_CHARS:
        flat = flat[: _ANSWER_CHARS - 1] + "…"
    return f'"{flat}"'
