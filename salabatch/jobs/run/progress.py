"""What a run shows while it goes, on standard error.

On a terminal, bars: the job's rows, whose rate and time left count only this run's rows (rows
done earlier are not progress: they leave the bar's total and show beside it), and under it the
current document's prefill, then its decoding, in tokens. Anywhere else (a log file, a pipe,
CI) there is no bar and no `\\r` or escape sequence: a plain line at most every `interval`
seconds, and one at the end. `write(line)` prints a line of its own without breaking a bar (the
CLI prints its warnings the same way, through tqdm).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, TextIO

from tqdm import tqdm

Mode = Literal["bars", "lines", "off"]
LINE_INTERVAL = 30.0  # seconds between two plain lines


class Progress:
    """The progress of one run of `total` rows named `name` (see the module docstring).

    mode: "bars" on a terminal, "lines" for a log, "off" for nothing; `Progress.to(stream)`
    picks bars or lines by whether `stream` is a terminal.
    echo: prints a line of its own where no bar is drawn (default: to `stream`).
    """

    def __init__(
        self,
        name: str,
        total: int,
        *,
        mode: Mode,
        stream: TextIO,
        echo: Callable[[str], None] | None = None,
        interval: float = LINE_INTERVAL,
    ) -> None:
        self.name, self.mode, self.stream, self.interval = name, mode, stream, interval
        self.echo = echo or (lambda line: print(line, file=stream, flush=True))
        self.total, self.done, self.earlier = total, 0, 0
        self.started = self._last_line = time.monotonic()
        self.bar = (
            tqdm(
                total=total,
                unit="row",
                desc=name,
                file=stream,
                dynamic_ncols=True,
                smoothing=0.1,
            )
            if mode == "bars"
            else None
        )

    @classmethod
    def to(
        cls,
        stream: TextIO,
        name: str,
        total: int,
        *,
        enabled: bool = True,
        echo: Callable[[str], None] | None = None,
    ) -> Progress:
        """Bars when `stream` is a terminal, plain lines when it is not, nothing unless
        `enabled`."""
        mode: Mode = "off" if not enabled else "bars" if _is_terminal(stream) else "lines"
        return cls(name, total, mode=mode, stream=stream, echo=echo)

    # -- rows -------------------------------------------------------------------------------
    def found_done(self, earlier: int) -> None:
        """`earlier` rows of the job (in all, so far) were found done by earlier runs."""
        new, self.earlier = earlier - self.earlier, earlier
        if new <= 0:
            return
        self.total -= new
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.set_postfix_str(f"{self.earlier} done earlier", refresh=True)

    def rows(self, n: int) -> None:
        """`n` more rows finished (written)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        self._line_now_and_then()

    # -- one document, or one pooled batch ---------------------------------------------------
    @contextmanager
    def tokens(self, what: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar of `total` tokens for the block (`what`: "prefill report.md"); yields
        `advance(n)`, which counts `n` more tokens done."""
        if self.mode == "off":
            yield lambda n: None
            return
        if self.bar is None:  # lines: the document's tokens go into the next line

            def advance(n: int) -> None:
                state["done"] += n
                self._line_now_and_then(f"; {what}: {state['done']}/{total} tokens")

            state = {"done": 0}
            yield advance
            return
        with tqdm(
            total=total, unit="tok", desc=what, leave=False, file=self.stream, dynamic_ncols=True
        ) as bar:
            yield bar.update

    # -- lines of their own ------------------------------------------------------------------
    def write(self, line: str) -> None:
        """Prints `line` on a line of its own (above the bars, which are drawn again)."""
        if self.mode == "bars":
            tqdm.write(line, file=self.stream)
        else:
            self.echo(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.mode == "lines":
            self._line()

    # -- plain lines -------------------------------------------------------------------------
    def _line_now_and_then(self, extra: str = "") -> None:
        if self.mode == "lines" and time.monotonic() - self._last_line >= self.interval:
            self._line(extra)

    def _line(self, extra: str = "") -> None:
        self._last_line = now = time.monotonic()
        elapsed = now - self.started
        earlier = f" (+{self.earlier} done earlier)" if self.earlier else ""
        left = ""
        if 0 < self.done < self.total:
            left = f", about {_clock(elapsed / self.done * (self.total - self.done))} left"
        self.echo(
            f"{self.name}: {self.done}/{self.total} rows{earlier}, {_clock(elapsed)}{left}{extra}"
        )


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False


def _clock(seconds: float) -> str:
    """`75` -> `1:15`; `3725` -> `1:02:05`."""
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"
