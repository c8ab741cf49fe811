"""The `salabatch` command: `validate` prints a summary of the job or checkpoint folder, or every
mistake; `generate` and `convert` take mlx-lm's spellings of their arguments."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from salabatch.cli import main
from salabatch.engine.checkpoint import read_weights, write_weights
from salabatch.engine.config import ModelConfig
from salabatch.engine.quantize import BITS, GROUP_SIZES
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


# -- checkpoint folders, and mlx-lm's spellings of generate and convert ----------------------


@pytest.fixture(scope="module")
def xdg_cache(tmp_path_factory) -> Path:
    """A cache folder ($XDG_CACHE_HOME) holding builtin:random (an untrained test model)."""
    root = tmp_path_factory.mktemp("xdg")
    resolve_model("builtin:random", root / "salabatch")
    return root


@pytest.fixture
def tiny(xdg_cache, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg_cache))
    return resolve_model("builtin:random")


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


def test_validate_a_quantized_checkpoint(tmp_path, tiny):
    result = convert("builtin:random", str(tmp_path / "q"), "--q-bits", "6", "--q-group-size", "32")
    assert result.exit_code == 0, result.output
    result = validate(str(tmp_path / "q"))
    assert result.exit_code == 0 and "6-bit, group size 32" in result.stdout


def convert(*args: str) -> Result:
    return CliRunner().invoke(main, ["convert", *args])


def test_convert_takes_mlx_lm_spellings(tmp_path, tiny):
    ours = convert(str(tiny), str(tmp_path / "a"), "--bits", "4")
    theirs = convert("--hf-path", str(tiny), "--mlx-path", str(tmp_path / "b"), "-q")
    assert ours.exit_code == theirs.exit_code == 0, theirs.output
    a, b = (ModelConfig.from_file(tmp_path / x).quantization for x in "ab")
    assert (a.bits, a.group_size) == (b.bits, b.group_size) == (4, 64)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()

    missing = convert(str(tiny), str(tmp_path / "c"))
    assert missing.exit_code == 2 and "-q for 4 bits" in missing.output
    odd = convert(str(tiny), str(tmp_path / "c"), "--q-bits", "7")
    assert odd.exit_code == 2 and "'7' is not one of" in odd.output
    # The CLI lists what quantize.py supports (it cannot import it: MLX).
    options = {p.name: p for p in main.commands["convert"].params}
    assert list(options["bits"].type.choices) == [str(b) for b in BITS]
    assert list(options["head_bits"].type.choices) == [str(b) for b in BITS]
    assert list(options["group_size"].type.choices) == [str(g) for g in GROUP_SIZES]


def test_convert_head_bits(tmp_path, tiny):
    result = convert(str(tiny), str(tmp_path / "q"), "-q", "--head-bits", "8")
    assert result.exit_code == 0, result.output
    quant = ModelConfig.from_file(tmp_path / "q").quantization
    assert (quant.bits, quant.overrides) == (4, {"lm_head": {"group_size": 64, "bits": 8}})
    result = validate(str(tmp_path / "q"))
    assert result.exit_code == 0 and "4-bit, group size 64, 1 module(s) set apart" in result.stdout


def test_generate_takes_mlx_lm_spellings(tiny):
    def generate(*args: str, stdin: str | None = None) -> Result:
        result = CliRunner().invoke(main, ["generate", *args], input=stdin)
        assert result.exit_code == 0, result.output
        return result

    ours = generate("builtin:random", "Say hi.", "--max-tokens", "4", "--system", "Brief.")
    for args in (
        (
            "--model",
            "builtin:random",
            "--prompt",
            "Say hi.",
            "-m",
            "4",
            "--system-prompt",
            "Brief.",
        ),
        ("--model", "builtin:random", "Say hi.", "-m", "4", "--system", "Brief."),
        ("builtin:random", "-p", "Say hi.", "-m", "4", "--system", "Brief.", "--temp", "0"),
    ):
        assert generate(*args).stdout == ours.stdout, args
    piped = generate("builtin:random", "-", "-m", "4", "--system", "Brief.", stdin="Say hi.")
    assert piped.stdout == ours.stdout
    sampled = generate("builtin:random", "Say hi.", "-m", "4", "--temp", "0.9", "--min-p", "0.1")
    assert sampled.stdout.strip()

    for args, message in (
        (("builtin:random",), "give MODEL and PROMPT"),
        (("--model", "builtin:random", "a", "b"), "unexpected argument 'b'"),
    ):
        result = CliRunner().invoke(main, ["generate", *args])
        assert result.exit_code == 2 and message in result.output
