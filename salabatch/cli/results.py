"""`salabatch inspect` and `salabatch export`: a results file for people and for other tools.
Like every command group, nothing heavy is imported until a command runs."""

from __future__ import annotations

import sys

import click

from salabatch.cli.main import Finite
from salabatch.plural import counted


@click.command()
@click.argument("results", type=click.Path())
@click.option(
    "--show",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also print the first N answers.",
)
@click.option(
    "--below",
    type=Finite(0, 1),
    default=None,
    help="Print the choices questions' answers less probable than P (every one, or the first "
    "N with --show): the answers to check by hand.",
    metavar="P",
)
@click.option(
    "--expected",
    type=click.Path(),
    help="An answer key (YAML: document -> question id -> answer): print each answer next to "
    "the expected one and the count correct.",
)
def inspect(results: str, show: int, below: float | None, expected: str | None) -> None:
    """Summarize a results file (or a folder of them, e.g. a Ray dataset): rows, errors,
    tokens, prefill and decode speed."""
    from salabatch.jobs.results import answer_key
    from salabatch.jobs.results.export import inspect_results
    from salabatch.jobs.results.read import read_results

    click.echo(inspect_results(results, show=show, below=below))
    if expected:
        key = answer_key.read_answer_key(expected)
        click.echo(
            "\nexpected answers\n"
            + answer_key.report(answer_key.score(read_results(results), key, expected))
        )


@click.command()
@click.argument("results", type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["openai-jsonl", "jsonl", "csv"]),
    help="openai-jsonl: OpenAI Batch output lines, joined on custom_id; jsonl: one flat JSON "
    "object per row, every column; csv: a header, then a record per row. Default: csv for an "
    "output ending in .csv, else openai-jsonl.",
)
@click.option(
    "-o",
    "--output",
    default="-",
    show_default=True,
    help="Output file (its suffix must fit the format: .jsonl or .csv; folders are made); - for "
    "stdout.",
)
def export(results: str, fmt: str | None, output: str) -> None:
    """Write results in another format: OpenAI Batch output lines, flat JSON lines or CSV."""
    from salabatch.jobs.results.export import export_format, export_results

    to_stdout = output == "-"
    fmt = fmt or export_format(None if to_stdout else output)
    n = export_results(results, sys.stdout if to_stdout else output, fmt)
    if not to_stdout:
        click.echo(f"{counted(n, 'row' if fmt == 'csv' else 'line')} -> {output}", err=True)
