"""The units of a Ray run, planned without a model or any text: the identity pass names every
document as reading it does; done documents make no unit; a worker plans a unit as the local
runner plans its documents. (No Ray here: tests/jobs/ray/test_ray.py runs the units.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from salabatch.errors import JobSpecError
from salabatch.jobs.ingest import documents
from salabatch.jobs.ingest.documents import (
    DocumentSource,
    identify_documents,
    iter_documents,
    read_documents,
)
from salabatch.jobs.ray.manifest import plan_manifest, unit_plans
from salabatch.jobs.run.prepare import JobSetup
from salabatch.jobs.spec.load import load_job
from tests import REPO
from tests.jobs.run.test_runner import QUESTIONS, SHARED_PDFS, write_docs, write_job

DEMO_DOCS = REPO / "jobs" / "demo" / "docs"


def awkward_sources(root: Path) -> list[DocumentSource]:
    """The demo documents, the shared PDFs (encrypted, scanned, broken ones among them), and
    what makes ids collide or fail: a jsonl file with good, bad and duplicate records, an
    empty file, the same name in two sources. Without ../shared beside the repo, no PDFs."""
    shutil.copytree(DEMO_DOCS, root / "demo")
    lines = [
        json.dumps({"id": "council-minutes.txt", "text": "an id that a file has too"}),
        json.dumps({"text": "no id"}),
        '{"id": "cut off',
        json.dumps({"id": {"nested": 1}, "text": "bad id"}),
        json.dumps({"id": "x", "body": "no text"}),
        json.dumps({"id": "x", "text": "x again"}),
    ]
    (root / "more").mkdir()
    (root / "more" / "records.jsonl").write_text("\n".join(lines) + "\n\n")
    (root / "more" / "empty.txt").write_bytes(b"")
    (root / "more" / "council-minutes.txt").write_text("the same name, another file")
    sources = [
        DocumentSource(root / "demo"),
        DocumentSource(root / "more" / "records.jsonl"),
        DocumentSource(root / "more", glob="*.txt"),
    ]
    if SHARED_PDFS.is_dir():
        shutil.copytree(SHARED_PDFS, root / "pdfs")
        sources.append(DocumentSource(root / "pdfs"))
    return sources


def test_the_identity_pass_names_documents_as_reading_them_does(tmp_path):
    sources = awkward_sources(tmp_path)
    read = list(iter_documents(sources))
    found = list(identify_documents(sources))
    assert [i for f in found for i in f.ids] == [(d.doc_id, d.sha256) for d in read]
    assert sum(d.doc_id.endswith("~2") for d in read) >= 2  # collisions were exercised
    # ... and a file's documents, read alone under those ids, are the documents read together
    assert [d for f in found for d in read_documents(f.file, f.ids)] == read


def test_the_identity_pass_extracts_no_text(tmp_path, monkeypatch):
    sources = awkward_sources(tmp_path)
    expected = list(identify_documents(sources))

    def refuse(*args):
        raise AssertionError("the identity pass extracted text")

    monkeypatch.setattr(documents, "read_pdf", refuse)
    monkeypatch.setattr(documents, "decode_text", refuse)
    assert list(identify_documents(sources)) == expected


def test_a_file_changed_after_it_was_listed_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("first version")
    (found,) = identify_documents([DocumentSource(tmp_path / "a.txt")])
    (tmp_path / "a.txt").write_text("second version")
    with pytest.raises(JobSpecError, match="changed since the run listed its documents"):
        read_documents(found.file, found.ids)


def setup_of(folder: Path, model: Path, **overrides) -> JobSetup:
    write_docs(folder)
    return JobSetup.of(load_job(write_job(folder, model, **overrides)))


def test_a_unit_per_file_largest_first_planned_as_the_local_runner_plans(tmp_path, tiny_model):
    setup = setup_of(tmp_path, tiny_model)
    manifest = plan_manifest(setup, frozenset())
    names = [Path(unit.file.file.path).name for unit in manifest.units]
    assert names == ["letter.pdf", "report.md", "notes.txt"]  # by size
    assert (manifest.documents, manifest.skipped, manifest.complete) == (3, 0, True)
    assert len(manifest.job_keys) == 9 and all(len(unit.rows) == 3 for unit in manifest.units)
    local = {plan.doc.doc_id: plan for plan in setup.planner(()).documents()}
    for unit in manifest.units:
        (plan,) = unit_plans(setup, unit)
        assert plan.doc == local[plan.doc.doc_id].doc
        assert plan.doc_prompt == local[plan.doc.doc_id].doc_prompt
        assert plan.rows == local[plan.doc.doc_id].rows


def test_done_rows_make_no_unit_and_a_new_question_only_its_rows(tmp_path, tiny_model):
    setup = setup_of(tmp_path, tiny_model)
    done = frozenset(plan_manifest(setup, frozenset()).job_keys)
    assert plan_manifest(setup, done).units == []
    more = [*QUESTIONS, {"id": "when", "text": "When?"}]
    setup = JobSetup.of(load_job(write_job(tmp_path, tiny_model, questions=more)))
    manifest = plan_manifest(setup, done)
    assert manifest.skipped == 9 and len(manifest.job_keys) == 12
    assert all([r.question_id for r in unit.rows] == ["when"] for unit in manifest.units)
    local = {p.doc.doc_id: p for p in setup.plans(setup.planner(done))}
    for unit in manifest.units:
        (plan,) = unit_plans(setup, unit)
        assert plan.rows == local[plan.doc.doc_id].rows
        assert plan.doc_prompt == local[plan.doc.doc_id].doc_prompt


def test_a_limit_cuts_the_job_and_leaves_it_incomplete(tmp_path, tiny_model):
    setup = setup_of(tmp_path, tiny_model)
    manifest = plan_manifest(setup, frozenset(), limit=4)
    assert sum(len(unit.rows) for unit in manifest.units) == 4 and not manifest.complete
    cut = min(manifest.units, key=lambda unit: len(unit.rows))
    (plan,) = unit_plans(setup, cut)
    assert [r.key for r in plan.rows] == [r.key for r in cut.rows]


def test_a_limit_that_ends_inside_the_last_file_leaves_it_incomplete(tmp_path, tiny_model):
    """9 rows in 3 files: --limit 8 keeps 2 of the last file's 3 rows, and the job is not
    done; --limit 9 is all of it."""
    setup = setup_of(tmp_path, tiny_model)
    assert not plan_manifest(setup, frozenset(), limit=8).complete
    assert plan_manifest(setup, frozenset(), limit=9).complete


def test_a_limit_counts_only_the_documents_it_keeps(tmp_path, tiny_model):
    """A .jsonl file's ten records travel as one unit: --limit 5 of one question each keeps
    five documents, not the file's ten."""
    docs = tmp_path / "docs"
    docs.mkdir()
    records = [json.dumps({"id": f"r{i}", "text": f"Record {i}: the Test."}) for i in range(10)]
    (docs / "records.jsonl").write_text("\n".join(records) + "\n")
    job = write_job(tmp_path, tiny_model, questions=[{"id": "river", "text": "Which river?"}])
    manifest = plan_manifest(JobSetup.of(load_job(job)), frozenset(), limit=5)
    assert (manifest.documents, manifest.complete) == (5, False)
