"""Stage 1 of a job: documents in, text out, never crash.

`iter_documents(sources)` expands the files, folders and globs of a job's `documents:` list into
files (sorted, de-duplicated), reads each and yields `Document`s: one per .txt / .md / .pdf file,
one per non-empty line of a .jsonl file. A document that cannot be read (encrypted, corrupt or
scanned PDF, empty or undecodable text, bad JSON line) is still yielded, with `text == ""` and a
one-line `error`: the runner turns it into an error row for each question and the job goes on.
Only a mistake in the job file itself (a path that does not exist, a glob that matches nothing)
raises, as `JobSpecError`, when `iter_documents` is called and before any document is read.

`identify_documents(sources)` is the cheap pass beside it: per file, the ids and sha256 of its
documents exactly as `iter_documents` gives them, without extracting any text (a PDF is hashed,
not parsed). A row's key needs no more, so a resumed run finds its finished documents with it;
`read_documents` then reads one file's documents under the ids that pass gave them.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import json
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from salabatch.errors import JobSpecError
from salabatch.jobs.ingest.pdf import read_pdf
from salabatch.jobs.ingest.text import clean_text, decode_reason, decode_text, one_line

SUPPORTED_SUFFIXES = (".txt", ".md", ".pdf", ".jsonl")
_SUPPORTED_TEXT = " ".join(SUPPORTED_SUFFIXES)


@dataclass(frozen=True)
class Document:
    """One document, ready for the model, or the reason it is not.

    doc_id: readable id, unique within a job and stable across runs and machines. It comes from
        where the document is, never from its content, so an edited or re-extracted file keeps
        its id (`sha256` tells the versions apart): the path relative to the source root with
        forward slashes (folder `docs/` holding `2023/a b.pdf` -> `2023/a_b.pdf`; a file named
        directly -> its file name; a glob -> relative to the glob's fixed leading folders),
        Unicode NFC, every run of characters other than letters, digits and `_.+#@-` turned into
        one `_`. A jsonl record takes its id field, sanitized the same way, or else
        `<file id>#L<line>` (1-based line number). When two documents of a job would share an
        id, the later one (in reading order) gets `~2`, `~3`, ...
    path: the source file; for a jsonl record, the .jsonl file.
    text: the text for the model (newlines are `\\n`, no NUL bytes; PDF pages joined by
        `pdf.PAGE_BREAK`); "" when `error` is set.
    sha256: hex digest of the file's bytes; for a jsonl record, of the record's canonical JSON
        (sorted keys, compact separators, UTF-8), or of the line's bytes when it is not a JSON
        object; "" when the file was not read at all.
    n_pages: page count of a PDF that could be opened, else None.
    error: one-line reason the document has no text, or None.
    meta: JSON-compatible extras, e.g. PDF `title`, `encrypted`, `bad_pages` / `page_errors`
        (pages whose extraction failed, 1-based), `warnings` (pypdf's, deduplicated); for a
        jsonl record `line`, `id` (the raw id value) and `fields` (its other fields); `encoding`
        for a text file that was not UTF-8.
    """

    doc_id: str
    path: str
    text: str
    sha256: str
    n_pages: int | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def ok(self) -> bool:
        """True when the document has text for the model."""
        return self.error is None


@dataclass(frozen=True)
class DocumentSource:
    """One `documents:` entry of a job: a file, a folder or a glob pattern, already resolved.

    glob: for a folder, a pattern relative to it (`**/*.pdf`); default: every supported file,
        recursively. Walks never match hidden files or folders (`.git/`, macOS `._a.pdf`), and
        skip files of unsupported types; a file named directly is always read or reported.
    text_field, id_field: where the records of a .jsonl file keep their text and their id.
    """

    path: str | Path
    glob: str | None = None
    text_field: str = "text"
    id_field: str = "id"


@dataclass(frozen=True)
class SourceFile:
    """A file a job will read: its path, its id (see `Document.doc_id`), the source naming it."""

    path: Path
    rel_id: str
    source: DocumentSource


@dataclass(frozen=True)
class FileDocuments:
    """A file of a job and what names its documents, in reading order: (doc_id, sha256) each,
    as `iter_documents` gives them (`~2` suffixes included)."""

    file: SourceFile
    ids: tuple[tuple[str, str], ...]


def iter_documents(sources: Iterable[DocumentSource]) -> Iterator[Document]:
    """Documents of `sources`, in a deterministic order, one per file (one per jsonl line).

    Raises JobSpecError here, before anything is read, for a path that does not exist or a
    folder / glob with no supported file. Never raises for a bad document: see `Document.error`.
    """
    files = expand_sources(sources)
    return _read_all(files)


def identify_documents(sources: Iterable[DocumentSource]) -> Iterator[FileDocuments]:
    """Per file of `sources`, the doc_id and sha256 of each document `iter_documents` would
    yield, without extracting text: files are hashed, only jsonl lines are parsed (their ids
    and hashes come from the JSON). Raises JobSpecError as `iter_documents` does."""
    files = expand_sources(sources)
    return _identify_all(files)


def read_documents(file: SourceFile, ids: Sequence[tuple[str, str]]) -> list[Document]:
    """The documents of `file`, named as `identify_documents` named them (`ids`: its
    (doc_id, sha256) pairs for this file). Raises JobSpecError when the file no longer holds
    those documents: it changed since they were identified, or differs on this machine."""
    docs = list(_read_file(file))
    found = [doc.sha256 for doc in docs]
    if found != [sha256 for _, sha256 in ids]:
        raise JobSpecError(
            "the file changed since the run listed its documents, or differs on this machine",
            path=file.path,
            expected=f"{len(ids)} document(s) with the listed sha256",
            got=f"{len(docs)} document(s), sha256 {', '.join(s[:12] for s in found)}",
        )
    return [replace(doc, doc_id=doc_id) for doc, (doc_id, _) in zip(docs, ids, strict=True)]


def expand_sources(sources: Iterable[DocumentSource]) -> list[SourceFile]:
    """The files named by `sources`, in job order then sorted by relative path, each file once
    (the same file named twice, also through a link, is read at its first place)."""
    files: list[SourceFile] = []
    seen: set[object] = set()
    for index, source in enumerate(sources):
        for file in _expand(source, f"documents[{index}]"):
            key = _file_key(file.path)
            if key not in seen:
                seen.add(key)
                files.append(file)
    return files


def _expand(source: DocumentSource, where: str) -> list[SourceFile]:
    raw = os.path.expanduser(str(source.path))
    path = Path(raw)
    if path.is_dir():
        root, pattern = path, source.glob or "**/*"
    elif path.exists():
        if source.glob:
            raise JobSpecError(
                "glob applies to a folder, not a file", path=raw, field=f"{where}.glob"
            )
        return [SourceFile(path, _sanitize(path.name), source)]
    elif globlib.has_magic(raw):
        if source.glob:
            raise JobSpecError("path is already a glob pattern", path=raw, field=f"{where}.glob")
        root, pattern = _split_glob(path)
    else:
        raise JobSpecError("document path does not exist", path=raw, field=f"{where}.path")

    # glob.glob (unlike Path.glob) skips hidden names unless the pattern spells them out.
    matches = sorted(
        Path(match).as_posix()
        for match in globlib.glob(pattern, root_dir=root, recursive=True)
        if Path(match).suffix.lower() in SUPPORTED_SUFFIXES and (root / match).is_file()
    )
    if not matches:
        raise JobSpecError(
            f"no {_SUPPORTED_TEXT} files match {pattern!r} in {root}",
            path=raw,
            field=f"{where}.path",
        )
    return [SourceFile(root / rel, _sanitize(rel), source) for rel in matches]


def _split_glob(pattern: Path) -> tuple[Path, str]:
    """`/data/docs/**/*.pdf` -> (`/data/docs`, `**/*.pdf`): fixed leading folders, then the rest."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if globlib.has_magic(part))
    return Path(*parts[:fixed]) if fixed else Path("."), "/".join(parts[fixed:])


def _file_key(path: Path) -> object:
    """Identity of a file: the same inode however it is named (links, case-insensitive disks)."""
    try:
        stat = path.stat()
    except OSError:
        return os.path.realpath(path)
    return (stat.st_dev, stat.st_ino)


def _sanitize(name: str) -> str:
    """A readable id from a relative path or a user's id: see `Document.doc_id`."""
    name = unicodedata.normalize("NFC", name.replace(os.sep, "/"))
    name = re.sub(r"[^\w.+#@/-]+", "_", name)
    return "/".join(part for part in name.split("/") if part not in ("", ".", ".."))


def _read_all(files: list[SourceFile]) -> Iterator[Document]:
    used: set[str] = set()
    for file in files:
        for doc in _read_file(file):
            doc_id = _unique(doc.doc_id, used)
            yield doc if doc_id == doc.doc_id else replace(doc, doc_id=doc_id)


def _identify_all(files: list[SourceFile]) -> Iterator[FileDocuments]:
    used: set[str] = set()
    for file in files:
        ids = tuple((_unique(doc_id, used), sha256) for doc_id, sha256 in _identify_file(file))
        yield FileDocuments(file, ids)


def _unique(doc_id: str, used: set[str]) -> str:
    """`doc_id`, or `doc_id~2`, `~3`, ... when a document read earlier has it; noted in `used`."""
    unique, n = doc_id, 1
    while unique in used:
        n += 1
        unique = f"{doc_id}~{n}"
    used.add(unique)
    return unique


def _identify_file(file: SourceFile) -> list[tuple[str, str]]:
    """(doc_id, sha256) of each document `_read_file(file)` yields, before de-duplication."""
    if file.path.suffix.lower() not in SUPPORTED_SUFFIXES:
        return [(file.rel_id, "")]
    try:
        data = file.path.read_bytes()
    except OSError:
        return [(file.rel_id, "")]
    sha256 = hashlib.sha256(data).hexdigest()
    if data and file.path.suffix.lower() == ".jsonl":
        records = [_parse_record(file, number, raw)[:2] for number, raw in _lines(data)]
        return records or [(file.rel_id, sha256)]
    return [(file.rel_id, sha256)]


def _read_file(file: SourceFile) -> Iterator[Document]:
    """The document(s) of one file; every failure becomes an error Document."""
    suffix = file.path.suffix.lower()

    def failed(reason: str, sha256: str = "", **kw: Any) -> Document:
        return Document(file.rel_id, str(file.path), "", sha256, error=reason, **kw)

    if suffix not in SUPPORTED_SUFFIXES:
        yield failed(f"unsupported file type {suffix or '(none)'}; supported: {_SUPPORTED_TEXT}")
        return
    try:
        data = file.path.read_bytes()
    except OSError as e:
        yield failed(f"cannot read file: {e.strerror or one_line(e)}")
        return
    sha256 = hashlib.sha256(data).hexdigest()
    if not data:
        yield failed("empty file (0 bytes)", sha256)
        return
    if suffix == ".jsonl":
        yield from _read_jsonl(file, data, sha256)
        return
    if suffix == ".pdf":
        text, n_pages, error, meta = read_pdf(data)
    else:
        (text, error, meta), n_pages = decode_text(data), None
    if error:
        yield failed(error, sha256, n_pages=n_pages, meta=meta)
    else:
        yield Document(file.rel_id, str(file.path), text, sha256, n_pages=n_pages, meta=meta)


# ---- jsonl --------------------------------------------------------------------------------------


def _read_jsonl(file: SourceFile, data: bytes, file_sha256: str) -> Iterator[Document]:
    """One document per non-empty line; a bad line is an error document, the others go on."""
    n_records = 0
    for number, raw in _lines(data):
        n_records += 1
        yield _read_record(file, number, raw)
    if n_records == 0:
        reason = "no records: every line is blank"
        yield Document(file.rel_id, str(file.path), "", file_sha256, error=reason)


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a jsonl file, with their 1-based numbers."""
    for number, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).split(b"\n"), 1):
        if raw.strip():
            yield number, raw


def _parse_record(
    file: SourceFile, number: int, raw: bytes
) -> tuple[str, str, dict[str, Any] | None, str | None]:
    """(doc_id, sha256, record, problem) of line `number`: its id and hash as `Document` gives
    them, the JSON object (None when the line holds none), and why it is not a usable record."""
    id_field = file.source.id_field
    doc_id, sha256 = f"{file.rel_id}#L{number}", hashlib.sha256(raw.strip()).hexdigest()
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return doc_id, sha256, None, decode_reason(e, "utf-8")
    except json.JSONDecodeError as e:
        return doc_id, sha256, None, f"invalid JSON: {e.msg} at column {e.colno}"
    if not isinstance(record, dict):
        return doc_id, sha256, None, f"expected a JSON object, got {type(record).__name__}"

    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    sha256 = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    raw_id = record.get(id_field)
    if raw_id is not None:
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            kind = type(raw_id).__name__
            problem = f"id field {id_field!r} must be a string or integer, got {kind}"
            return doc_id, sha256, record, problem
        doc_id = _sanitize(str(raw_id)) or doc_id
    return doc_id, sha256, record, None


def _read_record(file: SourceFile, number: int, raw: bytes) -> Document:
    """The document of line `number` (1-based) of a jsonl file."""
    text_field, id_field = file.source.text_field, file.source.id_field
    doc_id, sha256, record, problem = _parse_record(file, number, raw)
    meta: dict[str, Any] = {"line": number}

    def failed(reason: str) -> Document:
        return Document(
            doc_id, str(file.path), "", sha256, error=f"line {number}: {reason}", meta=meta
        )

    if record is not None:
        fields = {k: v for k, v in record.items() if k not in (text_field, id_field)}
        if fields:
            meta["fields"] = fields
        if record.get(id_field) is not None:
            meta["id"] = record[id_field]
    if problem:
        return failed(problem)

    text = record.get(text_field)
    if text_field not in record:
        return failed(f"missing text field {text_field!r} (fields: {', '.join(record) or 'none'})")
    if not isinstance(text, str):
        return failed(f"text field {text_field!r} must be a string, got {type(text).__name__}")
    text = clean_text(text)
    if not text.strip():
        return failed("empty document (only whitespace)")
    return Document(doc_id, str(file.path), text, sha256, meta=meta)
