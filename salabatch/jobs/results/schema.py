"""What a results file is: the Parquet schema, `ResultRow`, the file metadata; how it is read
(`read.read_results`) and the folder layout are described here once.

One row per document × question. On disk, for `output.path: results/x.parquet`:

    results/x.parquet                the merged results, replaced atomically when a run ends
    results/x.parquet.parts/         exists while a run is going, or after one was killed
        LOCK                         flock'd by the running writer: one writer per results file
        FRESH                        present when this run replaces x.parquet (--no-resume)
        part-000007-<uuid>.parquet   the rows of one `ResultWriter.write()` call, complete
        .<name>.tmp-<pid>-<hex>.parquet  a part or a merge being written; deleted at the next open

`writer.ResultWriter` writes them (durably, resumably). What a results file holds
(`read_results`): the rows of x.parquet (ignored when FRESH is present) followed by the rows of
the readable parts in sequence order, one row per `request_key`: an ok row beats an error row,
otherwise the later row wins, and one row per custom_id: the most recently written key (the
row of an edited question supersedes the old one); sorted by doc_id, question_id, custom_id,
request_key. `inspect`, `export` and resume all read it this way, so they agree with each other
at every instant, mid-run and after a kill included.

`read_results` also reads a results *folder* (a dataset): every `*.parquet` below it, at any
depth, whose name and folders do not start with `.` or `_` (temp files, Spark/Hive markers), as
Ray's `Dataset.write_parquet` writes them, a `.parts` folder, or results files collected from
several machines. Its rows are deduplicated as above, "later" meaning a later `finished_at`
(the files have no sequence); a file that is not salabatch's is skipped with an OutputWarning.
"""

from __future__ import annotations

import contextlib
import json
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from salabatch._version import __version__

SCHEMA_VERSION = 1

STATUSES = ("ok", "error")
FINISH_REASONS = ("stop", "length", "error")
CACHE_SOURCES = ("memory", "disk", "none")
# the question_id of a request line's row: a chat completion's, a text completion's (its answer
# the text as generated; exported as a text_completion), a response's (exported as a response)
CHAT_ROWS, TEXT_ROWS, RESPONSE_ROWS = "request", "completion", "response"

# File metadata keys (bytes, as Parquet stores them).
META_SCHEMA_VERSION = b"salabatch.schema_version"
META_JOB_SPEC = b"salabatch.job_spec"
META_VERSIONS = b"salabatch.versions"
META_CREATED_AT = b"salabatch.created_at"
META_UPDATED_AT = b"salabatch.updated_at"
# The run_ids of the `--retry-errors --limit` runs since the last run that saw the whole job:
# their error rows are not redone by the next such run (see ResultWriter).
META_RETRIED_BY = b"salabatch.retried_by"
# A results folder as read (`read_results`), never written: how many of its .parquet files were
# skipped, not being salabatch results.
META_SKIPPED_FILES = b"salabatch.skipped_files"

_S, _I, _F = pa.string(), pa.int64(), pa.float64()
_TS = pa.timestamp("us", tz="UTC")
# a token in `logprobs`: OpenAI's entry of logprobs.content (its text, log-probability, bytes)
_TOKEN = [pa.field("token", _S), pa.field("logprob", _F), pa.field("bytes", pa.list_(pa.uint8()))]
LOGPROBS = pa.list_(pa.struct([*_TOKEN, pa.field("top_logprobs", pa.list_(pa.struct(_TOKEN)))]))
# a choice in `choice_logprobs`: its text, its log-probability as the whole answer, and its
# probability among the choices
CHOICES = pa.list_(
    pa.struct([pa.field("choice", _S), pa.field("logprob", _F), pa.field("probability", _F)])
)


def _col(name: str, type_: pa.DataType, doc: str, *, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"description": doc})


