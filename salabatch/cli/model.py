"""`salabatch generate`, `salabatch perplexity` and `salabatch convert`: one model, answering a
prompt, scoring documents, or quantized into a checkpoint. Like every command group, nothing
heavy is imported until a command runs."""

from __future__ import annotations

import math
import sys

import click

from salabatch.cli.main import (
    Finite,
    OutputFile,
    dtype_option,
    human_size,
    positional,
    prefill_chunk_option,
    speculation_options,
    status_line,
)
from salabatch.plural import counted


@click.command()
@click.argument("args", nargs=-1, metavar="[MODEL] [PROMPT]")
@click.option("--model", "model_opt", help="MODEL as an option (mlx-lm's spelling).")
@click.option("-p", "--prompt", "prompt_opt", help="PROMPT as an option; - reads standard input.")
@click.option("-m", "--max-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", "--temp", default=0.0, show_default=True, type=Finite(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=Finite(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--min-p", default=0.0, show_default=True, type=Finite(0, 1))
@click.option("--seed", default=0, show_default=True)
@click.option("--system", "--system-prompt", default=None, help="System prompt.")
@click.option(
    "--think/--no-think",
    default=False,
    show_default=True,
    help="Let the model reason in a <think> block first (shown), or pre-seed it empty.",
)
@dtype_option
@prefill_chunk_option
@speculation_options
def generate(
    args,
    model_opt,
    prompt_opt,
    max_tokens,
    temperature,
    top_p,
    top_k,
    min_p,
    seed,
    system,
    think,
    dtype,
    prefill_chunk,
    draft,
    num_draft_tokens,
    draft_layers,
) -> None:
    """Answer one PROMPT with MODEL (a checkpoint folder, a Hugging Face repo id, or
    builtin:tiny — a small demo model trained on synthetic contracts and facts), streamed,
    then print timings. mlx-lm's flags work too: --model, -p/--prompt, -m/--max-tokens, --temp,
    --system-prompt."""
    from salabatch.api import load
    from salabatch.engine.session import stream_answer
    from salabatch.models import model_note

    model, prompt = positional(
        args, ("MODEL", "PROMPT"), (model_opt, prompt_opt), "--model and --prompt"
    )
    if prompt == "-":
        data = click.get_binary_stream("stdin").read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise click.BadParameter(
                f"standard input is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})",
                param_hint="PROMPT",
            ) from None
    if note := model_note(model):
        click.echo(f"note: {note}", err=True)
    loaded, tok = load(model, dtype)

    def progress(done: int, total: int) -> None:
        """A prompt of more than one chunk: its prefill's progress until the first token."""
        if total > prefill_chunk:
            status_line("" if done == total else f"prefilling {done:,} of {total:,} prompt tokens")

    stats = stream_answer(
        loaded,
        tok,
        prompt,
        think=think,
        write=lambda text: click.echo(text, nl=False),
        system=system,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        prefill_chunk=prefill_chunk,
        draft=draft,
        num_draft_tokens=num_draft_tokens,
        draft_layers=draft_layers,
        prompt_progress_callback=progress if sys.stderr.isatty() else None,
    )
    click.echo()
    answer = counted(stats["completion_tokens"], "token")
    if stats["completion_tokens"] > 1:  # one token has no rate
        answer += f" at {stats['decode_tok_s']:.1f} tok/s"
    click.echo(
        f"prompt {stats['prompt_tokens']} tokens, prefill {stats['prefill_tok_s']:.1f} tok/s, "
        f"first token after {stats['ttft_s']:.2f} s, {answer} ({stats['finish_reason']})",
        err=True,
    )


@click.command("convert")
@click.argument("args", nargs=-1, metavar="[SRC] [DST]")
@click.option("--hf-path", "--model", "src_opt", help="SRC as an option (mlx-lm's spelling).")
@click.option("--mlx-path", "dst_opt", help="DST as an option (mlx-lm's spelling).")
@click.option(
    "--bits",
    "--q-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    help="Bits per weight (MLX affine).",
)
@click.option("-q", "--quantize", is_flag=True, help="Quantize; without --bits, to 4 bits.")
@click.option(
    "--head-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    help="Bits of lm_head when other than --bits (e.g. 8 beside a 4-bit body).",
)
@click.option(
    "--group-size",
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    default="64",
    show_default=True,
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Of the scales/biases and of the tensors left unquantized.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Overwrite a non-empty DST: its checkpoint files (weights, config.json, tokenizer "
    "files) are removed first; other files stay.",
)
@click.option("--max-shard-gb", type=Finite(min=0.01), default=5.0, show_default=True)
def convert_cmd(
    args: tuple[str, ...],
    src_opt: str | None,
    dst_opt: str | None,
    bits: str | None,
    quantize: bool,
    head_bits: str | None,
    group_size: str,
    dtype: str,
    force: bool,
    max_shard_gb: float,
) -> None:
    """Quantize the checkpoint SRC (a folder, a Hugging Face repo id or builtin:tiny) into the
    folder DST: MLX affine, every linear layer incl. lm_head. mlx-lm's flags work too:
    --hf-path, --mlx-path, -q, --q-bits, --q-group-size."""
    from salabatch.engine.quantize import convert
    from salabatch.models import resolve_model

    src, dst = positional(args, ("SRC", "DST"), (src_opt, dst_opt), "--hf-path and --mlx-path")
    if bits is None and not quantize:
        raise click.UsageError("give --bits (or --q-bits), or -q for 4 bits")
    s = convert(
        resolve_model(src),
        dst,
        bits=int(bits or 4),
        head_bits=int(head_bits) if head_bits else None,
        group_size=int(group_size),
        dtype=dtype,
        force=force,
        max_shard_bytes=int(max_shard_gb * 2**30),
        progress=sys.stderr.isatty(),  # a bar's redraws are noise in a log file
    )
    click.echo(
        f"{s['quantized']} tensors quantized, {s['kept']} kept; "
        f"{human_size(s['bytes_before'])} -> {human_size(s['bytes_after'])} "
        f"({s['ratio']:.3f} of the source, {s['ratio_vs_float32']:.3f} of float32); "
        f"{counted(len(s['files']), 'weight file')}, copied {', '.join(s['copied']) or 'nothing'}"
    )


@click.command()
@click.argument("model")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Score the first N tokens of each document (default: all, up to the model's context).",
)
@dtype_option
@prefill_chunk_option
@click.option(
    "--json",
    "json_path",
    default=None,
    type=OutputFile(stdout=True),
    help="Also write the figures as JSON to this file (-: to standard output, the table then to"
    " standard error).",
)
def perplexity(model, paths, max_tokens, dtype, prefill_chunk, json_path) -> None:
    """Score documents with MODEL: each document's negative log-likelihood per token and
    perplexity, and, over all of them, by how far into its document a token lies (does the
    model read the long context?). PATH: files, folders or globs, read as `salabatch run` reads
    documents (text, Markdown, PDF, JSON lines); a document that cannot be read or scored is
    reported and the others go on (exit 3 then), as is a PATH that names nothing to read.
    Special-token text in a document is text, as `run` reads it."""
    import json
    import sys
    import time

    from tqdm import tqdm

    from salabatch.api import load, score
    from salabatch.cli.main import EXIT_ERROR_ROWS
    from salabatch.errors import JobSpecError, SalabatchError
    from salabatch.jobs.ingest.documents import DocumentSource, expand_sources, iter_documents

    def show(line: str) -> None:  # the table; on stderr where stdout takes the JSON
        click.echo(line, err=json_path == "-")

    loaded, tok = load(model, dtype)
    context = loaded.config.context_length
    limit = min(max_tokens or context, context)
    # a text file is read as far as the tokens scored reach: a big one is cut, not refused
    sources, failed = [], 0
    for path in paths:  # a PATH that names nothing to read is its own error line
        source = DocumentSource(path, max_tokens=context, first_tokens=limit)
        try:
            expand_sources([source])
        except JobSpecError as e:
            failed += 1
            click.echo(f"error in {path}: {e.message}", err=True)
            continue
        sources.append(source)
    docs = iter_documents(sources)
    rows, positions = [], Positions()
    show(f"{'document':<40} {'tokens':>9} {'nll/token':>10} {'perplexity':>11} {'s':>7}")
    for doc in docs:
        try:
            if not doc.ok:
                raise SalabatchError(doc.error)
            ids = tok.encode(doc.text, add_bos=tok.add_bos_token, special=False)  # as run reads it
            if len(ids) > limit:
                # a text file is read only as far as --max-tokens reach: its length is unknown
                said = (
                    f"the first {limit:,} tokens (--max-tokens; the rest is not read)"
                    if limit < context
                    else f"the first {limit:,} of {len(ids):,} tokens (the model's context)"
                )
                click.echo(f"note: {doc.doc_id}: {said}", err=True)
                ids = ids[:limit]
            if len(ids) < 2:
                raise SalabatchError("fewer than two tokens: nothing to score")
            start = time.perf_counter()
            # a bar per document on a terminal (a 100K-token one takes minutes on a CPU)
            with tqdm(
                total=len(ids),
                desc=doc.doc_id[:30],
                unit="tok",
                leave=False,
                disable=not sys.stderr.isatty(),
            ) as bar:
                scores = score(
                    loaded,
                    tok,
                    ids,
                    prefill_chunk=prefill_chunk,
                    progress=lambda done, _: bar.update(done - bar.n),
                )
            nll = [-x.logprob for x in scores]
            seconds = time.perf_counter() - start
        except SalabatchError as e:
            failed += 1
            click.echo(f"error in document {doc.doc_id}: {e}", err=True)
            continue
        positions.add(nll)
        mean = sum(nll) / len(nll)
        rows.append(
            {
                "document": doc.doc_id,
                "tokens": len(ids),
                "scored": len(nll),  # all but the first: nll is their mean
                "nll": mean,
                "perplexity": math.exp(mean),
                "seconds": seconds,
            }
        )
        show(_ppl_line(doc.doc_id, len(ids), mean, seconds))
    report = {"model": model, "dtype": dtype, "documents": rows, "failed": failed}
    if rows:
        scored = sum(r["scored"] for r in rows)
        mean = sum(r["nll"] * r["scored"] for r in rows) / scored
        seconds = sum(r["seconds"] for r in rows)
        show(_ppl_line(f"all ({len(rows)})", sum(r["tokens"] for r in rows), mean, seconds))
        total = {"tokens": sum(r["tokens"] for r in rows), "scored": scored}
        report["total"] = total | {"nll": mean, "perplexity": math.exp(mean)}
        report["by_position"] = positions.rows()
        show("\nby position in the document (all documents):")
        for b in report["by_position"]:
            span = f"tokens {b['from']:,}–{b['to']:,}"
            show(f"  {span:<28} {b['tokens']:>9,} {b['nll']:>10.4f} {b['perplexity']:>11.3f}")
    if json_path:
        text = json.dumps(report, indent=2) + "\n"
        if json_path == "-":
            sys.stdout.write(text)
        else:
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(text)
    if failed:
        sys.exit(EXIT_ERROR_ROWS)


def _ppl_line(name: str, tokens: int, nll: float, seconds: float) -> str:
    return f"{name:<40.40} {tokens:>9,} {nll:>10.4f} {math.exp(nll):>11.3f} {seconds:>7.1f}"


class Positions:
    """Negative log-likelihoods summed by where the scored token lies in its document: tokens
    1 to 1,024, then spans doubling (1,024–2,048, 2,048–4,096, ...), over many documents."""

    FIRST = 1024

    def __init__(self) -> None:
        self.sums: dict[int, list[float]] = {}  # span index → [count, sum]

    def add(self, nll: list[float]) -> None:
        """A document's scores: nll[i] is the token at position i + 1's."""
        for i, value in enumerate(nll):
            span = ((i + 1) // self.FIRST).bit_length()
            entry = self.sums.setdefault(span, [0, 0.0])
            entry[0] += 1
            entry[1] += value

    def rows(self) -> list[dict]:
        out = []
        for span in sorted(self.sums):
            count, total = self.sums[span]
            low = 1 if span == 0 else self.FIRST << (span - 1)
            high = self.FIRST << span
            mean = total / count
            out.append(
                {
                    "from": low,
                    "to": high,
                    "tokens": count,
                    "nll": mean,
                    "perplexity": math.exp(mean),
                }
            )
        return out
