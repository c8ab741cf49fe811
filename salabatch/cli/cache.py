"""`salabatch cache ls|prune|clear`: the prefix store on disk. Like every command group, nothing
heavy is imported until a command runs."""

from __future__ import annotations

import click

from salabatch.cli.main import Finite, human_size
from salabatch.plural import counted


@click.group()
def cache() -> None:
    """The prefix cache store: saved document prefixes and prefill snapshots."""


_cache_dir = click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    help="Store folder (default: $XDG_CACHE_HOME/salabatch or ~/.cache/salabatch, the jobs' "
    "default cache.dir).",
)


def _store(root: str | None):
    from salabatch.files import cache_dir
    from salabatch.jobs.store.prefix_store import PrefixStore

    return PrefixStore(root or cache_dir())


def _absent(store) -> bool:
    """Whether the store's folder does not exist: then it is empty, and prune and clear say so
    and leave it absent (a store makes its folder when it is first changed)."""
    return not store.root.exists()


@cache.command("ls")
@_cache_dir
def cache_ls(root: str | None) -> None:
    """List stored prefixes and snapshots: size, tokens, dtype, age, the document each was
    stored for, model; and the temporary files that killed writers left behind."""
    import time

    store = _store(root)
    entries, temps = store.listing()
    if not entries:
        click.echo(
            "no stored prefixes" + (f" (no store at {store.root})" if _absent(store) else "")
        )
    else:
        names = [_clip(e.document or "-", _DOCUMENT_WIDTH) for e in entries]
        width = max(len("document"), *map(len, names))
        click.echo(
            f"{'digest':14s} {'kind':8s} {'size':>9s} {'tokens':>15s} {'dtype':9s} "
            f"{'last used':>10s}  {'document':{width}s}  model"
        )
        now = time.time()
        for e, name in zip(entries, names, strict=True):
            tokens = f"{e.tokens}" if e.kind == "prefix" else f"{e.tokens}/{e.total_tokens}"
            click.echo(
                f"{e.digest[:12]:14s} {e.kind:8s} {human_size(e.bytes):>9s} {tokens:>15s} "
                f"{e.dtype:9s} {_age(now - e.last_used):>10s}  {name:{width}s}  {e.model}"
            )
        total = sum(e.bytes for e in entries)
        click.echo(f"{counted(len(entries), 'entry', 'entries')}, {human_size(total)}")
    stale = [t for t in temps if t.stale]
    if stale:
        click.echo(
            f"{counted(len(stale), 'stale temporary file')}, "
            f"{human_size(sum(t.bytes for t in stale))} "
            "(left by killed writes; the next run or `salabatch cache prune` removes them)"
        )


@cache.command("prune")
@_cache_dir
@click.option("--max-gb", type=Finite(min=0), help="Keep at most this much (LRU).")
@click.option(
    "--older-than",
    type=Finite(min=0),
    metavar="DAYS",
    help="Remove entries unused for this many days.",
)
def cache_prune(root: str | None, max_gb: float | None, older_than: float | None) -> None:
    """Remove least recently used entries over a size, or entries unused for a while; and the
    temporary files that killed writers left behind."""
    if max_gb is None and older_than is None:
        raise click.UsageError("give --max-gb and/or --older-than")
    store = _store(root)
    if _absent(store):
        click.echo(f"removed 0 entries, {human_size(0)} (no store at {store.root})")
        return
    removed = store.prune(
        max_bytes=None if max_gb is None else int(max_gb * 2**30),
        older_than_s=None if older_than is None else older_than * 86400,
    )
    freed = human_size(sum(e.bytes for e in removed))
    line = f"removed {counted(len(removed), 'entry', 'entries')}, {freed}"
    if store.swept:
        swept = human_size(sum(t.bytes for t in store.swept))
        line += f"; {counted(len(store.swept), 'stale temporary file')}, {swept}"
    click.echo(line)


@cache.command("clear")
@_cache_dir
@click.option("--yes", is_flag=True, help="Do not ask.")
def cache_clear(root: str | None, yes: bool) -> None:
    """Remove every stored prefix and snapshot."""
    store = _store(root)
    if _absent(store):
        click.echo(f"freed {human_size(0)} (no store at {store.root})")
        return
    if not yes:
        click.confirm(f"remove every stored prefix in {store.root}?", abort=True)
    click.echo(f"freed {human_size(store.clear())}")


_DOCUMENT_WIDTH = 40  # a longer document name is cut, its end kept (where names differ)


def _clip(name: str, width: int) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f} {unit}"
    return f"{seconds:.0f} s"