RESULT_SCHEMA = pa.schema(
    [
        # identity
        _col("run_id", _S, "id of the `salabatch run` that produced the row", nullable=False),
        _col("job_name", _S, "the job's name", nullable=False),
        _col("doc_id", _S, "the document's stable id within the job", nullable=False),
        _col("doc_path", _S, "the source file (a .jsonl file for a jsonl record)", nullable=False),
        _col("doc_sha256", _S, "sha256 of the document; '' if it was not read", nullable=False),
        _col("question_id", _S, "the question's id in the job", nullable=False),
        _col("question", _S, "the question text as asked", nullable=False),
        _col(
            "custom_id",
            _S,
            "join key for other tools; default <doc_id>/<question_id>",
            nullable=False,
        ),
        _col(
            "request_key",
            _S,
            "deterministic key of the request; resume skips done keys",
            nullable=False,
        ),
        _col("request_line", _I, "1-based line of the request in the --requests file, else null"),
        # result
        _col("answer", _S, "the answer (think block removed); null for an error row"),
        _col("reasoning", _S, "the think block when generation.think is true, else null"),
        _col("finish_reason", _S, "stop | length | error", nullable=False),
        _col("status", _S, "ok | error", nullable=False),
        _col("error", _S, "one-line reason of an error row, else null"),
        _col(
            "logprobs",
            LOGPROBS,
            "each generated token's text, log-probability, bytes and top_logprobs (its most "
            "likely alternatives), as OpenAI's logprobs.content, think block included; null "
            "unless the row asked for them (generation.logprobs, a request's logprobs)",
        ),
        _col(
            "choice_logprobs",
            CHOICES,
            "a choices question's choices: each one's log-probability as the whole answer and "
            "its probability among them (the answer is the likeliest, or one drawn by them); "
            "null for other rows",
        ),
        # model
        _col("model", _S, "the job's model (checkpoint path or builtin:name)", nullable=False),
        _col("model_sha", _S, "digest of the checkpoint weights"),
        _col("quant_bits", _I, "bits of a quantized checkpoint (2 to 8), null for full precision"),
        # tokens
        _col("doc_tokens", _I, "tokens of the document prompt"),
        _col("prompt_tokens", _I, "tokens of the whole prompt: document prompt + question"),
        _col("cached_tokens", _I, "prompt tokens served from the prefix cache"),
        _col("completion_tokens", _I, "generated tokens, think block included"),
        _col(
            "reasoning_tokens",
            _I,
            "generated tokens of the think block, the one closing it included (of "
            "completion_tokens) where the row thought, else null",
        ),
        _col("draft_tokens", _I, "tokens drafted by speculative decoding; 0 when it was off"),
        _col("accepted_tokens", _I, "drafted tokens the model accepted (at most draft_tokens)"),
        # timings
        _col("doc_prefill_s", _F, "seconds prefilling the document; 0 when it came from a cache"),
        _col("prefill_tok_s", _F, "prefill throughput, tokens/s"),
        _col(
            "ttft_s",
            _F,
            "seconds from the start of the request (started_at: its document's prefill or "
            "load, or its batch) to its first token",
        ),
        _col("decode_s", _F, "seconds decoding the answer"),
        _col(
            "decode_tok_s",
            _F,
            "decode throughput of this sequence after its first token, tokens/s; null for an "
            "answer of fewer than 2 tokens",
        ),
        _col("batch_size", _I, "sequences decoded together"),
        _col("cache_source", _S, "where the document's prefix came from: memory | disk | none"),
        _col(
            "peak_mem_gb",
            _F,
            "peak accelerator/process memory during the request, GB of 2^30 bytes (GiB)",
        ),
        _col("started_at", _TS, "when the request started (UTC)"),
        _col("finished_at", _TS, "when the row was finished (UTC)", nullable=False),
    ],
    metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode()},
)

# Columns added to schema v1 later: a file without them reads as if they held nulls.
ADDED_COLUMNS = (
    "request_line",
    "draft_tokens",
    "accepted_tokens",
    "logprobs",
    "choice_logprobs",
    "reasoning_tokens",
)

_REQUIRED_TEXT = ("run_id", "job_name", "doc_id", "doc_path", "question_id", "request_key", "model")


NOT_UTF8_PATH = " (file name not UTF-8: its bytes shown as \\xNN)"


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def escape_surrogates(text: str) -> str:
    """`text` with what UTF-8 cannot hold written out: a byte of a file name that was not
    UTF-8 (Python keeps it as a surrogate, U+DC80 to U+DCFF) as `\\xNN`, any other lone
    surrogate as `\\udNNN`."""
    out = []
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


class OutputWarning(UserWarning):
    """Something in a results folder was skipped (a corrupt part file); its rows are redone."""


