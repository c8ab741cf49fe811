"""The `salabatch` command (the console entry point `salabatch.cli:main`): the root group
(`main`) with one module per command group. Importing it imports click and nothing heavy."""

from salabatch.cli.bench import bench, doctor
from salabatch.cli.cache import cache
from salabatch.cli.jobs import run, validate
from salabatch.cli.main import main, with_debug_option
from salabatch.cli.model import convert_cmd, generate, perplexity
from salabatch.cli.results import export, inspect
from salabatch.cli.serve import chat, serve
from salabatch.cli.train import train

for _command in (
    run,
    validate,
    doctor,
    generate,
    convert_cmd,
    perplexity,
    inspect,
    export,
    cache,
    train,
    bench,
    serve,
    chat,
):
    with_debug_option(_command)
    main.add_command(_command)

__all__ = ["main"]
