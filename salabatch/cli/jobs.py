"""`salabatch run` and `salabatch validate`: a job, answered or checked (and a checkpoint folder,
checked). Like every command group, nothing heavy is imported until a command runs."""

from __future__ import annotations

import functools
import os
import shlex
import sys

import click

from salabatch.cli.main import (
    EXIT_ERROR_ROWS,
    EXIT_INTERRUPTED,
    EXIT_LIMITED,
    EXIT_TERMINATED,
    debug_enabled,
    human_size,
    sigterm_as_ctrl_c,
)
from salabatch.errors import JobValidationError
from salabatch.plural import counted

_overrides = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a job field, e.g. engine.batch_size=4 (repeatable).",
)


@click.command()
@click.argument("job", type=click.Path(dir_okay=False), required=False)
@click.option(
    "-o",
    "--output",
    metavar="PATH",  # checked with the job's output.path (a NUL byte would stop click.Path)
    help="Results file (default: the job's output.path): x.parquet, or x.jsonl for OpenAI Batch "
    "output lines in input order, its resumable results kept beside it in x.parquet.",
)
@click.option(
    "--resume/--no-resume",
    default=True,
    show_default=True,
    help="Skip rows the results file already has, or redo everything.",
)
@click.option("--retry-errors", is_flag=True, help="Redo rows that ended in an error.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Show documents, token counts, questions, the planned prefill and the predicted "
    "memory peak; loads no weights.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    help="Produce at most N new rows; the same command goes on with the next N (exit code 4 "
    "while rows of the job are left).",
)
@_overrides
@click.option(
    "--requests",
    type=click.Path(dir_okay=False),
    help="An OpenAI Batch .jsonl of chat, completions or responses requests (with or instead "
    "of a job file); without -o, "
    "its Batch output goes beside the results (x.parquet: x.jsonl).",
)
@click.option(
    "--model",
    help="The model (a folder, a Hub repo id or builtin:NAME) in place of the job's model (a "
    "folder is relative to the current directory); needed for --requests without a job file "
    "when the requests name none or several.",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="ray: across the machines of a Ray cluster, a document per model actor (needs "
    'pip install "salabatch[ray]").',
)
@click.option(
    "--address",
    metavar="auto|HOST:PORT",
    help="--executor ray: the cluster to join (default: start Ray on this machine).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="--executor ray: at most N model actors (default: one per salabatch_slot).",
)
def run(
    job,
    output,
    resume,
    retry_errors,
    dry_run,
    limit,
    overrides,
    requests,
    model,
    progress,
    executor,
    address,
    workers,
) -> None:
    """Run a job: every document × question and request line, answers and timings to Parquet
    (and, for an output ending in .jsonl, OpenAI Batch output lines written when the run ends).
    Resumable: rerun the same command after a crash or Ctrl-C and finished rows are kept."""
    from salabatch.jobs.spec.load import batch_output, check_paths, read_job, requests_job

    if executor == "local" and (address is not None or workers is not None):
        raise click.UsageError("--address and --workers are options of --executor ray")
    for option, value in (("--output", output), ("--requests", requests), ("--model", model)):
        if value is not None and not value.strip():  # not the current folder
            raise click.UsageError(f"{option} is empty")

    note = None
    if job:
        spec, note = read_job(
            job, overrides, requests=requests, output=output, model=model, documents=True
        )
    elif requests:
        spec, note = requests_job(requests, model, overrides, output=output)
    else:
        raise click.UsageError("give a JOB file, or --requests FILE")
    # `--requests` without `-o`: its OpenAI Batch output goes beside the results
    beside = requests is not None and output is None
    if problems := check_paths(spec, batch_beside=beside, note=note):
        raise JobValidationError(job or requests, problems)
    spec, jsonl = batch_output(spec, beside)
    if dry_run:
        from salabatch.jobs.run.dry_run import dry_run as show_plan

        show_plan(spec, resume=resume, retry_errors=retry_errors, limit=limit, echo=click.echo)
        return
    if executor == "ray":
        from salabatch.jobs.ray.executor import run_job_ray

        execute = functools.partial(run_job_ray, address=address, workers=workers)
    else:
        from salabatch.jobs.run.runner import run_job as execute
    with sigterm_as_ctrl_c() as terminated:
        summary = execute(
            spec,
            resume=resume,
            retry_errors=retry_errors,
            limit=limit,
            progress=progress,
            echo=lambda m: click.echo(m, err=True),
            debug=debug_enabled(),
            jsonl=jsonl,
        )
    requests = f", {counted(summary.requests, 'request line')}" if summary.requests else ""
    click.echo(
        f"{counted(summary.written, 'row')} written ({counted(summary.errors, 'error')}), "
        f"{summary.skipped} already done, {counted(summary.documents, 'document')}{requests}, "
        f"{summary.seconds:.1f} s -> {summary.output}",
        err=True,
    )
    if jsonl is not None and not summary.interrupted:
        click.echo(f"OpenAI Batch output -> {jsonl}", err=True)
    # --no-resume again would start over: what goes on is the same command without it
    again = "the same command" if resume else "the same command without --no-resume"
    if summary.interrupted:
        how = "terminated (SIGTERM)" if terminated else "interrupted"
        click.echo(f"{how}: finished rows are saved; run {again} to resume", err=True)
        sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)
    click.echo(f"see: salabatch inspect {shlex.quote(summary.output)} --show 5", err=True)
    if summary.failed:
        click.echo(
            f"the job has {counted(summary.failed, 'error row')}: fix the cause, then rerun "
            "with --retry-errors, which redoes error rows",
            err=True,
        )
    if summary.left:
        # Before the error rows' code: the job is not finished yet.
        click.echo(
            f"--limit {limit}: {counted(summary.left, 'row')} of the job left; run {again} "
            "for the next ones, or without --limit for all of them",
            err=True,
        )
        sys.exit(EXIT_LIMITED)
    if summary.failed:
        sys.exit(EXIT_ERROR_ROWS)