@dataclass(frozen=True, kw_only=True)
class ResultRow:
    """One document × question, as the runner finished it. Fields are RESULT_SCHEMA's columns,
    in its order (see the column descriptions there). Invalid rows raise ValueError: rows come
    from the runner, never from user input, so a bad one is a bug.
    """

    run_id: str
    job_name: str
    doc_id: str
    doc_path: str
    doc_sha256: str
    question_id: str
    question: str
    custom_id: str | None = None  # None -> "<doc_id>/<question_id>"
    request_key: str
    request_line: int | None = None
    answer: str | None = None
    reasoning: str | None = None
    finish_reason: str = "stop"
    status: str = "ok"
    error: str | None = None
    logprobs: list[dict] | None = None
    choice_logprobs: list[dict] | None = None
    model: str
    model_sha: str | None = None
    quant_bits: int | None = None
    doc_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    doc_prefill_s: float | None = None
    prefill_tok_s: float | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    decode_tok_s: float | None = None
    batch_size: int | None = None
    cache_source: str | None = None
    peak_mem_gb: float | None = None
    started_at: datetime | None = None
    finished_at: datetime

    def __post_init__(self) -> None:
        if self.custom_id is None:
            object.__setattr__(self, "custom_id", f"{self.doc_id}/{self.question_id}")
        # Parquet holds UTF-8 only: a file name's bytes that are not UTF-8 are escaped, and the
        # path says so (a name like `caf\xe9.txt` may also be spelled so); any other lone
        # surrogate (JSON allows "\ud800") is escaped too.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and not _is_utf8(value):
                note = NOT_UTF8_PATH if f.name == "doc_path" else ""
                object.__setattr__(self, f.name, escape_surrogates(value) + note)
        problems = [
            f"{name} must be a non-empty string, got {getattr(self, name)!r}"
            for name in _REQUIRED_TEXT + ("custom_id",)
            if not isinstance(getattr(self, name), str) or not getattr(self, name)
        ]
        problems += [
            f"{name} must be a string, got {getattr(self, name)!r}"
            for name in ("doc_sha256", "question")
            if not isinstance(getattr(self, name), str)
        ]
        for name, allowed, value in (
            ("status", STATUSES, self.status),
            ("finish_reason", FINISH_REASONS, self.finish_reason),
            ("cache_source", (*CACHE_SOURCES, None), self.cache_source),
        ):
            if value not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {value!r}")
        if self.status == "ok" and (
            not isinstance(self.answer, str)
            or self.error is not None
            or self.finish_reason == "error"
        ):
            problems.append("an ok row needs a str answer, no error and finish_reason stop|length")
        if self.status == "error" and (not self.error or self.finish_reason != "error"):
            problems.append("an error row needs an error message and finish_reason 'error'")
        for f in fields(self):
            value = getattr(self, f.name)
            kind = RESULT_SCHEMA.field(f.name).type
            if value is None:
                continue
            if kind == _S and not isinstance(value, str):
                problems.append(f"{f.name} must be a string, got {value!r}")
            if kind == _I and (not isinstance(value, int) or isinstance(value, bool)):
                problems.append(f"{f.name} must be an int, got {value!r}")
            if kind == _F and (not isinstance(value, int | float) or isinstance(value, bool)):
                problems.append(f"{f.name} must be a number, got {value!r}")
            if kind == _TS and (not isinstance(value, datetime) or value.tzinfo is None):
                problems.append(f"{f.name} must be a timezone-aware datetime, got {value!r}")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, list) and all(isinstance(x, dict) for x in self.logprobs)
        ):
            problems.append(f"logprobs must be a list of token entries, got {self.logprobs!r}")
        if self.choice_logprobs is not None and not (
            isinstance(self.choice_logprobs, list)
            and all(isinstance(x, dict) for x in self.choice_logprobs)
        ):
            problems.append(
                f"choice_logprobs must be a list of choices, got {self.choice_logprobs!r}"
            )
        if self.finished_at is None:
            problems.append("finished_at is required")
        if problems:
            raise ValueError(f"ResultRow {self.request_key!r}: " + "; ".join(problems))

    def to_record(self) -> dict[str, Any]:
        """The row as a dict in RESULT_SCHEMA's column order, timestamps in UTC."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("started_at", "finished_at"):
            if record[name] is not None:
                record[name] = record[name].astimezone(timezone.utc)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ResultRow:
        """Inverse of `to_record` (e.g. a row of `read_results(...).to_pylist()`)."""
        return cls(**{name: record[name] for name in RESULT_SCHEMA.names})


def current_versions() -> dict[str, str | None]:
    """Versions for the file metadata; reads package metadata only (no MLX import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = None
    return {
        "salabatch": __version__,
        "mlx": mlx,
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
    }


def encode_metadata(
    *,
    job_spec_json: str,
    versions_json: str,
    created_at: str,
    updated_at: str | None = None,
    retried_by: Iterable[str] = (),
) -> dict[bytes, bytes]:
    """The file metadata of a part (no updated_at: not merged yet) or of a merged file."""
    meta = {
        META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
        META_JOB_SPEC: job_spec_json.encode(),
        META_VERSIONS: versions_json.encode(),
        META_CREATED_AT: created_at.encode(),
    }
    if updated_at is not None:
        meta[META_UPDATED_AT] = updated_at.encode()
    if retried_by := sorted(retried_by):
        meta[META_RETRIED_BY] = json.dumps(retried_by).encode()
    return meta


def decode_metadata(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    """A results file's metadata as Python values: schema_version (int or None), job_spec and
    versions (JSON-decoded, or None), created_at and updated_at (ISO 8601 UTC strings, or None),
    retried_by (a frozenset of run_ids, see META_RETRIED_BY)."""
    metadata = metadata or {}

    def text(key: bytes) -> str | None:
        value = metadata.get(key)
        return value.decode("utf-8", errors="replace") if value is not None else None

    def parsed(key: bytes) -> Any:
        raw = text(key)
        with contextlib.suppress(ValueError):
            return json.loads(raw) if raw is not None else None
        return raw

    version = text(META_SCHEMA_VERSION)
    return {
        "schema_version": int(version) if version and version.isdigit() else None,
        "job_spec": parsed(META_JOB_SPEC),
        "versions": parsed(META_VERSIONS),
        "created_at": text(META_CREATED_AT),
        "updated_at": text(META_UPDATED_AT),
        "retried_by": _strings(parsed(META_RETRIED_BY)),
    }


def _strings(value: Any) -> frozenset[str]:
    """A list of strings from the metadata, or nothing for anything else (a damaged value)."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    return frozenset()
