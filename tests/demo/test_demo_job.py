"""The demo job answers from its documents: every expected answer of jobs/demo/answers.yaml is in
its document as the pipeline reads it (PDF included), the questions are the held-out phrasings
of the answer key's fields, one document is past the sparse threshold, and make_docs.py writes
the same files again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from salabatch.jobs.ingest.documents import DocumentSource, iter_documents
from salabatch.jobs.results.answer_key import read_answer_key
from salabatch.jobs.spec.load import load_job
from salabatch.train.data import EVAL, TRAIN, split_pool
from salabatch.train.pools import CONTRACT_QUESTIONS, CONTRACT_TERMS
from tests import REPO

DEMO = REPO / "jobs"


@pytest.fixture(scope="module")
def documents() -> dict:
    docs = iter_documents([DocumentSource(str(DEMO / "demo" / "docs"))])
    return {Path(d.path).name: d for d in docs}


def test_every_expected_answer_is_in_its_document(documents):
    key = read_answer_key(DEMO / "demo" / "answers.yaml")
    assert sorted(key) == sorted(documents) and {Path(n).suffix for n in key} == {
        ".txt",
        ".md",
        ".pdf",
    }
    for name, answers in key.items():
        doc = documents[name]
        assert doc.error is None, doc.error
        for qid, answer in answers.items():
            assert answer in doc.text, (name, qid, answer)


def test_the_questions_are_held_out_phrasings_of_the_key_fields():
    spec = load_job(DEMO / "demo.yaml")
    key = read_answer_key(DEMO / "demo" / "answers.yaml")
    asked = {q.id: q.text for q in spec.questions}
    assert all(set(answers) == set(asked) for answers in key.values())
    for field, text in asked.items():
        assert text in _phrasings(field, EVAL)
        assert text not in _phrasings(field, TRAIN)


def _phrasings(field: str, split: str) -> set[str]:
    return {
        q.format(term=term)
        for q in split_pool(CONTRACT_QUESTIONS, split)
        for term in CONTRACT_TERMS[field]
    }


def test_one_document_is_past_the_sparse_threshold(documents, tmp_path_factory):
    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.models import resolve_model

    tokenizer = load_tokenizer(resolve_model("builtin:random", tmp_path_factory.mktemp("models")))
    lengths = [len(tokenizer.encode(d.text)) for d in documents.values()]
    assert max(lengths) > 4096 and min(lengths) < 2048


def test_make_docs_writes_the_same_files(tmp_path):
    copy = tmp_path / "demo"
    shutil.copytree(DEMO / "demo", copy)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # the builtin tokenizer's
    subprocess.run([sys.executable, "make_docs.py"], cwd=copy, check=True, env=env)
    for path in sorted((DEMO / "demo").rglob("*")):
        if path.is_file() and path.suffix != ".py":
            assert (copy / path.relative_to(DEMO / "demo")).read_bytes() == path.read_bytes(), path
    assert yaml.safe_load((copy / "answers.yaml").read_text())
