"""`salabatch serve` (the OpenAI-compatible server on uvicorn) and `salabatch chat` (a terminal
chat): one model in a ServeEngine, continuous batching and prefix reuse behind both. Like every
command group, nothing heavy is imported until a command runs."""

from __future__ import annotations

import ipaddress
import os
import sys
from contextlib import ExitStack

import click

from salabatch.cli.main import (
    Finite,
    dtype_option,
    positional,
    sigterm_as_ctrl_c,
    speculation_options,
    status_line,
)
from salabatch.errors import not_utf8

API_KEY_ENV = "SALABATCH_API_KEY"


def _model(command: click.Command) -> click.Command:
    """MODEL as an argument (`salabatch serve M`, as vLLM spells it) or as --model (mlx-lm's
    spelling), as the parameters `model_args` and `model_opt`: `_model_ref` takes it from them."""
    command = click.option(
        "--model",
        "model_opt",
        metavar="MODEL",
        help="MODEL as an option: a checkpoint folder, a Hugging Face repo id, or builtin:tiny.",
    )(command)
    return click.argument("model_args", nargs=-1, metavar="[MODEL]")(command)


def _model_ref(model_args: tuple[str, ...], model_opt: str | None) -> str:
    (model_ref,) = positional(model_args, ("MODEL",), (model_opt,), "--model")
    return model_ref


_state_dir = click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    help="The prefix store: prefilled documents and conversations kept on disk "
    "(default: the salabatch cache folder, as `salabatch run` uses); for serve, also the "
    "Batch API's files and batches (in its batches/ folder) and the stored responses "
    "(responses.sqlite).",
)
_batch_size = click.option(
    "--batch-size",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests decoding together at most.",
)
_prefix_memory = click.option(
    "--prefix-memory",
    default=2.0,
    show_default=True,
    type=Finite(min=0),
    help="GB of memory for prefixes held between requests (the least recently used go to the "
    "prefix store on disk).",
)
_store_gb = click.option(
    "--store-gb",
    default=50.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="The prefix store's size budget on disk: past it, writing a prefix evicts the least "
    "recently used entries, a run's too (as a job's cache.max_gb does).",
)
_max_tokens = click.option(
    "--max-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens of an answer when the request sets no max_tokens.",
)


