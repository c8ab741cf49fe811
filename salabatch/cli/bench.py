"""`salabatch doctor` and `salabatch bench …`: what this machine runs on and how fast; each
benchmark prints its results (and writes JSON with --out). Like every command group, nothing
heavy is imported until a command runs."""

from __future__ import annotations

from functools import partial

import click

from salabatch.cli.main import Finite, OutputFile


class NumberList(click.ParamType):
    """A comma-separated list of whole numbers, each at least `minimum` (empty entries are
    skipped, one number is needed); with `tokens`, `32K` means 32 × 1024. A bad entry is a usage
    error naming the option, before any model loads."""

    def __init__(self, name: str, *, tokens: bool = False, minimum: int = 1) -> None:
        self.name, self.tokens, self.minimum = name, tokens, minimum

    def convert(self, value, param, ctx) -> list[int]:
        if isinstance(value, list):  # a default already converted
            return value
        what = "token count" if self.tokens else "whole number"
        hint = " (K = 1024: 32K)" if self.tokens else ""
        numbers = []
        for item in (x.strip() for x in str(value).split(",")):
            if not item:
                continue
            number = _number(item.upper().removesuffix("K") if self.tokens else item)
            if number is not None and self.tokens and item.upper().endswith("K"):
                number *= 1024
            if number is None or number < self.minimum:
                self.fail(
                    f"{item!r}: expected a {what} of at least {self.minimum}{hint}", param, ctx
                )
            numbers.append(number)
        if not numbers:
            self.fail(f"expected at least one {what}{hint}, got nothing", param, ctx)
        return numbers


