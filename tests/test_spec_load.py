"""Reading job files: not-a-job files, --set overrides, check_paths, salabatch validate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from salabatch.errors import JobSpecError
from salabatch.jobs.spec_check import JobValidationError, check_paths
from salabatch.jobs.spec_load import load_job, validate_command
from tests.test_spec import MINIMAL, error_of, write

EXAMPLE = Path(__file__).parents[1] / "jobs" / "example.yaml"


# ---- files that are not job files --------------------------------------------------------------


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    job = write(tmp_path, "name: x\nmodel: builtin:tiny\n  questions: [\n")
    with pytest.raises(JobSpecError) as info:
        load_job(job)
    assert str(info.value).startswith(f"{job}: invalid YAML at line 3, column 12:")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "expected a mapping (name:, model:, …) at the top, got a list"),
        ("just text\n", "expected a mapping (name:, model:, …) at the top, got 'just text'"),
        ("", "job file is empty"),
        ("# only a comment\n", "job file is empty"),
        ("!!python/object:os.system {}\n", "invalid YAML at line 1, column 1: could not determine"),
    ],
)
def test_not_a_job_mapping(tmp_path, text, message):
    job = write(tmp_path, text)
    with pytest.raises(JobSpecError) as info:
        load_job(job)
    assert str(info.value).startswith(f"{job}: {message}")


def test_missing_and_unreadable_job_files(tmp_path):
    with pytest.raises(JobSpecError, match="job file not found"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobSpecError, match="is a folder"):
        load_job(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(JobSpecError, match="not UTF-8 text: byte 0xe9 at offset 9"):
        load_job(tmp_path / "latin1.yaml")


# ---- --set overrides ---------------------------------------------------------------------------


def test_overrides_of_every_kind(tmp_path):
    job = write(tmp_path, MINIMAL.replace("[{text: Summarize.}]", "[{text: a}, {text: b}]"))
    spec = load_job(
        job,
        [
            "engine.batch_size=4",
            "generation.think=true",
            "generation.temperature=0.7",
            "name=renamed",
            "system=Answer briefly: no lists #1",
            "questions.0.text=first?",
            "questions[1].id='007'",
            "cache.snapshot_every=0",
            "documents=[{path: other, glob: '*.md'}]",
        ],
    )
    assert spec.engine.batch_size == 4 and spec.generation.think is True
    assert spec.generation.temperature == 0.7
    assert spec.name == "renamed" and spec.output.path == tmp_path / "results" / "renamed.parquet"
    assert spec.system == "Answer briefly: no lists #1"
    assert [(q.id, q.text) for q in spec.questions] == [("q1", "first?"), ("007", "b")]
    assert spec.cache.snapshot_every == 0
    assert spec.documents[0].path == tmp_path / "other" and spec.documents[0].glob == "*.md"


def test_override_errors_are_located(tmp_path):
    job = write(tmp_path, MINIMAL)
    assert error_of(job, ("engine.batch_size=four",)) == (
        "engine.batch_size: expected an integer, got 'four' (from the command line)"
    )
    assert error_of(job, ("engine.batchsize=4",)).startswith(
        "engine.batchsize: unknown field, did you mean 'batch_size'?"
    )


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("engine.batch_size", "expected key=value"),
        ("=4", "expected a dotted key"),
        ("engine..batch_size=4", "expected a dotted key"),
        ("questions[x].text=a", "expected a dotted key"),
        ("name.first=a", "name is 'mini', not a mapping or a list"),
        ("questions.text=a", "questions is a list: give an item number, e.g. questions[0]"),
        ("questions[3].text=a", "questions has 1 items (numbered from 0)"),
        ("documents=[{path: a", "invalid YAML value"),
    ],
)
def test_malformed_overrides_name_the_override(tmp_path, override, reason):
    error = error_of(write(tmp_path, MINIMAL), (override,))
    assert error.startswith(f"--set {override!r}: {reason}")


def test_overrides_do_not_leak_through_yaml_aliases(tmp_path):
    job = write(
        tmp_path,
        """\
        name: alias
        model: builtin:tiny
        documents: [{path: d}]
        questions:
          - &base {id: a, text: same}
          - *base
        """,
    )
    spec = load_job(job, ["questions[1].id=b"])
    assert [q.id for q in spec.questions] == ["a", "b"]


# ---- the disk: check_paths ---------------------------------------------------------------------


def test_check_paths_reports_every_entry_with_its_index(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    (tmp_path / "notes.docx").write_text("x")
    (tmp_path / "model").mkdir()
    job = write(
        tmp_path,
        """\
        name: paths
        model: model
        requests: missing.jsonl
        documents:
          - path: docs
          - path: nowhere
          - path: docs
            glob: "*.pdf"
        questions: [{text: q}]
        """,
    )
    assert check_paths(load_job(job)) == [
        f"model: no config.json in {tmp_path / 'model'} (expected a checkpoint folder)",
        f"requests: no such file: {tmp_path / 'missing.jsonl'} (expected a .jsonl file)",
        f"documents[1].path: document path does not exist: {tmp_path / 'nowhere'}",
        f"documents[2].path: no .txt .md .pdf .jsonl files match '*.pdf' in {tmp_path / 'docs'}",
    ]
    (tmp_path / "model" / "config.json").write_text("{}")
    fixed = load_job(job, ["documents=[{path: docs}, {path: notes.docx}]", "requests=null"])
    assert check_paths(fixed) == [
        "documents[1].path: unsupported file type .docx (supported: .txt .md .pdf .jsonl)"
    ]
    with pytest.raises(JobValidationError, match="documents\\[1\\].path: unsupported file type"):
        load_job(
            job, ["documents=[{path: docs}, {path: notes.docx}]", "requests=null"], check_files=True
        )


# ---- salabatch validate ------------------------------------------------------------------------


def test_validate_command_prints_a_summary_or_every_error(tmp_path, home, capsys):
    (tmp_path / "docs").mkdir()
    for name in ("a.md", "b.txt"):
        (tmp_path / "docs" / name).write_text("text")
    job = write(tmp_path, MINIMAL)
    assert validate_command(str(job), ("engine.batch_size=2",)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{job}: ok"
    assert "  documents  1 entry, 2 files" in out
    assert "  questions  1: q1" in out
    assert f"  output     {tmp_path / 'results' / 'mini.parquet'}" in out

    assert validate_command(str(job), ("engine.batchsize=2", "generation.top_k=-1")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == f"error: {job}: 2 errors"
    assert lines[1].startswith("  generation.top_k: must be greater than or equal to 0, got -1")
    assert lines[2].startswith("  engine.batchsize: unknown field")

    assert validate_command(str(tmp_path / "none.yaml"), ()) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'none.yaml'}: job file not found\n"


def test_example_job_validates(tmp_path, home, capsys):
    assert validate_command(str(EXAMPLE), (), check_files=False) == 0
    assert "contracts-review" in capsys.readouterr().out
    # With its model and documents present, the file checks pass too.
    shutil.copy(EXAMPLE, tmp_path / "example.yaml")
    (tmp_path / "contracts" / "2024").mkdir(parents=True)
    (tmp_path / "contracts" / "2024" / "lease.pdf").write_bytes(b"%PDF-1.4")
    (home / "models" / "MiniCPM-SALA-8bit").mkdir(parents=True)
    (home / "models" / "MiniCPM-SALA-8bit" / "config.json").write_text("{}")
    assert validate_command(str(tmp_path / "example.yaml"), ()) == 0
    assert "  documents  1 entry, 1 file" in capsys.readouterr().out
