"""The `salabatch` command. Thin: each command imports what it needs (MLX included) when it runs,
so `salabatch --help` stays instant."""

from __future__ import annotations

import os
import sys

import click

from salabatch import __version__
from salabatch.errors import SalabatchError


class _Group(click.Group):
    """Loads the BLAS first; prints a SalabatchError as one line (no traceback) and exits with
    its code."""

    def invoke(self, ctx: click.Context):
        # Before any command can import mlx.core: the BLAS swap only works before that import.
        from salabatch.engine.blas import activate

        activate()
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
    from salabatch.engine import builtin
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
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a job field, e.g. engine.batch_size=4 (repeatable).",
)
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

        show_plan(spec, resume=resume, echo=click.echo)
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
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a job field, e.g. engine.batch_size=4 (repeatable).",
)
@click.option(
    "--schema-only",
    is_flag=True,
    help="Skip checking that the model, documents and requests exist.",
)
def validate(job: str, overrides: tuple[str, ...], schema_only: bool) -> None:
    """Check a job file; errors name their field and line. Exit code 2 on errors."""
    from salabatch.jobs.spec import validate_command

    sys.exit(validate_command(job, overrides, check_files=not schema_only))


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
        f"{_size(s['bytes_before'])} -> {_size(s['bytes_after'])} "
        f"({s['ratio']:.3f} of the source, {s['ratio_vs_float32']:.3f} of float32); "
        f"{len(s['files'])} weight file(s), copied {', '.join(s['copied']) or 'nothing'}"
    )


@main.group()
def cache() -> None:
    """The prefix cache store: saved document prefixes and prefill snapshots."""


_cache_dir = click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    help="Store folder (default: ~/.cache/salabatch, the jobs' default cache.dir).",
)


def _store(root: str | None):
    from salabatch.engine.builtin import default_cache_dir
    from salabatch.jobs.prefix_store import PrefixStore

    return PrefixStore(root or default_cache_dir())


@cache.command("ls")
@_cache_dir
def cache_ls(root: str | None) -> None:
    """List stored prefixes and snapshots: size, tokens, model, dtype, age."""
    import time

    entries = _store(root).entries()
    if not entries:
        click.echo("no stored prefixes")
        return
    click.echo(
        f"{'digest':14s} {'kind':8s} {'size':>9s} {'tokens':>15s} {'dtype':9s} "
        f"{'last used':>10s}  model"
    )
    now = time.time()
    for e in entries:
        tokens = f"{e.tokens}" if e.kind == "prefix" else f"{e.tokens}/{e.total_tokens}"
        click.echo(
            f"{e.digest[:12]:14s} {e.kind:8s} {_size(e.bytes):>9s} {tokens:>15s} "
            f"{e.dtype:9s} {_age(now - e.last_used):>10s}  {e.model}"
        )
    total = sum(e.bytes for e in entries)
    click.echo(f"{len(entries)} entries, {_size(total)}")


@cache.command("prune")
@_cache_dir
@click.option("--max-gb", type=click.FloatRange(min=0), help="Keep at most this much (LRU).")
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    metavar="DAYS",
    help="Remove entries unused for this many days.",
)
def cache_prune(root: str | None, max_gb: float | None, older_than: float | None) -> None:
    """Remove least recently used entries over a size, or entries unused for a while."""
    if max_gb is None and older_than is None:
        raise click.UsageError("give --max-gb and/or --older-than")
    removed = _store(root).prune(
        max_bytes=None if max_gb is None else int(max_gb * 2**30),
        older_than_s=None if older_than is None else older_than * 86400,
    )
    click.echo(f"removed {len(removed)} entries, {_size(sum(e.bytes for e in removed))}")


@cache.command("clear")
@_cache_dir
@click.option("--yes", is_flag=True, help="Do not ask.")
def cache_clear(root: str | None, yes: bool) -> None:
    """Remove every stored prefix and snapshot."""
    store = _store(root)
    if not yes:
        click.confirm(f"remove every stored prefix in {store.root}?", abort=True)
    click.echo(f"freed {_size(store.clear())}")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f} {unit}"
    return f"{seconds:.0f} s"


@main.group()
def bench() -> None:
    """Benchmarks; each prints its results as JSON (and writes them with --out)."""


def _emit(name: str, result: dict, out: str | None) -> None:
    import json

    from salabatch.bench import environment

    text = json.dumps({"bench": name, **environment(), **result}, indent=2)
    click.echo(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


@bench.command("sparse")
@click.option(
    "--contexts",
    default="8192,32768,131072",
    show_default=True,
    help="Context lengths for the decode timing, comma-separated.",
)
@click.option(
    "--prefill-tokens",
    default=65536,
    show_default=True,
    help="Tokens of the chunked prefill whose peak memory is measured (0: skip).",
)
@click.option("--chunk", default=2048, show_default=True, help="Prefill chunk size.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_sparse(contexts: str, prefill_tokens: int, chunk: int, out: str | None) -> None:
    """InfLLM-v2: sparse-layer decode time vs context, and chunked-prefill peak memory."""
    from salabatch.bench import sparse

    sizes = [int(c) for c in contexts.split(",") if c.strip()]
    _emit("sparse", sparse.run(sizes, prefill_tokens, chunk), out)


@bench.command("prefix")
@click.option("--doc-tokens", default=16384, show_default=True)
@click.option("--questions", default=8, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_prefix(doc_tokens: int, questions: int, max_tokens: int, out: str | None) -> None:
    """Prefix store on builtin:tiny: questions over one document, re-prefilled per question vs
    prefilled once (stored) and answered as one batch, then a second run from disk."""
    from salabatch.bench import prefix

    _emit("prefix", prefix.run(doc_tokens, questions, max_tokens), out)


@bench.command("quant")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--layers", default=8, show_default=True)
@click.option("--prefill", default=32, show_default=True)
@click.option("--steps", default=16, show_default=True)
@click.option("--formats", default="float32,bfloat16,8bit,4bit", show_default=True)
@click.option(
    "--act-dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_quant(
    hidden: int,
    layers: int,
    prefill: int,
    steps: int,
    formats: str,
    act_dtype: str,
    out: str | None,
) -> None:
    """Decode tok/s and memory of float32 / bf16 / 8-bit / 4-bit weights on a random model."""
    from salabatch.bench import quant

    chosen = tuple(f.strip() for f in formats.split(",") if f.strip())
    _emit("quant", quant.run(hidden, layers, prefill, steps, chosen, act_dtype), out)


@bench.command("gla")
@click.option("--repeat", default=5, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def bench_gla(repeat: int, out: str | None) -> None:
    """Lightning kernels at the 9B's shape: 2048-token chunked prefill, decode steps."""
    from salabatch.bench import gla

    _emit("gla", gla.run(repeat), out)


if __name__ == "__main__":
    main()
