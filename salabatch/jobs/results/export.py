"""A results file for people and for other tools: `salabatch inspect` and `salabatch export`.

Both read through `read_results`, so they see what resume sees: the merged file plus the parts
of a running or killed run, one row per request; or, given a folder (a Parquet dataset written
by Ray, results collected from several machines), the rows of all its files, deduplicated.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from salabatch.errors import OutputError
from salabatch.files import json_line, same_file, write_atomic
from salabatch.jobs.results.read import dataset_files, read_results
from salabatch.jobs.results.schema import (
    META_SKIPPED_FILES,
    RESPONSE_ROWS,
    TEXT_ROWS,
    OutputWarning,
    decode_metadata,
)
from salabatch.plural import counted

_TOP_ERRORS = 5
_REASON_CHARS = 90
_ANSWER_LINES = 4
_ANSWER_CHARS = 100


def inspect_results(path: str | os.PathLike, show: int = 0, below: float | None = None) -> str:
    """A plain-text summary of a results file or folder: counts, tokens, mean speeds, the most
    common errors; then the first `show` answers (in the file's doc_id, question_id order), or
    with `below`, the choices answers less probable than it (the first `show`, or all)."""
    table = read_results(path)
    meta = decode_metadata(table.schema.metadata)
    folder = Path(path).is_dir()
    ok = pc.equal(table["status"], "ok")
    n_ok = pc.sum(ok).as_py() or 0
    prefilled = table.filter(pc.greater(pc.fill_null(table["doc_prefill_s"], 0.0), 0.0))

    skipped = int((table.schema.metadata or {}).get(META_SKIPPED_FILES, b"0"))
    files = len(dataset_files(Path(path))) - skipped if folder else 0
    skipped_note = f", {counted(skipped, 'other .parquet file')} skipped" if skipped else ""
    head = [
        (
            "results",
            f"{path} (a folder: {files} .parquet files{skipped_note})" if folder else str(path),
        ),
        ("job", _distinct(table["job_name"]) or _job_name(meta)),
        ("model", _models(table)),
        ("created", meta["created_at"] or "-"),
        (
            "updated",
            meta["updated_at"]
            or ("-" if folder else "- (not merged yet: a run is going or was killed)"),
        ),
        ("runs", str(len(pc.unique(table["run_id"])))),
    ]
    # a request line's row (its line in request_line) has its custom_id for a document
    asked = table.filter(pc.is_null(table["request_line"]))
    counts = [
        ("rows", _int(table.num_rows)),
        ("  ok", _int(n_ok)),
        ("  errors", _int(table.num_rows - n_ok)),
        ("documents", _int(len(pc.unique(asked["doc_id"])))),
        ("questions", _int(len(pc.unique(asked["question_id"])))),
        *(
            [("request lines", _int(table.num_rows - asked.num_rows))]
            if len(asked) < len(table)
            else []
        ),
        ("prompt tokens", _int(pc.sum(table["prompt_tokens"]).as_py())),
        ("cached tokens", _int(pc.sum(table["cached_tokens"]).as_py())),
        ("completion tokens", _int(pc.sum(table["completion_tokens"]).as_py())),
        (
            "prefill tok/s, mean",
            _num(pc.mean(prefilled["prefill_tok_s"]).as_py())
            + f"  (over {counted(prefilled.num_rows, 'row')} that prefilled a document)",
        ),
        ("decode tok/s, mean", _num(pc.mean(table.filter(ok)["decode_tok_s"]).as_py())),
        ("ttft s, mean", _num(pc.mean(table["ttft_s"]).as_py(), digits=3)),
    ]
    drafted = pc.sum(table["draft_tokens"]).as_py()
    if drafted:  # speculative decoding was on for some rows
        accepted = pc.sum(table["accepted_tokens"]).as_py() or 0
        counts.append(
            ("drafts accepted", f"{_int(accepted)} of {_int(drafted)} ({accepted / drafted:.0%})")
        )
    chosen = [  # a choices question's rows: the probability of the answer each gave
        p for r in table.filter(ok).to_pylist() if (p := _answer_probability(r)) is not None
    ]
    lines = _aligned(head) + [""] + _aligned(counts, right=True)
    if chosen:  # how sure they were, and how many a reader may want to check
        unsure = sum(p < _UNSURE for p in chosen)
        mean = _num(sum(chosen) / len(chosen), 3)
        lines += [
            "",
            f"choices answered: {_int(len(chosen))}, the answer's probability {mean} on average, "
            f"{_int(unsure)} below {_UNSURE} (--below {_UNSURE} lists them)",
        ]

    errors = Counter(
        _clip(" ".join((e or "").split()), _REASON_CHARS)
        for e in table.filter(pc.invert(ok))["error"].to_pylist()
    )
    if errors:
        lines += ["", "most common errors", *_aligned_counts(errors.most_common(_TOP_ERRORS))]
        if len(errors) > _TOP_ERRORS:
            lines.append(f"  … and {len(errors) - _TOP_ERRORS} other reasons")

    if below is not None:
        unsure = [
            r
            for r in table.filter(ok).to_pylist()
            if (p := _answer_probability(r)) is not None and p < below
        ]
        picked = unsure[:show] if show > 0 else unsure
        lines += ["", f"choices answers less probable than {below}: {len(unsure)}"]
        lines += [_answer_block(r) for r in picked]
        if len(picked) < len(unsure):
            lines.append(f"… and {_int(len(unsure) - len(picked))} more")
    elif show > 0:
        shown = table.slice(0, show).to_pylist()
        lines += ["", f"answers (first {len(shown)} of {table.num_rows})"]
        for r in shown:
            lines.append(_answer_block(r))
    return "\n".join(lines)


def export_openai_jsonl(
    path: str | os.PathLike,
    out: str | os.PathLike | TextIO,
    *,
    lines: Mapping[str, int] | None = None,
) -> int:
    """Write the rows as the OpenAI Batch API's output file: one JSON object per line,
    `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion>},
    "error": null}`, or for an error row `"response": null, "error": {"code", "message", "line"}`.
    A think row's reasoning is the message's `reasoning_content`. A /v1/completions line's row
    (question_id `completion`) is a `text_completion`, its logprobs in the legacy form.

    Request rows come first, in the order of their lines in the requests file (`lines`:
    request_key -> line, the file as it is now, where a run knows it; else the line each row
    was answered from), then document rows in the results' order (doc_id, question_id).
    `out`: a file path (written atomically) or an open text stream. Returns the number of lines.
    """
    records = read_results(path).to_pylist()
    for r in records:
        r["request_line"] = (lines or {}).get(r["request_key"], r["request_line"])
    records.sort(key=lambda r: (r["request_line"] is None, r["request_line"] or 0))
    repeated = [cid for cid, n in Counter(r["custom_id"] for r in records).items() if n > 1]
    if repeated:
        warnings.warn(
            f"{path}: {len(repeated)} custom_id values occur more than once "
            f"(first: {repeated[0]!r}); tools that join on custom_id will see duplicates",
            OutputWarning,
            stacklevel=2,
        )
    lines = (json_line(_openai_line(r)) + "\n" for r in records)
    _write_text(out, lines)
    return len(records)


def _answer_probability(row: dict) -> float | None:
    """The probability of the choice a choices row answered (drawn above temperature 0, it need
    not be the likeliest), or None for a row of another question."""
    choices = row["choice_logprobs"]
    if not choices:
        return None
    given = [c["probability"] for c in choices if c["choice"] == row["answer"]]
    return given[0] if given else max(c["probability"] for c in choices)


_UNSURE = 0.5  # a choices answer less probable than this is counted as unsure by inspect
_BATCH_LINE_KEYS = {"id", "custom_id", "response", "error"}
_BATCH_ID = re.compile(r"batch_req_[0-9a-f]{32}")
_MAX_LINE = 64 * 2**20  # a first line longer than this is no line of ours


def is_batch_output(path: str | os.PathLike) -> bool:
    """Whether the regular file `path` holds OpenAI Batch output lines salabatch wrote (as
    `export_openai_jsonl` writes them: its ids), or nothing: a file a run may replace."""
    with open(path, "rb") as f:
        while line := f.readline(_MAX_LINE):
            if line.strip():
                break
        else:
            return True  # empty, or blank lines only
    try:
        first = json.loads(line)
    except ValueError:
        return False
    return (
        isinstance(first, dict)
        and first.keys() == _BATCH_LINE_KEYS
        and isinstance(first["id"], str)
        and _BATCH_ID.fullmatch(first["id"]) is not None
    )


def export_rows_jsonl(path: str | os.PathLike, out: str | os.PathLike | TextIO) -> int:
    """Write the rows as flat JSON lines: one object per row, every column (RESULT_SCHEMA's
    names and order), timestamps in ISO 8601, in the results' order. Returns the rows."""
    records = read_results(path).to_pylist()
    _write_text(out, (json_line(_plain(r)) + "\n" for r in records))
    return len(records)


def export_csv(path: str | os.PathLike, out: str | os.PathLike | TextIO) -> int:
    """Write the rows as CSV: a header of the column names, then one record per row (an
    answer's newlines stay inside its quoted field; nulls are empty), timestamps in ISO 8601,
    in the results' order. Returns the rows."""
    table = read_results(path)

    def lines() -> Iterator[str]:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\r\n")  # RFC 4180: a lone CR is quoted too
        writer.writerow(table.column_names)
        for record in table.to_pylist():  # a list (logprobs) as its JSON text
            values = _plain(record).values()
            writer.writerow(
                json.dumps(v, ensure_ascii=False) if isinstance(v, list) else v for v in values
            )
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
        yield buffer.getvalue()  # the header of a file without rows

    _write_text(out, lines())
    return table.num_rows


# format -> (writer, the suffix its output file must have)
EXPORTERS: dict[str, tuple[Callable[[str | os.PathLike, Any], int], str]] = {
    "openai-jsonl": (export_openai_jsonl, ".jsonl"),
    "jsonl": (export_rows_jsonl, ".jsonl"),
    "csv": (export_csv, ".csv"),
}


def export_format(out: str | os.PathLike | None) -> str:
    """The format an output path's suffix asks for: `.csv` CSV, else OpenAI Batch lines."""
    return "csv" if out is not None and Path(out).suffix.lower() == ".csv" else "openai-jsonl"


def export_results(path: str | os.PathLike, out: str | os.PathLike | TextIO, fmt: str) -> int:
    """Write the results in `fmt` (a key of EXPORTERS) to `out`, a stream or a file path
    whose suffix must be the format's (its folders are made); returns the rows written."""
    if fmt not in EXPORTERS:
        raise OutputError(
            "unknown export format", field="--format", expected=list(EXPORTERS), got=fmt
        )
    export, suffix = EXPORTERS[fmt]
    if not hasattr(out, "write"):
        out = Path(out)
        if out.suffix.lower() != suffix:
            got = out.suffix or "a name without a suffix"
            raise OutputError(
                f"--format {fmt} writes a {suffix} file, not {got}: name the output "
                f"{out.with_suffix(suffix).name}, or choose the format that fits",
                path=out,
            )
        if (requests := _requests_of(path)) is not None and same_file(out, requests):
            raise OutputError(
                "is the requests file these results answer; refusing to overwrite the input",
                path=out,
            )
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create its folder ({e.strerror or e})", path=out) from e
    return export(path, out)


def _requests_of(path: str | os.PathLike) -> Path | None:
    """The requests file of a results file's job (from its footer alone), or None."""
    try:
        meta = decode_metadata(pq.read_schema(path).metadata)
    except (OSError, ValueError, pa.ArrowException):  # a folder, parts only: read as it is
        return None
    spec = meta["job_spec"]
    requests = spec.get("requests") if isinstance(spec, dict) else None
    return Path(requests) if isinstance(requests, str) else None


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """A row with its timestamps as ISO 8601 text, for JSON and CSV."""
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in record.items()}