def _number(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


class NameList(click.ParamType):
    """A comma-separated list of names out of `choices` (empty entries skipped, one needed)."""

    def __init__(self, name: str, choices: tuple[str, ...]) -> None:
        self.name, self.choices = name, choices

    def convert(self, value, param, ctx) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        names = tuple(x.strip() for x in str(value).split(",") if x.strip())
        unknown = [n for n in names if n not in self.choices]
        if unknown or not names:
            got = f"{unknown[0]!r}" if unknown else "nothing"
            self.fail(f"{got}: expected some of {', '.join(self.choices)}", param, ctx)
        return names


class Depths(click.ParamType):
    """Needle depths in %: "10,50,90" or "A..B" (every 20 from A to B) → fractions."""

    name = "depths"

    def convert(self, value, param, ctx) -> list[float]:
        if isinstance(value, list):
            return value
        try:
            return _depths(value)
        except click.BadParameter as e:
            self.fail(e.message, param, ctx)


TOKENS = NumberList("contexts", tokens=True)  # context lengths: 8192,32K
COUNTS = NumberList("counts")  # batch sizes, actor counts
# What `bench spec` runs (salabatch.bench.spec and engine.speculative; kept here so that
# `--help` imports no MLX, and tests/cli/test_bench.py checks they agree).
SPEC_WORKLOADS = ("extraction", "free-form", "cost")
SPEC_DRAFTS = ("off", "lookup", "layers", "auto")
POSITIVE = click.IntRange(min=1)


@click.command()
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


@click.group()
def bench() -> None:
    """Benchmarks; each prints its results (and writes them as JSON with --out). Ctrl-C or
    SIGTERM stops one as it stops `salabatch run`: the servers it started stop, what it
    measured so far stays written (those that save as they go), and it exits 130 or 143."""


def _emit(name: str, result: dict, out: str | None) -> None:
    import json

    from salabatch.bench import environment

    result = {"bench": name, **environment(), **result}
    click.echo(json.dumps(result, indent=2))
    if out:
        _write_json(result, out)


@bench.command("sparse")
@click.option(
    "--contexts",
    default="8192,32768,131072",
    show_default=True,
    type=TOKENS,
    help="Context lengths for the decode timing, comma-separated; K = 1024.",
)
@click.option(
    "--prefill-tokens",
    default=65536,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens of the chunked prefill whose peak memory is measured (0: skip).",
)
@click.option("--chunk", default=2048, show_default=True, type=POSITIVE, help="Prefill chunk size.")
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
def bench_sparse(contexts: list[int], prefill_tokens: int, chunk: int, out: str | None) -> None:
    """InfLLM-v2: sparse-layer decode time vs context, and chunked-prefill peak memory."""
    from salabatch.bench import sparse

    _emit("sparse", sparse.run(contexts, prefill_tokens, chunk), out)


@bench.command("prefix")
@click.option("--doc-tokens", default=16384, show_default=True, type=POSITIVE)
@click.option("--questions", default=8, show_default=True, type=POSITIVE)
@click.option("--max-tokens", default=32, show_default=True, type=POSITIVE)
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
def bench_prefix(doc_tokens: int, questions: int, max_tokens: int, out: str | None) -> None:
    """Prefix store on builtin:random: questions over one document, re-prefilled per question vs
    prefilled once (stored) and answered as one batch, then a second run from disk."""
    from salabatch.bench import prefix

    _emit("prefix", prefix.run(doc_tokens, questions, max_tokens), out)


@bench.command("serve")
@click.option(
    "--model", "model_ref", default="builtin:random", show_default=True, help="Model to serve."
)
@click.option("--clients", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--document",
    type=click.Path(exists=True, dir_okay=False),
    help="The document asked about [the demo's long contract].",
)
@click.option(
    "--soak",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Then this many requests over --soak-documents documents, RSS sampled (0: none).",
)
@click.option("--soak-documents", default=20, show_default=True, type=POSITIVE)
@click.option(
    "--soak-prefix-mb",
    default=16.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="The soak's prefix cap.",
)
@click.option(
    "--turn-tokens",
    default=16384,
    show_default=True,
    type=click.IntRange(min=0),
    help="Also two turns of a conversation over a document this long (0: not).",
)
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
@click.option("--chart", type=OutputFile(), help="PNG chart here (default: beside --out).")
def bench_serve(
    model_ref: str,
    clients: int,
    max_tokens: int,
    document: str | None,
    soak: int,
    soak_documents: int,
    soak_prefix_mb: float,
    turn_tokens: int,
    out: str | None,
    chart: str | None,
) -> None:
    """The server's batching: N concurrent streaming clients over one document against the same
    requests one at a time and the same questions through `salabatch run`; total tokens/s and
    TTFT p50/p95. Needs `salabatch[serve,bench]`."""
    from pathlib import Path

    from salabatch.bench import environment
    from salabatch.bench import serve as serving

    chart = _chart_path(out, chart)
    if document:  # before any server starts
        try:
            serving.document_text(Path(document))
        except ValueError as e:
            raise click.BadParameter(f"{document}: {e}", param_hint="--document") from None
    result = serving.run(
        model_ref,
        clients=clients,
        max_tokens=max_tokens,
        document=Path(document) if document else None,
        soak=soak,
        soak_documents=soak_documents,
        soak_prefix_mb=soak_prefix_mb,
        turn_tokens=turn_tokens,
        progress=lambda line: click.echo(line, err=True),
    )
    result = {"bench": "serve", **environment(), **result}
    _report(result, serving.table(result), out, chart, partial(serving.chart, result))


@bench.command("batch")
@click.option(
    "--model", "model_ref", default="builtin:random", show_default=True, help="Model to serve."
)
@click.option("--lines", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--documents", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
def bench_batch(model_ref: str, lines: int, documents: int, max_tokens: int, out: str | None):
    """The Batch API: one batch over many documents through `salabatch serve` (prefills per
    document, every line once) and chat TTFT while it runs against the idle server."""
    from salabatch.bench import batch as batches
    from salabatch.bench import environment

    result = batches.run(
        model_ref,
        lines=lines,
        documents=documents,
        max_tokens=max_tokens,
        progress=lambda line: click.echo(line, err=True),
    )
    result = {"bench": "batch", **environment(), **result}
    _report(result, batches.table(result), out, None, None)


@bench.command("quant")
@click.option(
    "--model",
    "model_ref",
    help="A trained checkpoint (or builtin:tiny): measure what 8-bit and 4-bit cost its "
    "answers (needle agreement and accuracy vs float32, logit RMS) instead of speed.",
)
@click.option(
    "--contexts",
    default="4K",
    show_default=True,
    type=TOKENS,
    help="With --model: needle contexts, comma-separated; K = 1024.",
)
@click.option("--documents", default=2, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--logit-samples",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --model: held-out samples (1024 tokens) whose answer logits are compared.",
)
@click.option(
    "--hidden",
    default=1024,
    show_default=True,
    type=POSITIVE,
    callback=lambda ctx, param, value: _multiple(value, 128, param),
    help="Model width: a multiple of 128 (the 9B's head width).",
)
@click.option("--layers", default=8, show_default=True, type=POSITIVE)
@click.option("--prefill", default=32, show_default=True, type=POSITIVE)
@click.option("--steps", default=16, show_default=True, type=POSITIVE)
@click.option(
    "--formats",
    help="Comma-separated. Speed: float32, bfloat16, 8bit, 4bit (all by default); with --model: "
    "8bit, 4bit, 4bit-g32 (groups of 32), 4bit-h8 (lm_head at 8 bits); all by default.",
)
@click.option(
    "--act-dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
)
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
def bench_quant(
    model_ref: str | None,
    contexts: list[int],
    documents: int,
    logit_samples: int,
    hidden: int,
    layers: int,
    prefill: int,
    steps: int,
    formats: str | None,
    act_dtype: str,
    out: str | None,
) -> None:
    """Decode tok/s and memory of float32 / bf16 / 8-bit / 4-bit weights on a random model;
    with --model, what 8-bit and 4-bit cost a trained model's answers."""
    from salabatch.bench import environment, quant, quant_quality

    default = quant_quality.FORMATS if model_ref else quant.FORMATS
    chosen = tuple(f.strip() for f in formats.split(",") if f.strip()) if formats else default
    if not chosen:
        raise click.BadParameter(f"names no format: {formats!r}", param_hint="--formats")
    if model_ref:
        result = quant_quality.run(
            model_ref,
            [f for f in chosen if f != "float32"],  # float32 is the reference, always run
            contexts,
            documents=documents,
            logit_samples=logit_samples,
            progress=lambda line: click.echo(line, err=True),
        )
        result = {"bench": "quant-quality", **environment(), **result}
        _report(result, quant_quality.table(result), out, None, None)
        return
    _emit("quant", quant.run(hidden, layers, prefill, steps, chosen, act_dtype), out)


@bench.command("spec")
@click.option(
    "--workloads",
    default=",".join(SPEC_WORKLOADS),
    show_default=True,
    type=NameList("workloads", SPEC_WORKLOADS),
    help="Comma-separated: extraction (the demo job's questions), free-form, cost (the 9B's "
    "layer layout at 1/16 width, random weights).",
)
@click.option("--batches", default="1,2,8", show_default=True, type=COUNTS, help="Batch sizes.")
@click.option(
    "--drafts",
    default=",".join(SPEC_DRAFTS),
    show_default=True,
    type=NameList("drafts", SPEC_DRAFTS),
)
@click.option(
    "--rounds", default=5, show_default=True, type=POSITIVE, help="Timed rounds (the median kept)."
)
@click.option("--tokens", default=4, show_default=True, type=POSITIVE, help="Drafts per pass.")
@click.option(
    "--layers", default=2, show_default=True, type=POSITIVE, help="The layers drafter's layers."
)
@click.option(
    "--shapes",
    type=click.Choice(["small", "9b"]),
    help="The cost workload's model: the 9B's layout at 1/16 width, or the 9B itself "
    "[default: 9b on a GPU, small on a CPU].",
)
@click.option(
    "--context",
    type=click.IntRange(min=64),
    help="The cost workload's document, tokens [default: 32768 on a GPU, 2048 on a CPU].",
)
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
@click.option(
    "--chart",
    type=OutputFile(),
    help="PNG chart here (default: beside --out, as .png).",
)
def bench_spec(
    workloads: tuple[str, ...],
    batches: list[int],
    drafts: tuple[str, ...],
    rounds: int,
    tokens: int,
    layers: int,
    shapes: str | None,
    context: int | None,
    out: str | None,
    chart: str | None,
) -> None:
    """Speculative decoding: decode tokens/s without drafts and with each drafter, at each
    batch size, acceptance, and whether greedy answers are unchanged. Needs the repository's
    jobs/ (the demo documents) for extraction and free-form."""
    from salabatch.bench import environment, spec

    chart = _chart_path(out, chart)
    result = spec.run(
        workloads=workloads,
        batches=tuple(batches),
        drafts=drafts,
        rounds=rounds,
        tokens=tokens,
        layers=layers,
        shapes=shapes,
        context=context,
        progress=lambda text: click.echo(text, err=True),
    )
    result = {"bench": "spec", **environment(), **result}
    _report(result, spec.table(result), out, chart, partial(spec.chart, result))


@bench.command("gla")
@click.option("--repeat", default=5, show_default=True, type=POSITIVE, help="Timed runs per op.")
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
def bench_gla(repeat: int, out: str | None) -> None:
    """Lightning kernels at the 9B's shape: 2048-token chunked prefill, decode steps."""
    from salabatch.bench import gla

    _emit("gla", gla.run(repeat), out)


@bench.command("long")
@click.option(
    "--contexts",
    type=TOKENS,
    help="Context lengths, comma-separated; K = 1024 [GPU: 8K,32K,128K; CPU: 4K,16K,32K].",
)
@click.option(
    "--shapes",
    type=click.Choice(["9b", "small"]),
    help="9b: the 9B vs Qwen3-8B shapes; small: both at 1/16 width [GPU: 9b; CPU: small].",
)
@click.option(
    "--batch", default=8, show_default=True, type=POSITIVE, help="Rows of SALA's batched decode."
)
@click.option(
    "--steps", default=48, show_default=True, type=POSITIVE, help="Decode steps timed (median)."
)
@click.option("--chunk", type=POSITIVE, help="Prefill chunk [GPU: 8192; CPU: 2048].")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
)
@click.option("--peer/--no-peer", default=True, help="Also run mlx-lm's dense llama.")
@click.option(
    "--bound/--no-bound",
    default=True,
    show_default=True,
    help="SALA within its memory plan, as `salabatch run` holds a document (MLX's memory "
    "limit at the plan); --no-bound: MLX's own limit, for a side-by-side measure of its cost.",
)
@click.option(
    "--graph",
    is_flag=True,
    help="No timing: the GPU path's kernels per decode step and prefill chunk and the estimated "
    "FLOPs and bytes, SALA and the peer [contexts 32K,128K,256K; chunk 8192]; runs anywhere.",
)
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
@click.option(
    "--chart",
    type=OutputFile(),
    help="PNG chart here (default: beside --out, as .png).",
)
def bench_long(
    contexts: list[int] | None,
    shapes: str | None,
    batch: int,
    steps: int,
    chunk: int | None,
    dtype: str,
    peer: bool,
    bound: bool,
    graph: bool,
    out: str | None,
    chart: str | None,
) -> None:
    """SALA vs mlx-lm's dense llama at long context: prefill, decode at batch 1 and --batch,
    peak memory, the ratios. Random weights, the current device. Needs `salabatch[bench]`.
    With --graph, the structure of the GPU path instead (see `salabatch.bench.graph`)."""

    from salabatch.bench import environment, long

    if graph and chart is not None:
        why = "--graph counts draw no chart (they print a table)"
        raise click.BadParameter(why, param_hint="--chart")
    chart = _chart_path(out, chart)
    env = environment()
    if graph:
        from salabatch.bench import graph as graphs

        report = graphs.report(contexts or graphs.CONTEXTS, chunk or 8192, batch)
        result = {"bench": "long-graph", **env, **report}
        _report(result, graphs.report_table(report), out, None, None)
        return
    result = long.run(
        contexts,
        shapes=shapes,
        batch=batch,
        steps=steps,
        chunk=chunk,
        dtype=dtype,
        peer=peer,
        bound=bound,
        progress=lambda line: click.echo(line, err=True),
        on_result=_saver("long", env, out),
    )
    result = {"bench": "long", **env, **result}
    title = f"salabatch bench long — {result['device']}"
    _report(result, long.table(result), out, chart, partial(long.chart, result, title=title))


@bench.command("needle")
@click.option(
    "--model",
    "model_ref",
    default="builtin:tiny",
    show_default=True,
    help="Checkpoint folder, builtin:tiny or a Hub id.",
)
@click.option(
    "--contexts",
    type=TOKENS,
    help="Document lengths, comma-separated; K = 1024 [4K,16K,32K,64K,128K].",
)
@click.option(
    "--depths",
    type=Depths(),
    help="Needle depths in %: a list (10,50,90) or A..B, every 20 [10..90].",
)
@click.option(
    "--documents",
    type=click.IntRange(min=1),
    help="Documents per context (each holds one needle per depth) [1].",
)
@click.option(
    "--quick",
    is_flag=True,
    help="4K and 8K, depths 10,50,90, one document (what is given takes precedence): a few "
    "minutes on a CPU.",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--chunk", default=2048, show_default=True, type=click.IntRange(min=1))
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
@click.option(
    "--chart",
    type=OutputFile(),
    help="PNG heatmap here (default: beside --out, as .png).",
)
def bench_needle(
    model_ref: str,
    contexts: list[int] | None,
    depths: list[float] | None,
    documents: int | None,
    quick: bool,
    seed: int,
    chunk: int,
    out: str | None,
    chart: str | None,
) -> None:
    """Needle retrieval through the pipeline: held-out facts at known depths, asked as one batch
    over each document's prefix; accuracy per (context, depth) and, per sparse layer, the share
    of needles whose block it selected."""

    from salabatch.api import load
    from salabatch.bench import environment, needle

    chart = _chart_path(out, chart)
    preset = needle.QUICK if quick else {}

    env = {**environment(), "model": model_ref}
    model, tokenizer = load(model_ref)
    result = needle.run(
        model,
        tokenizer,
        contexts or preset.get("contexts", needle.CONTEXTS),
        depths or preset.get("depths", needle.DEPTHS),
        documents=documents or preset.get("documents", 1),
        seed=seed,
        chunk=chunk,
        progress=lambda line: click.echo(line, err=True),
        on_result=_saver("needle", env, out),
    )
    result = {"bench": "needle", **env, **result}
    title = f"salabatch bench needle — {model_ref}, {env['device']}"
    _report(result, needle.table(result), out, chart, partial(needle.heatmap, result, title=title))


def _saver(name: str, env: dict, out: str | None):
    """`on_result` for a long bench: the JSON so far rewritten to `out` after every
    measurement, so a run cut short keeps what it measured."""

    def save(partial: dict) -> None:
        if out:
            _write_json({"bench": name, **env, **partial}, out)

    return save


def _write_json(result: dict, out: str) -> None:
    """The JSON, whole or not at all (a benchmark stopped mid-write leaves the last one)."""
    import json
    from pathlib import Path

    from salabatch.files import write_text_atomic

    write_text_atomic(Path(out), json.dumps(result, indent=2) + "\n")


def _chart_path(out: str | None, chart: str | None) -> str | None:
    """Where a chart goes: --chart (with .png added where it has no suffix, as matplotlib
    saves it), else --out with .png for its suffix; a usage error, before anything runs,
    where that is --out itself."""
    from pathlib import Path

    if chart is not None:
        path = Path(chart) if Path(chart).suffix else Path(f"{chart}.png")
    elif out is not None:
        path = Path(out).with_suffix(".png")
    else:
        return None
    if out is not None and path.resolve() == Path(out).resolve():
        message = f"{path} would be --out itself: name the JSON .json, or give --chart"
        raise click.BadParameter(message, param_hint="--chart")
    return str(path)


def _report(result: dict, table: str, out: str | None, chart: str | None, draw) -> None:
    """Prints the table, writes the JSON to `out` and the chart with `draw(path)` to `chart`
    (`_chart_path`'s; no chart when `draw` is None)."""
    click.echo(table)
    if out:
        _write_json(result, out)
        click.echo(f"wrote {out}")
    if chart and draw is not None:
        try:
            draw(chart)
        except ImportError:
            click.echo(
                "no chart: matplotlib is not installed (pip install salabatch[bench])", err=True
            )
        else:
            click.echo(f"wrote {chart}")


def _multiple(value: int, of: int, param: click.Parameter) -> int:
    if value % of:
        raise click.BadParameter(f"{value} is not a multiple of {of}", param=param)
    return value


def _depths(text: str) -> list[float]:
    """Percent depths: "10,50,90" or "A..B" (every 20 from A to B) → fractions."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            values = list(range(lo, hi + 1, 20))
        else:
            values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"not depths in %: {text!r}", param_hint="--depths") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise click.BadParameter(f"depths must be 0 to 100 %: {text!r}", param_hint="--depths")
    return [v / 100 for v in values]


@bench.command("scale")
@click.option("--docs", default=16, show_default=True, type=POSITIVE, help="Synthetic documents.")
@click.option(
    "--tokens", default=1000, show_default=True, type=POSITIVE, help="Tokens per document, about."
)
@click.option(
    "--actors",
    default="1,2,4",
    show_default=True,
    type=COUNTS,
    help="Ray model actors of each Ray run, comma-separated.",
)
@click.option(
    "--questions", default=4, show_default=True, type=POSITIVE, help="Questions per document."
)
@click.option(
    "--max-tokens", default=8, show_default=True, type=POSITIVE, help="Tokens per answer."
)
@click.option("--out", type=OutputFile(), help="Also write the JSON here.")
def bench_scale(
    docs: int, tokens: int, actors: list[int], questions: int, max_tokens: int, out: str | None
) -> None:
    """Documents/hour of the local executor and of the Ray executor on a local Ray cluster
    with 1, 2, 4 actors: Ray's overhead, its speedup, its start-up. builtin:random, a fresh prefix
    store per run. Needs `salabatch[ray]`."""

    from salabatch.bench import environment, scale

    env = environment()
    # after every configuration: a run cut short keeps its rows
    save = _saver("scale", env, out)

    result = scale.run(
        docs,
        tokens,
        tuple(actors),
        questions,
        max_tokens,
        progress=lambda line: click.echo(line, err=True),
        on_result=save,
    )
    click.echo(scale.table(result))
    if out:
        save(result)
        click.echo(f"wrote {out}", err=True)
