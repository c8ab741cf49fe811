"""The root command: what every command shares (here, a reader of its output that goes away)."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.cli.main import EXIT_BROKEN_PIPE
from tests.jobs.results.test_results import make_row, writer


def test_a_closed_pipe_ends_a_command_quietly(tmp_path):
    # Output well past a pipe's buffer, so the command is still writing when the reader goes.
    path = tmp_path / "results.parquet"
    with writer(path) as out:
        out.write([make_row(f"d{i}.q", answer="x" * 4000) for i in range(500)])
    command = [sys.executable, "-m", "salabatch.cli", "export", str(path), "--format", "jsonl"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline().startswith(b'{"run_id": "run-1"')
    child.stdout.close()  # as `| head -1` does
    assert child.wait(timeout=60) == EXIT_BROKEN_PIPE == 141
    assert child.stderr.read() == b""  # no `error: BrokenPipeError`, no `Exception ignored`


def test_every_command_ends_quietly_on_a_closed_pipe(monkeypatch):
    @click.command()
    def talk() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(main.commands, "talk", talk)
    result = CliRunner().invoke(main, ["talk"])
    assert result.exit_code == EXIT_BROKEN_PIPE and result.output == ""


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "builtin:tiny", "hi", "--temp", "nan"],
        ["generate", "builtin:tiny", "hi", "--top-p", "nan"],
        ["generate", "builtin:tiny", "hi", "--temp", "inf"],
        ["cache", "prune", "--max-gb", "nan"],
        ["serve", "--model", "builtin:tiny", "--prefix-memory", "inf"],
        ["chat", "--model", "builtin:tiny", "--temp", "nan"],
    ],
)
def test_float_options_refuse_nan_and_infinity_before_anything_runs(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "is not a finite number" in result.output, result.output


@pytest.mark.parametrize("terminated", [False, True])
def test_ctrl_c_or_sigterm_while_a_command_starts_exits_130_or_143(monkeypatch, terminated):
    """A signal before the command's own handling (reading the job, loading the model) ended
    in click's "Aborted!" and exit 1, or for SIGTERM the bare signal."""
    import os
    import signal

    @click.command()
    def starting() -> None:
        if terminated:
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    monkeypatch.setitem(main.commands, "starting", starting)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(main, ["starting"])
    assert result.exit_code == (143 if terminated else 130)
    assert result.output.strip() == ("terminated (SIGTERM)" if terminated else "interrupted")
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_ctrl_c_while_salabatch_run_reads_its_job_exits_130(monkeypatch, tmp_path):
    from salabatch.jobs.spec import load

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(load, "read_job", interrupted)
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml")])
    assert result.exit_code == 130 and "Aborted" not in result.output
