"""The `salabatch` command. Thin: each command imports what it needs (MLX included) when it runs,
so `salabatch --help` stays instant."""

from __future__ import annotations

import os
import sys

import click

from salabatch import __version__
from salabatch.errors import JobValidationError, SalabatchError


class _Group(click.Group):
    """Loads the BLAS first; prints a SalabatchError as one line (no traceback) and exits with
    its code."""

    def invoke(self, ctx: click.Context):
        # Before any command can import mlx.core: the BLAS swap only works before that import.
        from salabatch.engine import activate_blas

        activate_blas()
        try:
            return super().invoke(ctx)
        except SalabatchError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="salabatch")
def main() -> None:
    """Answer questions over long documents with MiniCPM-SALA on MLX."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Show MLX version, device, active BLAS and measured matmul speed (about 1 s)."""
    import json

    from salabatch.engine.runtime import doctor_report

    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    b = report["blas"]
    for key in ("salabatch", "python", "platform", "mlx", "device"):
        click.echo(f"{key:10s} {report[key]}")
    click.echo(f"{'blas':10s} {b['kind']}, {b['threads'] or '?'} threads, {b['path'] or '-'}")
    click.echo(f"{'':10s} ({b['reason']})")
    click.echo(f"{'gemm':10s} {report['gemm_gflops']:.1f} GFLOP/s (fp32 1024x1024)")
    click.echo(f"{'decode':10s} {report['decode_gbps']:.1f} GB/s (fp32 [1,4096] @ [4096,4096]^T)")


@main.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--seed", default=0, show_default=True)
@click.option("--system", default=None, help="System prompt.")
@click.option(
    "--think/--no-think",
    default=False,
    show_default=True,
    help="Let the model reason in a <think> block first (shown), or pre-seed it empty.",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
)
@click.option("--prefill-chunk", default=2048, show_default=True, type=click.IntRange(min=16))
def generate(
    model, prompt, max_tokens, temperature, top_p, top_k, seed, system, think, dtype, prefill_chunk
) -> None:
    """Answer one PROMPT with MODEL (a checkpoint folder, or builtin:tiny — an untrained demo
    model whose text is meaningless), streamed, then print timings."""
    from salabatch.demo import builtin
    from salabatch.engine.session import stream_answer

    if builtin.is_builtin(model):
        click.echo(f"note: {builtin.WARNING}", err=True)
    stats = stream_answer(
        model,
        prompt,
        system=system,
        think=think,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        dtype=dtype,
        prefill_chunk=prefill_chunk,
        write=lambda text: click.echo(text, nl=False),
    )
    click.echo()
    click.echo(
        f"prompt {stats['prompt_tokens']} tokens, prefill {stats['prefill_tok_s']:.1f} tok/s, "
        f"first token after {stats['ttft_s']:.2f} s, {stats['completion_tokens']} tokens at "
        f"{stats['decode_tok_s']:.1f} tok/s ({stats['finish_reason']})",
        err=True,
    )


_overrides = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a job field, e.g. engine.batch_size=4 (repeatable).",
)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False), required=False)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Results file (default: the job's output.path).",
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
    help="Show documents, token counts, questions and the planned prefill; no weights.",
)
@click.option("--limit", type=click.IntRange(min=1), help="Produce at most N new rows.")
@_overrides
@click.option(
    "--requests",
    type=click.Path(dir_okay=False),
    help="An OpenAI Batch .jsonl of chat requests (with or instead of a job file).",
)
@click.option("--model", help="Model of a --requests run without a job file.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def run(
    job, output, resume, retry_errors, dry_run, limit, overrides, requests, model, progress
) -> None:
    """Run a job: every document × question, answers and timings to Parquet. Resumable: rerun
    the same command after a crash or Ctrl-C and finished rows are kept."""
    from salabatch.jobs.spec import load_job, requests_job

    if job:
        spec = load_job(job, overrides, requests=requests, output=output, check_files=True)
    elif requests:
        extra = [f"output.path={os.path.abspath(output)}"] if output else []
        spec = requests_job(requests, model, [*overrides, *extra])
    else:
        raise click.UsageError("give a JOB file, or --requests FILE")
    if dry_run:
        from salabatch.jobs.dry_run import dry_run as show_plan

        show_plan(spec, resume=resume, retry_errors=retry_errors, echo=click.echo)
        return
    from salabatch.jobs.runner import run_job

    summary = run_job(
        spec,
        resume=resume,
        retry_errors=retry_errors,
        limit=limit,
        progress=progress,
        echo=lambda m: click.echo(m, err=True),
    )
    click.echo(
        f"{summary.written} row(s) written ({summary.errors} errors), {summary.skipped} already "
        f"done, {summary.documents} document(s), {summary.seconds:.1f} s -> {summary.output}",
        err=True,
    )
    if summary.interrupted:
        click.echo("interrupted: finished rows are saved; run the same command to resume", err=True)
        sys.exit(130)
    click.echo(f"see: salabatch inspect {summary.output} --show 5", err=True)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@_overrides
