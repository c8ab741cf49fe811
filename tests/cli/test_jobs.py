"""`salabatch validate` prints a summary of the job or checkpoint folder, or every mistake."""

from __future__ import annotations

import shutil

from click.testing import CliRunner, Result

from salabatch.cli import main
from salabatch.engine.checkpoint import read_weights, write_weights
from salabatch.models import resolve_model
from tests import REPO
from tests.jobs.spec.test_spec import MINIMAL, write

EXAMPLE = REPO / "jobs" / "example.yaml"


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
    shaped = write(
        tmp_path,
        MINIMAL.replace(
            "questions: [{text: Summarize.}]",
            "questions: [{text: Who, json_schema: {type: object}}]",
        ),
        "shaped.yaml",
    )
    assert "  questions  1: q1 (JSON schema)" in validate(str(shaped)).stdout.splitlines()

    result = validate(str(job), "--set", "engine.batchsize=2", "--set", "generation.top_k=-1")
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {job}: 2 errors"
    assert lines[1].startswith("  generation.top_k: must be greater than or equal to 0, got -1")
    assert lines[2].startswith("  engine.batchsize: unknown field")

    numbered = write(tmp_path, MINIMAL + "2024: yes\n", "numbered.yaml")  # a key YAML reads as 2024
    (line,) = validate(str(numbered)).stderr.splitlines()
    assert line.startswith(f"error: {numbered}: 2024: unknown field (allowed: name, model,")
    assert line.endswith("(line 5)")

    result = validate(str(tmp_path / "none.yaml"))
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'none.yaml'}: job file not found\n"


def test_example_job_validates(tmp_path, home):
    result = validate(str(EXAMPLE), "--schema-only")
    assert result.exit_code == 0
    assert "contracts-review" in result.stdout
    assert "  questions  3: summary, parties, renews (one of 3)\n" in result.stdout
    # With its model and documents present, the file checks pass too.
    shutil.copy(EXAMPLE, tmp_path / "example.yaml")
    (tmp_path / "contracts" / "2024").mkdir(parents=True)
    (tmp_path / "contracts" / "2024" / "lease.pdf").write_bytes(b"%PDF-1.4")
    model = home / "models" / "MiniCPM-SALA-8bit"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    result = validate(str(tmp_path / "example.yaml"))  # the model folder is checked too
    assert result.exit_code == 2 and "model: " in result.output
    shutil.rmtree(model)
    shutil.copytree(resolve_model("builtin:random", tmp_path / "cache"), model)
    result = validate(str(tmp_path / "example.yaml"))
    assert result.exit_code == 0, result.output
    assert "  documents  1 entry, 1 file" in result.stdout
    (model / "tokenizer.json").unlink()
    result = validate(str(tmp_path / "example.yaml"))
    assert result.exit_code == 2 and "model: " in result.output and "tokenizer" in result.output


# -- checkpoint folders --------------------------------------------------------------------------


def test_validate_checks_a_checkpoint_folder(tmp_path, tiny):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    result = validate(str(folder))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"{folder}: ok"
    assert "  weights    1 file, " in result.stdout and "full precision" in result.stdout

    # Each problem on its own line: no tokenizer, a tensor the config does not imply.
    (folder / "tokenizer.json").unlink()
    weights = read_weights(folder)
    weights["model.extra.weight"] = weights["model.norm.weight"]
    write_weights(folder, weights)
    result = validate(str(folder))
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2
    assert "does not match config.json; unexpected: model.extra.weight" in lines[0]
    assert lines[1] == f"error: {folder}: missing tokenizer.json"

    (folder / "model.safetensors").unlink()
    assert "no *.safetensors files" in validate(str(folder)).stderr
    (folder / "config.json").unlink()
    assert "config.json: model config not found" in validate(str(folder)).stderr
    assert validate(str(folder), "--schema-only").exit_code == 2  # a job file's option