# --- OpenAI batch output -------------------------------------------------------------------


def _openai_line(r: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI batch output file. Ids are derived from (run_id, request_key), so
    exporting the same results twice gives the same bytes."""
    line: dict[str, Any] = {
        "id": f"batch_req_{_stable_id('batch_req', r)}",
        "custom_id": r["custom_id"],
        "response": None,
        "error": None,
    }
    if r["status"] != "ok":
        line["error"] = {"code": "salabatch_error", "message": r["error"] or "unknown error"}
        if r["request_line"] is not None:
            line["error"]["line"] = r["request_line"]
        return line
    prompt, completion = r["prompt_tokens"] or 0, r["completion_tokens"] or 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if r["cached_tokens"] is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": r["cached_tokens"]}
    if r["draft_tokens"]:  # OpenAI's counts of a predicted output are the nearest
        accepted = r["accepted_tokens"] or 0
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": r["draft_tokens"] - accepted,
        }
    created = r["started_at"] or r["finished_at"]
    if r["question_id"] == RESPONSE_ROWS:
        line["response"] = _response_line(r, created)
        return line
    if r["reasoning_tokens"] is not None:
        details = usage.setdefault("completion_tokens_details", {})
        details["reasoning_tokens"] = r["reasoning_tokens"]
    if r["question_id"] == TEXT_ROWS:
        kind, choice = "text_completion", {"text": r["answer"], "logprobs": _legacy(r["logprobs"])}
    else:
        message = {"role": "assistant", "content": r["answer"], "refusal": None}
        if r["reasoning"] is not None:
            message["reasoning_content"] = r["reasoning"]
        lp = None if r["logprobs"] is None else {"content": r["logprobs"], "refusal": None}
        kind, choice = "chat.completion", {"message": message, "logprobs": lp}
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    line["response"] = {
        "status_code": 200,
        "request_id": f"req_{_stable_id('request', r)}",
        "body": {
            "id": f"{prefix}-{_stable_id(prefix, r)}",
            "object": kind,
            "created": int(created.timestamp()),
            "model": r["model"],
            "choices": [{"index": 0, **choice, "finish_reason": r["finish_reason"]}],
            "usage": usage,
            "system_fingerprint": f"fp_{r['model_sha'][:12]}" if r["model_sha"] else None,
        },
    }
    return line


def _response_line(r: dict[str, Any], created) -> dict[str, Any]:
    """The response of a /v1/responses line's row (`openai_api.response_body`): what it
    repeats of its request is what the row holds (its model; the request's settings are not
    kept)."""
    from salabatch import openai_api

    response_id = f"resp_{_stable_id('resp', r)}"
    shell = openai_api.response_shell(response_id, int(created.timestamp()), r["model"])
    echoed = shell | {"store": False}
    body = openai_api.response_body(
        echoed,
        content=r["answer"],
        reasoning=r["reasoning"],
        reasoning_tokens=r["reasoning_tokens"] or 0,
        finish_reason=r["finish_reason"],
        prompt_tokens=r["prompt_tokens"] or 0,
        cached_tokens=r["cached_tokens"] or 0,
        completion_tokens=r["completion_tokens"] or 0,
        completed_at=int(r["finished_at"].timestamp()),
    )
    return {"status_code": 200, "request_id": f"req_{_stable_id('request', r)}", "body": body}


def _legacy(entries: list[dict] | None) -> dict | None:
    """A text completion's logprobs object (`tokens`, `token_logprobs`, `top_logprobs` as
    {text: logprob} of the alternatives and the token itself, `text_offset`: where each
    token's text starts, in characters of the tokens' own bytes) from the `logprobs` column's
    entries, as the server's /v1/completions gives it."""
    if entries is None:
        return None
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    decoder, chars = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
    for e in entries:
        top = {bytes(t["bytes"]).decode(errors="replace"): t["logprob"] for t in e["top_logprobs"]}
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append(top | {e["token"]: e["logprob"]})
        out["text_offset"].append(chars)
        chars += len(decoder.decode(bytes(e["bytes"])))
    return out


