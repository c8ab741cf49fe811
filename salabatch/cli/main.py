"""The root of the `salabatch` command: loads the BLAS first, prints warnings and errors as one
line each and exits with their code; what every command group shares (`debug_enabled`,
`human_size`, `speculation_options`, `sigterm_as_ctrl_c`, `Finite`). Thin: each command imports
what it needs (MLX included) when it runs, so `salabatch --help` stays instant."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import click

from salabatch._version import __version__
from salabatch.errors import SalabatchError, Terminated

# Exit codes (README "Exit codes"): 0 done; 1 a failure (a model or cache that cannot be used,
# an unexpected error); 2 bad input (usage, job file, model config, an unusable results file);
# 3 the run finished but results of the job are error rows; 4 the run stopped at --limit with
# rows of the job left; 130 interrupted by Ctrl-C, 143 stopped by SIGTERM (128 + the signal, as
# a shell reports it; finished rows kept either way); 141 its output's reader went away (SIGPIPE:
# `salabatch export x.parquet | head -1`), quietly, as `cat` does.
EXIT_ERROR_ROWS = 3
EXIT_LIMITED = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
EXIT_TERMINATED = 143


class _Group(click.Group):
    """Loads the BLAS first; prints warnings and errors as one line each (`--debug`: with their
    traceback) and exits with the error's code; ends quietly when standard output is closed;
    Ctrl-C or SIGTERM that the command does not end on by itself (while it starts, say) exits
    130 or 143 saying so, never click's "Aborted!" and 1."""

    def invoke(self, ctx: click.Context):
        # Before any command can import mlx.core: the BLAS swap only works before that import.
        from salabatch.engine import activate_blas

        with warnings.catch_warnings():
            # `--debug` may come after the command's name: asked when a warning comes
            python_way = warnings.showwarning

            def show(*args, **kwargs) -> None:
                (python_way if _debug(ctx) else _show_warning)(*args, **kwargs)

            warnings.showwarning = show
            activate_blas()
            try:
                with sigterm_as_ctrl_c():  # from the start: a command's own may take over
                    result = super().invoke(ctx)
                sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
                return result
            except KeyboardInterrupt as e:  # what the command did not end on by itself
                terminated = isinstance(e, Terminated)
                click.echo("terminated (SIGTERM)" if terminated else "interrupted", err=True)
                sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)
            except BrokenPipeError:
                _quiet_stdout()
                sys.exit(EXIT_BROKEN_PIPE)
            except SalabatchError as e:
                if _debug(ctx):
                    traceback.print_exc()
                click.echo(f"error: {e}", err=True)
                sys.exit(e.exit_code)
            except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
                try:  # a command that exits with its own code after writing to a closed pipe
                    sys.stdout.flush()
                except BrokenPipeError:
                    _quiet_stdout()
                raise
            except Exception as e:  # a bug, or a failure nothing above foresaw
                if _debug(ctx):
                    raise
                what = " ".join(str(e).split()) or "no message"
                click.echo(
                    f"error: {type(e).__name__}: {what} (run with --debug for the traceback)",
                    err=True,
                )
                sys.exit(1)


def _quiet_stdout() -> None:
    """Standard output to /dev/null: Python flushes it once more at exit, which would fail on
    the closed pipe again and print `Exception ignored ... BrokenPipeError`."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr: `warning: <message>` (no source path or code line),
    through tqdm, so that it does not break a progress bar being drawn there."""
    from tqdm import tqdm

    tqdm.write(f"warning: {' '.join(str(message).split())}", file=sys.stderr)