@click.command()
@_model
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    help=f"Require `Authorization: Bearer KEY` on every endpoint but /health (or ${API_KEY_ENV}).",
)
@click.option(
    "--served-model-name",
    help="The model's id in the API (default: MODEL as given).",
)
@_state_dir
@_batch_size
@click.option(
    "--max-queue",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests waiting beyond a full batch; past it a request gets 429.",
)
@_prefix_memory
@_store_gb
@click.option(
    "--responses-gb",
    default=1.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Stored responses (the Responses API's, in the state dir) kept at most: past it the "
    "least recently used go.",
)
@_max_tokens
@dtype_option
@speculation_options
def serve(
    model_args: tuple[str, ...],
    model_opt: str | None,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    state_dir: str | None,
    batch_size: int,
    max_queue: int,
    prefix_memory: float,
    store_gb: float,
    responses_gb: float,
    max_tokens: int,
    dtype: str,
    draft: str,
    num_draft_tokens: int,
    draft_layers: int,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API: /v1/chat/completions (streaming too),
    /v1/completions, /v1/responses, /v1/models, /v1/files and /v1/batches (the Batch API),
    /health, /metrics.
    Binds 127.0.0.1 unless told otherwise."""
    model_ref = _model_ref(model_args, model_opt)
    try:
        import uvicorn
    except ImportError:
        raise click.ClickException(
            'salabatch serve needs the serve extra: pip install "salabatch[serve]"'
        ) from None
    from salabatch.serve.app import ServeDefaults, create_app

    if not api_key and not _is_loopback(host):
        click.echo(
            f"warning: serving on {host}:{port} without an API key: anyone who can reach it can "
            f"use it (give --api-key or ${API_KEY_ENV})",
            err=True,
        )
    from salabatch.engine.speculative import Speculation
    from salabatch.files import cache_dir
    from salabatch.serve.batches.routes import batch_routes
    from salabatch.serve.batches.runner import BatchRunner
    from salabatch.serve.batches.store import BatchStore
    from salabatch.serve.response_store import ResponseStore
    from salabatch.serve.responses import Responses

    speculation = Speculation(draft, num_draft_tokens, draft_layers)
    root = os.path.expanduser(state_dir or cache_dir())
    # first: a second server on this state dir, or on this port, is refused before a model loads
    try:
        with ExitStack() as opened:  # what opened closes again unless the engine loads
            try:
                store = BatchStore(os.path.join(root, "batches"))
                opened.callback(store.close)
                responses = ResponseStore(
                    os.path.join(root, "responses.sqlite"), limit=int(responses_gb * 2**30)
                )
                opened.callback(responses.close)
            except OSError as e:
                why = f"cannot keep the server's state in {root} ({e.strerror or e})"
                raise click.BadParameter(why, param_hint="--state-dir") from None
            sock = _listening(host, port)
            opened.callback(sock.close)
            engine, tok = _engine(
                model_ref,
                dtype,
                state_dir,
                batch_size,
                max_queue,
                prefix_memory,
                store_gb,
                speculation,
            )
            opened.pop_all()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while it starts: a clean stop, as later
        click.echo("stopped before the server started", err=True)
        return
    model_id = served_model_name or model_ref
    defaults = ServeDefaults(max_tokens=max_tokens)
    runner = BatchRunner(engine, tok, store, model_id=model_id, defaults=defaults)
    answers = Responses(engine, tok, model_id=model_id, defaults=defaults, store=responses)
    app = create_app(
        engine,
        tok,
        model_id=model_id,
        api_key=api_key or None,
        defaults=defaults,
        routes=[*batch_routes(runner), *answers.routes],
        starting=[answers.resume],  # background responses a stopped server left run again
    )
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=GRACE_S, log_level="info"
    )
    server = _server(config, engine)
    # SIGTERM as Ctrl-C: uvicorn stops on either, then raises the signal again once it has; as
    # a KeyboardInterrupt (which uvicorn ends on quietly) the closing below runs, where the
    # default SIGTERM would end the process before it
    with sigterm_as_ctrl_c():
        engine.start()
        runner.start()  # batches a killed server left go on
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
        finally:
            runner.close()
            engine.close()  # the prefixes it holds go to the prefix store
            responses.close()
            store.close()
            sock.close()
    if not server.started:
        raise click.ClickException("the server did not start (its log above says why)")


GRACE_S = 5  # what a request still running at Ctrl-C or SIGTERM has to end


def _listening(host: str, port: int):
    """The server's socket, bound (a port in use, or a host this machine is not, is a usage
    error before the model loads, not uvicorn's exit 3 after it)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = f"cannot listen on {host}:{port} ({e.strerror or e})"
        raise click.BadParameter(why, param_hint="--host/--port") from None
    sock.set_inheritable(True)
    return sock


def _server(config, engine):
    """uvicorn's server, whose engine ends the requests still running a second before the
    grace is over: each gets its end (a stream's error event and [DONE], a 503), where uvicorn
    would cut its connection (a stream without an end, a plain-text 500)."""
    import logging
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn says where only of a socket it bound itself
                host, port = sockets[0].getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown, port
                )

        async def shutdown(self, sockets=None) -> None:
            timer = threading.Timer(GRACE_S - 1, engine.close)
            timer.daemon = True
            timer.start()
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


@click.command()
@_model
@click.option(
    "--document",
    "documents",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A text or PDF file to chat about (repeatable): put in the system message, prefilled "
    "once.",
)
@click.option("--system", "--system-prompt", help="System prompt (before the documents).")
@click.option("--think/--no-think", default=False, show_default=True, help="Reason first.")
@click.option("--temperature", "--temp", default=0.0, show_default=True, type=Finite(0))
@click.option("--seed", default=0, show_default=True)
@_max_tokens
@_state_dir
@_prefix_memory
@_store_gb
@dtype_option
@speculation_options
def chat(
    model_args: tuple[str, ...],
    model_opt: str | None,
    documents: tuple[str, ...],
    system: str | None,
    think: bool,
    temperature: float,
    seed: int,
    max_tokens: int,
    state_dir: str | None,
    prefix_memory: float,
    store_gb: float,
    dtype: str,
    draft: str,
    num_draft_tokens: int,
    draft_layers: int,
) -> None:
    """Chat with MODEL in the terminal, about --document files if given. Each turn prefills
    only its own tokens. /document FILE adds a document, /reset forgets the conversation, /save
    FILE writes it as JSON, /load FILE goes on with a saved one, /quit (or Ctrl-D) ends; Ctrl-C
    stops an answer, not the session."""
    model_ref = _model_ref(model_args, model_opt)
    from salabatch.engine.sampling import SamplingParams
    from salabatch.engine.speculative import Speculation
    from salabatch.serve.chat import HELP, ChatSession, run_chat

    if system is not None and (bad := not_utf8(system)):
        raise click.BadParameter(f"the text is not UTF-8 ({bad})", param_hint="--system")
    texts = [_read_document(path) for path in documents]
    speculation = Speculation(draft, num_draft_tokens, draft_layers)
    # One conversation: one row at a time, room for an answer Ctrl-C is still stopping.
    engine, tok = _engine(model_ref, dtype, state_dir, 1, 2, prefix_memory, store_gb, speculation)
    session = ChatSession(
        engine,
        tok,
        documents=texts,
        system=system,
        params=SamplingParams(temperature=temperature, seed=seed),
        max_tokens=max_tokens,
        think=think,
    )
    tty = sys.stdout.isatty()

    def read_line() -> str | None:
        try:
            return input(">> ")
        except EOFError:  # Ctrl-D, or the end of piped input
            click.echo()
            return None

    def note(line: str) -> None:
        click.secho(line, dim=tty or None, err=True)

    engine.start()
    try:
        click.echo(f"chat with {model_ref}; {HELP}", err=True)
        run_chat(
            session,
            read_line,
            lambda text: click.echo(text, nl=False),
            note,
            dim=(lambda text: click.style(text, dim=True)) if tty else str,
            status=status_line if sys.stderr.isatty() else None,
        )
    finally:
        engine.close()


def _engine(
    model_ref, dtype, state_dir, batch_size, max_queue, prefix_memory, store_gb, speculation=None
):
    """(started-to-be ServeEngine, tokenizer) of a model reference; `speculation`: the engine's
    Speculation (None: off)."""
    from salabatch.api import load
    from salabatch.engine.speculative import OFF
    from salabatch.files import cache_dir
    from salabatch.models import model_note
    from salabatch.serve.engine import ServeEngine

    if note := model_note(model_ref):
        click.echo(f"note: {note}", err=True)
    model, tok = load(model_ref, dtype)
    engine = ServeEngine(
        model,
        tok,
        batch_size=batch_size,
        max_queue=max_queue,
        prefix_bytes=int(prefix_memory * 2**30),
        store_dir=os.path.expanduser(state_dir) if state_dir else cache_dir(),
        store_gb=store_gb,
        speculation=speculation or OFF,
    )
    return engine, tok


def _read_document(path: str) -> tuple[str, str]:
    """(name, text) of a --document, read as `salabatch run` reads a file (text or PDF)."""
    from salabatch.serve.chat import ChatError, read_document

    try:
        return read_document(path)
    except ChatError as e:
        raise click.BadParameter(str(e), param_hint="--document") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