@click.command()
@click.argument("job", metavar="PATH", type=click.Path())
@_overrides
@click.option(
    "--schema-only",
    is_flag=True,
    help="Skip checking that the model, documents and requests exist.",
)
def validate(job: str, overrides: tuple[str, ...], schema_only: bool) -> None:
    """Check a job file (errors name their field and line), or a checkpoint folder (config,
    tokenizer, and the weight files' tensors against the config, from their headers). Exit
    code 2 on errors."""
    if os.path.isdir(job):
        if overrides or schema_only:
            raise click.UsageError("--set and --schema-only are for a job file, not a folder")
        _validate_checkpoint(job)
        return
    from salabatch.jobs.spec.errors import render_loc
    from salabatch.jobs.spec.load import path_problems, read_job

    spec, note = read_job(job, overrides, documents=not schema_only)
    problems, files = ([], None) if schema_only else path_problems(spec, note=note)
    if not schema_only and not any(p.startswith("model:") for p in problems):
        where = note(("model",))
        problems = [f"model: {p}{where}" for p in _model_problems(spec.model)] + problems
    if problems:
        raise JobValidationError(job, problems)

    sources = spec.sources()
    for file in files or []:  # not mistakes of the job: the run makes them error rows
        if file.unread is not None:
            loc = ("documents", sources.index(file.source), "path")
            click.echo(
                f"warning: {render_loc(loc)}: {file.path}: {file.unread}{note(loc)}; the run "
                "makes it an error row",
                err=True,
            )
    entries = len(spec.documents)
    n_files = None if files is None else len(files)
    found = f", {counted(n_files, 'file')}" if n_files is not None and entries else ""
    ids = [_question_label(q) for q in spec.questions]
    shown = ", ".join(ids[:10]) + (", …" if len(ids) > 10 else "")
    rows = {
        "name": spec.name,
        "model": spec.model,
        "documents": f"{counted(entries, 'entry', 'entries')}{found}",
        "questions": f"{len(ids)}" + (f": {shown}" if ids else ""),
        "requests": str(spec.requests) if spec.requests else "none",
        "output": str(spec.output.path),
    }
    click.echo(f"{job}: ok")
    for key, value in rows.items():
        click.echo(f"  {key:10s} {value}")


def _question_label(q) -> str:
    """A question's id, with what its answers must be where it says (`validate`'s summary)."""
    if q.json_schema is not None:
        return f"{q.id} (JSON schema)"
    return q.id if q.choices is None else f"{q.id} (one of {len(q.choices)})"


def _model_problems(model: str) -> list[str]:
    """`validate` of a job's model, when it is a checkpoint folder here (a builtin model is made
    and a Hub id fetched when the job runs): the problems of its files, as `validate FOLDER`
    checks them."""
    from salabatch.engine.load import check_checkpoint
    from salabatch.models import is_builtin

    if is_builtin(model) or not os.path.isdir(os.path.expanduser(model)):
        return []
    return check_checkpoint(model).problems


def _validate_checkpoint(path: str) -> None:
    """`validate` of a checkpoint folder: each problem on one line (exit 2), else a summary."""
    from salabatch.engine.load import check_checkpoint

    report = check_checkpoint(path)
    for problem in report.problems:
        click.echo(f"error: {problem}", err=True)
    if report.problems:
        sys.exit(2)
    cfg, tok, files = report.config, report.tokenizer, report.weight_files
    sparse, quant = len(cfg.sparse_layers), cfg.quantization
    rows = {
        "layers": f"{cfg.num_hidden_layers} ({sparse} sparse, "
        f"{cfg.num_hidden_layers - sparse} lightning)",
        "weights": f"{counted(len(files), 'file')}, "
        f"{human_size(sum(f.stat().st_size for f in files))}, "
        + (f"{quant.bits}-bit, group size {quant.group_size}" if quant else "full precision")
        + (
            f", {counted(len(quant.overrides), 'module')} set apart"
            if quant and quant.overrides
            else ""
        ),
        "tokenizer": f"{tok.vocab_size} tokens, stop ids {sorted(tok.eos_ids)}, "
        + ("its chat template" if tok.has_chat_template else "built-in ChatML"),
    }
    click.echo(f"{path}: ok")
    for key, value in rows.items():
        click.echo(f"  {key:10s} {value}")