def _stable_id(kind: str, r: dict[str, Any]) -> str:
    text = f"{kind}\0{r['run_id']}\0{r['request_key']}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _write_text(out: str | os.PathLike | TextIO, lines: Any) -> None:
    if hasattr(out, "write"):
        out.writelines(lines)
        return
    out = Path(out)

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(lines)

    try:
        write_atomic(out, write)
    except OSError as e:
        raise OutputError(f"cannot write the export ({e.strerror or e})", path=out) from e


# --- text formatting -----------------------------------------------------------------------


def _aligned(pairs: list[tuple[str, str]], *, right: bool = False) -> list[str]:
    width = max(len(k) for k, _ in pairs)
    if not right:
        return [f"{k:<{width}}  {v}" for k, v in pairs]
    # Right-align the number, keep any note after it ("1,234.5  (over 3 rows ...)").
    heads = [v.split("  ", 1) for _, v in pairs]
    num_width = max(len(h[0]) for h in heads)
    return [
        f"{k:<{width}}  {h[0]:>{num_width}}" + (f"  {h[1]}" if len(h) > 1 else "")
        for (k, _), h in zip(pairs, heads, strict=True)
    ]


def _aligned_counts(items: list[tuple[str, int]]) -> list[str]:
    width = max(len(_int(n)) for _, n in items)
    return [f"  {_int(n):>{width}}  {reason}" for reason, n in items]


