"""Errors a user can cause. Each says where (file, field, document) and what was expected.

The CLI prints `str(error)` on one line and exits with `exit_code`; nothing here imports MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class SalabatchError(Exception):
    """Base class. `where` parts are joined as `path: field: message (expected X, got Y)`."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        field: str | None = None,
        doc_id: str | None = None,
        expected: object = None,
        got: object = None,
    ) -> None:
        self.message = message
        self.path = str(path) if path is not None else None
        self.field = field
        self.doc_id = doc_id
        self.expected = expected
        self.got = got
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.path, self.doc_id and f"document {self.doc_id}", self.field) if p]
        text = ": ".join([*parts, self.message])
        if self.expected is not None:
            text += f" (expected {self.expected}, got {self.got!r})"
        elif self.got is not None:
            text += f" (got {self.got!r})"
        return text


class ConfigError(SalabatchError):
    """A model `config.json` that is missing, malformed or inconsistent."""

    exit_code = 2


class CheckpointError(SalabatchError):
    """Weights that do not fit the config: missing, unexpected or mis-shaped tensors."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[str] | None = None,
    ) -> None:
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []
        details = []
        for label, names in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("wrong shape", self.mismatched),
        ):
            if names:
                shown = ", ".join(names[:8]) + (
                    f", … ({len(names)} in all)" if len(names) > 8 else ""
                )
                details.append(f"{label}: {shown}")
        super().__init__("; ".join([message, *details]), path=path)


class CacheFormatError(SalabatchError):
    """A serialized cache that is corrupt, truncated or from another model or format version."""


class JobSpecError(SalabatchError):
    """A job file that names something wrong: a missing path, a glob that matches nothing."""

    exit_code = 2


class JobValidationError(JobSpecError):
    """Every mistake of a job file, one `location: message` line each, in `errors`.

    str(): `job.yaml: questions[2].text: field required` for one error, else
    `job.yaml: 3 errors` followed by the errors, one per indented line.
    """

    def __init__(self, path: str | Path, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            message = f"{len(self.errors)} errors\n" + "\n".join(f"  {e}" for e in self.errors)
        super().__init__(message, path=path)


class TokenizerError(SalabatchError):
    """Tokenizer files or a chat template that are missing, malformed or unsafe."""


class OutputError(SalabatchError):
    """A results file that cannot be written, read or resumed."""

    exit_code = 2


class StateError(SalabatchError):
    """A server's state file (its batches, its stored responses) that cannot be opened: not a
    database, or a damaged one."""

    exit_code = 2


class GenerationError(SalabatchError, ValueError):
    """A generation setting the engine cannot run with: a sampling value of the wrong type or
    range, a prompt the model's context cannot hold (`engine.generate.answer_room`). `field` names
    it. A ValueError too: the server refuses a request for that."""

    exit_code = 2


class OutOfMemoryError(SalabatchError):
    """A document or a run that needs more memory than the device has free (refused before
    it starts, never discovered by the kernel's OOM killer)."""


class Terminated(KeyboardInterrupt):
    """What SIGTERM raises (`cli.main.sigterm_as_ctrl_c`): a KeyboardInterrupt, so that what
    saves work on Ctrl-C saves it, but a stop, never one a loop goes on from as from Ctrl-C."""


class CacheWarning(UserWarning):
    """The cache (prefix store, snapshots, builtin model, fingerprint memo) could not be used;
    the run goes on without it. The cache is an optimisation: it never costs an answer."""


def error_text(e: BaseException) -> str:
    """Why an OS or Arrow call failed, on one line (for an OSError, its reason without the path:
    the error that quotes it names the path itself)."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(text.split()) or type(e).__name__


def not_utf8(text: str, *, from_bytes: bool = True) -> str | None:
    """What in `text` UTF-8 cannot hold, for an error message, or None: a byte that was not
    UTF-8 (Python keeps such bytes of a file name, a command-line argument or a terminal's line
    as surrogates U+DC80 to U+DCFF; `from_bytes=False` for text that never was bytes, such as
    JSON's), or another lone surrogate (JSON allows `"\\ud800"`). Checked by encoding, at C
    speed: it runs on every request's messages, which may hold a whole document."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # only a surrogate fails: the first one is at e.start
        code = ord(text[e.start])
        if from_bytes and 0xDC80 <= code <= 0xDCFF:
            return f"byte 0x{code - 0xDC00:02x} at character {e.start}"
        return f"lone surrogate U+{code:04X} at character {e.start}"
    return None