def debug_enabled() -> bool:
    """Whether `--debug` was given, after `salabatch` or after the command's name (for
    commands that report errors themselves)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and _debug(ctx))


_DEBUG = "salabatch.debug"  # the root context's meta key of a command's own `--debug`


def _debug(ctx: click.Context) -> bool:
    root = ctx.find_root()
    return bool(root.params.get("debug") or root.meta.get(_DEBUG))


def with_debug_option(command: click.Command) -> None:
    """Gives `command` (and every command of a group) its own `--debug`, the same as the root's:
    `salabatch run --debug` works as `salabatch --debug run` does."""

    def remember(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            ctx.find_root().meta[_DEBUG] = True

    command.params.append(
        click.Option(
            ["--debug"],
            is_flag=True,
            expose_value=False,
            is_eager=True,
            callback=remember,
            help="Show tracebacks and warnings' sources (as `salabatch --debug`).",
        )
    )
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_debug_option(sub)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="salabatch")
@click.option("--debug", is_flag=True, help="Show tracebacks and warnings' sources.")
def main(debug: bool) -> None:
    """Answer questions over long documents with MiniCPM-SALA on MLX."""


# salabatch.engine.speculative.DRAFTS (a test holds them equal), spelled here: that module may
# import mlx.core, which must wait for the BLAS
DRAFTS = ("off", "lookup", "layers", "auto")
# the options of the commands that load a model and prefill (generate, perplexity, serve, chat)
dtype_option = click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
)
prefill_chunk_option = click.option(
    "--prefill-chunk", default=2048, show_default=True, type=click.IntRange(min=16)
)


def speculation_options(command: click.Command) -> click.Command:
    """`--draft`, `--num-draft-tokens` and `--draft-layers` (speculative decoding, off unless
    asked for), as the parameters `draft`, `num_draft_tokens` and `draft_layers`."""
    options = [
        click.option(
            "--draft",
            default="off",
            show_default=True,
            type=click.Choice(DRAFTS),
            help="Speculative decoding: draft from the prompt's own text (lookup), from the "
            "model's first layers (layers), or pick per request (auto). Greedy answers are "
            "the same; they come faster where drafts are accepted.",
        ),
        click.option(
            "--num-draft-tokens",
            default=4,
            show_default=True,
            type=click.IntRange(min=1),
            help="Tokens drafted per step.",
        ),
        click.option(
            "--draft-layers",
            default=8,
            show_default=True,
            type=click.IntRange(min=1),
            help="Layers of the model the layers drafter runs.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def positional(
    args: tuple[str, ...], names: tuple[str, ...], options: tuple[str | None, ...], spelled: str
) -> list[str]:
    """The values of `names`: each from its option when given, else from the positional `args`
    in order (so `generate --model M PROMPT` and `generate M PROMPT` agree)."""
    free = [name for name, value in zip(names, options, strict=True) if value is None]
    if len(args) < len(free):
        how = "an argument" if len(names) == 1 else "arguments"
        raise click.UsageError(f"give {' and '.join(names)}, as {how} or with {spelled}")
    if len(args) > len(free):
        raise click.UsageError(f"unexpected argument {args[len(free)]!r}")
    rest = iter(args)
    return [value if value is not None else next(rest) for value in options]


def status_line(text: str) -> None:
    """`text` shown in place on the terminal's standard error (a long prefill's progress), in
    brackets; "" clears it."""
    click.secho(f"\r\033[K{text and f'[{text}]'}", dim=True, nl=False, err=True)


def human_size(n: int) -> str:
    """A byte count for people: `1536` -> `1.5 KB`."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class OutputFile(click.ParamType):
    """A file a command writes when it ends (a benchmark's --out, perplexity's --json): `~`
    expanded, missing folders made, and refused (exit 2) before any work where it is a folder
    or its folder cannot be made or written (the figures of hours were lost at the end).
    `stdout`: "-" stands for standard output."""

    name = "file"

    def __init__(self, *, stdout: bool = False) -> None:
        self.stdout = stdout

    def convert(self, value, param, ctx):
        if self.stdout and value == "-":
            return value
        target = Path(os.path.expanduser(value))
        if target.is_dir():
            self.fail(f"{value}: a folder, not a file", param, ctx)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.fail(f"{value}: cannot make its folder ({e.strerror or e})", param, ctx)
        if not os.access(target.parent, os.W_OK):
            self.fail(f"{value}: its folder is not writable", param, ctx)
        return str(target)


class Finite(click.FloatRange):
    """click.FloatRange that also refuses NaN and infinities (`--temp nan` passes a range's
    comparisons, and the model then answers nothing)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[list[int]]:
    """SIGTERM (`kill`, a scheduler's stop, a container's end) stops a command as Ctrl-C does
    (`run`: finished rows kept and merged; `serve`: prefixes written). Yields a list that holds
    the signal once it came; the handler before is put back after the block."""
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not received:  # once: a second one must not break what saves the work
            received.append(signum)
            raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield received  # only the main thread may handle signals
        return
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, before)