def _answer_block(r: dict[str, Any]) -> str:
    title = f"[{r['doc_id']} / {r['question_id']}]"
    if r["status"] != "ok":
        return f"{title} error: {r['error']}"
    n = r["completion_tokens"]
    tokens = "" if n is None else f", {counted(n, 'token')}"
    if r["logprobs"]:  # a confidence at a glance: the mean log-probability of its tokens
        mean = sum(t["logprob"] for t in r["logprobs"]) / len(r["logprobs"])
        tokens += f", mean token logprob {mean:.3f}"
    text_lines = (r["answer"] or "").strip().splitlines() or ["(empty answer)"]
    body = [f"    {_clip(line, _ANSWER_CHARS)}" for line in text_lines[:_ANSWER_LINES]]
    if len(text_lines) > _ANSWER_LINES:
        body.append(f"    … ({counted(len(text_lines) - _ANSWER_LINES, 'more line')})")
    if r["choice_logprobs"]:  # a choices question: every choice's probability, likeliest first
        ranked = sorted(r["choice_logprobs"], key=lambda c: -c["probability"])
        shown = ", ".join(f"{_clip(c['choice'], 40)} {c['probability']:.3f}" for c in ranked)
        body.append(f"    choices: {shown}")
    return "\n".join([f"{title} {r['finish_reason']}{tokens}", *body])


def _distinct(column: pa.ChunkedArray) -> str:
    return ", ".join(str(v) for v in pc.unique(column).to_pylist())


def _models(table: pa.Table) -> str:
    out = []
    for m in pc.unique(table["model"]).to_pylist():
        rows = table.filter(pc.equal(table["model"], m))
        bits = pc.unique(rows["quant_bits"]).to_pylist()
        shas = [s for s in pc.unique(rows["model_sha"]).to_pylist() if s]
        notes = [f"{b}-bit" for b in bits if b] + [f"sha {s[:12]}" for s in shas]
        out.append(m + (f" ({', '.join(notes)})" if notes else ""))
    return ", ".join(out) or "-"


def _job_name(meta: dict[str, Any]) -> str:
    spec = meta["job_spec"]
    return str(spec.get("name", "-")) if isinstance(spec, dict) else "-"


def _int(n: int | None) -> str:
    return f"{n:,}" if n is not None else "-"


def _num(x: float | None, digits: int = 1) -> str:
    return f"{x:,.{digits}f}" if x is not None else "-"


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