@click.option(
    "--schema-only",
    is_flag=True,
    help="Skip checking that the model, documents and requests exist.",
)
def validate(job: str, overrides: tuple[str, ...], schema_only: bool) -> None:
    """Check a job file; errors name their field and line. Exit code 2 on errors."""
    from salabatch.jobs.spec import load_job, path_problems

    spec = load_job(job, overrides)
    problems, n_files = ([], None) if schema_only else path_problems(spec)
    if problems:
        raise JobValidationError(job, problems)

    entries = len(spec.documents)
    found = f", {n_files} file{'s' * (n_files != 1)}" if n_files is not None and entries else ""
    ids = [q.id for q in spec.questions]
    shown = ", ".join(ids[:10]) + (", …" if len(ids) > 10 else "")
    rows = {
        "name": spec.name,
        "model": spec.model,
        "documents": f"{entries} entr{'y' if entries == 1 else 'ies'}{found}",
        "questions": f"{len(ids)}" + (f": {shown}" if ids else ""),
        "requests": str(spec.requests) if spec.requests else "none",
        "output": str(spec.output.path),
    }
    click.echo(f"{job}: ok")
    for key, value in rows.items():
        click.echo(f"  {key:10s} {value}")


@main.command()
@click.argument("results", type=click.Path(dir_okay=False))
@click.option(
    "--show",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also print the first N answers.",
)
def inspect(results: str, show: int) -> None:
    """Summarize a results file: rows, errors, tokens, prefill and decode speed."""
    from salabatch.jobs.export import inspect_results

    click.echo(inspect_results(results, show=show))


@main.command()
@click.argument("results", type=click.Path(dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["openai-jsonl"]),
    default="openai-jsonl",
    show_default=True,
)
@click.option("-o", "--output", default="-", show_default=True, help="Output file; - for stdout.")
def export(results: str, fmt: str, output: str) -> None:
    """Write results in another format (OpenAI Batch output lines, joined on custom_id)."""
    from salabatch.jobs.export import export_results

    n = export_results(results, sys.stdout if output == "-" else output, fmt)
    if output != "-":
        click.echo(f"{n} lines -> {output}", err=True)


@main.command("convert")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--bits", type=click.Choice(["4", "8"]), required=True)
@click.option(
    "--group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Of the scales/biases and of the tensors left unquantized.",
)
@click.option("--force", is_flag=True, help="Overwrite a non-empty DST.")
@click.option("--max-shard-gb", type=click.FloatRange(min=0.01), default=5.0, show_default=True)
def convert_cmd(
    src: str, dst: str, bits: str, group_size: str, dtype: str, force: bool, max_shard_gb: float
) -> None:
    """Quantize a checkpoint (MLX affine, every linear layer incl. lm_head) into DST."""
    from salabatch.cli_tools import human_size
    from salabatch.engine.quantize import convert

    s = convert(
        src,
        dst,
        bits=int(bits),
        group_size=int(group_size),
        dtype=dtype,
        force=force,
        max_shard_bytes=int(max_shard_gb * 2**30),
    )
    click.echo(
        f"{s['quantized']} tensors quantized, {s['kept']} kept; "
        f"{human_size(s['bytes_before'])} -> {human_size(s['bytes_after'])} "
        f"({s['ratio']:.3f} of the source, {s['ratio_vs_float32']:.3f} of float32); "
        f"{len(s['files'])} weight file(s), copied {', '.join(s['copied']) or 'nothing'}"
    )


from salabatch.cli_tools import bench, cache  # noqa: E402  (after `main`: they use no MLX)

main.add_command(cache)
main.add_command(bench)


if __name__ == "__main__":
    main()
