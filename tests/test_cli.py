"""The `salabatch` command: `validate` prints a summary of the job, or every mistake."""

from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner, Result

from salabatch.cli import main
from tests.jobs.test_spec import MINIMAL, write

EXAMPLE = Path(__file__).parents[1] / "jobs" / "example.yaml"


def validate(*args: str) -> Result:
    return CliRunner().invoke(main, ["validate", *args])


def test_validate_prints_a_summary_or_every_error(tmp_path, home):
    (tmp_path / "docs").mkdir()
    for name in ("a.md", "b.txt"):
        (tmp_path / "docs" / name).write_text("text")
    job = write(tmp_path, MINIMAL)
    result = validate(str(job), "--set", "engine.batch_size=2")
    assert result.exit_code == 0
    out = result.stdout.splitlines()
    assert out[0] == f"{job}: ok"
    assert "  documents  1 entry, 2 files" in out
    assert "  questions  1: q1" in out
    assert f"  output     {tmp_path / 'results' / 'mini.parquet'}" in out

    result = validate(str(job), "--set", "engine.batchsize=2", "--set", "generation.top_k=-1")
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {job}: 2 errors"
    assert lines[1].startswith("  generation.top_k: must be greater than or equal to 0, got -1")
    assert lines[2].startswith("  engine.batchsize: unknown field")

    result = validate(str(tmp_path / "none.yaml"))
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'none.yaml'}: job file not found\n"


def test_example_job_validates(tmp_path, home):
    result = validate(str(EXAMPLE), "--schema-only")
    assert result.exit_code == 0
    assert "contracts-review" in result.stdout
    # With its model and documents present, the file checks pass too.
    shutil.copy(EXAMPLE, tmp_path / "example.yaml")
    (tmp_path / "contracts" / "2024").mkdir(parents=True)
    (tmp_path / "contracts" / "2024" / "lease.pdf").write_bytes(b"%PDF-1.4")
    (home / "models" / "MiniCPM-SALA-8bit").mkdir(parents=True)
    (home / "models" / "MiniCPM-SALA-8bit" / "config.json").write_text("{}")
    result = validate(str(tmp_path / "example.yaml"))
    assert result.exit_code == 0
    assert "  documents  1 entry, 1 file" in result.stdout
