"""Stage 1 of a job: documents in, text out, never crash.

`iter_documents(sources)` expands the files, folders and globs of a job's `documents:` list into
files (sorted, de-duplicated), reads each and yields `Document`s: one per text or PDF file, one
per non-empty line of a .jsonl file. A document that cannot be read (encrypted, corrupt or
scanned PDF, empty or undecodable text, bad JSON line, a FIFO or a device, a file over the byte
limit of the job's `max_context`, a file of an unknown type named directly) is still yielded,
with `text == ""` and a one-line `error`: the runner turns it into an error row for each
question and the job goes on. So is a folder that cannot be listed (no permission), in place
of the files it holds: a walk never leaves one out silently. Only a mistake in the job file
itself (a path that does not exist, a glob that matches nothing) raises, as `JobSpecError`,
when `iter_documents` is called and before any document is read.

`identify_documents(sources)` is the cheap pass beside it: per file, the ids and sha256 of its
documents exactly as `iter_documents` gives them, without extracting any text (a PDF is hashed,
not parsed). A row's key needs no more, so a resumed run finds its finished documents with it;
`read_documents` then reads one file's documents under the ids that pass gave them.

How a file is read: as its entry's `format` says (text, pdf, jsonl), else by its suffix: .pdf,
.jsonl, or one of `TEXT_SUFFIXES` as plain text (markup and code as they are). A folder walk
without a glob takes the files with `DEFAULT_SUFFIXES`; with a glob, every file of a known type
it matches; with a format, every file it matches.
"""

from __future__ import annotations

import codecs
import errno
import fnmatch
import glob as globlib
import hashlib
import json
import os
import re
import stat
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from salabatch.errors import JobSpecError, not_utf8
from salabatch.jobs.ingest.pdf import read_pdf
from salabatch.jobs.ingest.text import (
    bom_codec,
    clean_text,
    decode_reason,
    decode_text,
    one_line,
    size_text,
)
from salabatch.plural import counted

FORMATS = ("text", "pdf", "jsonl")
# What a folder walk without a glob takes.
DEFAULT_SUFFIXES = (".txt", ".md", ".pdf", ".jsonl")
_DEFAULT_TEXT = " ".join(DEFAULT_SUFFIXES)
# Read as plain text when named directly or matched by a glob: prose, markup, data and code.
_TEXT_SUFFIXES = (
    ".txt .text .md .markdown .rst .adoc .asciidoc .org .tex .html .htm .xml .csv .tsv "
    ".json .yaml .yml .toml .ini .cfg .conf .log .srt .vtt .py .ipynb .js .ts .java .c .h "
    ".cc .cpp .hpp .cs .go .rs .rb .php .swift .kt .scala .r .jl .lua .sh .sql .css"
)
TEXT_SUFFIXES = frozenset(_TEXT_SUFFIXES.split())
# The byte limit of a document, from engine.max_context, checked before a file is read: a token
# of text is about 4 bytes (English; up to ~3 a CJK character) and more only in long runs of one
# character, so a text 16 times max_context bytes long cannot fit. A PDF also holds fonts,
# images and structure. A jsonl file's limit is per line: per document.
BYTES_PER_TOKEN = {"text": 16, "jsonl": 16, "pdf": 256}
_LINE_CHUNK = 2**20  # bytes read at a time past the end of a jsonl line over its limit


@dataclass(frozen=True)
class Document:
    """One document, ready for the model, or the reason it is not.

    doc_id: readable id, unique within a job and the same on every run and machine. It comes from
        where the document is, never from its content, so an edited or re-extracted file keeps
        its id (`sha256` tells the versions apart): the path relative to the source root with
        forward slashes (folder `docs/` holding `2023/a b.pdf` -> `2023/a_b.pdf`; a file named
        directly -> its file name; a glob -> relative to the glob's fixed leading folders),
        Unicode NFC, every run of characters other than letters, digits and `_.+#@-` turned into
        one `_`. A jsonl record takes its id field, sanitized the same way, or else
        `<file id>#L<line>` (1-based line number). When two documents of a job would share an
        id, the later one (in reading order) gets `~2`, `~3`, ...: so the ids stay while files
        named alike are added after the others (one added before takes the earlier one's id).
    path: the source file; for a jsonl record, the .jsonl file.
    text: the text for the model (newlines are `\\n`, no NUL bytes; PDF pages joined by
        `pdf.PAGE_BREAK`); "" when `error` is set.
    sha256: hex digest of the file's bytes; for a jsonl record, of the record's canonical JSON
        (sorted keys, compact separators, UTF-8), or of the line's bytes when it is not a JSON
        object or holds a lone surrogate; "" when the file was not read at all.
    n_pages: page count of a PDF that could be opened, else None.
    error: one-line reason the document has no text, or None.
    read_as: the settings of its `documents:` entry that change the text its bytes give
        (`SourceFile.read_as`), "" for none; a row's key holds it beside `sha256`.
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
    read_as: str = ""

    @property
    def ok(self) -> bool:
        """True when the document has text for the model."""
        return self.error is None


@dataclass(frozen=True)
class DocumentSource:
    """One `documents:` entry of a job: a file, a folder or a glob pattern, already resolved.

    glob: for a folder, a pattern relative to it (`**/*.pdf`); default: every file with one of
        `DEFAULT_SUFFIXES`, recursively. Walks never match hidden files or folders (`.git/`,
        macOS `._a.pdf`), take regular files only (no FIFO, device or socket) of a known type,
        and never enter a folder they walked already (a link back up); a file named directly
        is always read or reported.
    text_field, id_field: where the records of a .jsonl file keep their text and their id.
    format: "text", "pdf" or "jsonl": every file of the entry is read so, whatever its suffix
        (none included); None: by suffix.
    max_tokens: the job's `engine.max_context`; a document over `BYTES_PER_TOKEN` times as
        many bytes is not read (an error document); None: no limit.
    skip: the job's own files (its results and their parts folder, its Batch output, its
        requests): a walk or a glob never takes them, so results written into a documents
        folder are not read back as documents by the next run.
    first_tokens: only a text file's first tokens are wanted (`salabatch perplexity
        --max-tokens`): it is read as far as `BYTES_PER_TOKEN` bytes each can reach and cut
        there, at a character's end, never refused for its size.
    """

    path: str | Path
    glob: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    format: str | None = None
    max_tokens: int | None = None
    skip: tuple[Path, ...] = ()
    first_tokens: int | None = None


@dataclass(frozen=True)
class SourceFile:
    """A file a job will read: its path, its id (see `Document.doc_id`), the source naming it.

    error: why the path cannot be read at all (a folder that cannot be listed, a path that
        cannot be looked at): it stands for what it holds as one error document.
    """

    path: Path
    rel_id: str
    source: DocumentSource
    error: str | None = None

    @property
    def format(self) -> str | None:
        """How the file is read: its entry's format, else by suffix; None: an unknown type."""
        return self.source.format or format_of(self.path)

    @property
    def read_as(self) -> str:
        """The entry's settings that make the file's bytes give another text than the defaults
        would: a format other than its suffix's, a jsonl file's text_field other than `text`
        ("" for none). An edit of one changes the documents' rows' keys, so a rerun redoes them
        as it does for an edited file."""
        settings = []
        if self.source.format is not None and self.source.format != format_of(self.path):
            settings.append(f"format={self.source.format}")
        if self.format == "jsonl" and self.source.text_field != "text":
            settings.append(f"text_field={self.source.text_field}")
        return " ".join(settings)

    @property
    def unread(self) -> str | None:
        """Why the file's one document is an error before anything is read (see `error`, an
        unknown type, or not a regular file: a FIFO or a device named directly), or None."""
        if self.error:
            return self.error
        if self.format is None:
            return (
                f"unsupported file type {self.path.suffix or '(none)'}; supported: "
                f"{_DEFAULT_TEXT}, text files (.rst .html .py …), or any file with the "
                "entry's format:"
            )
        try:
            _check_regular(os.stat(self.path).st_mode)
        except OSError:
            return None  # reading it says why
        except _Unreadable as e:
            return str(e)
        return None


def format_of(path: Path) -> str | None:
    """The format a file's suffix says (text, pdf, jsonl), or None for an unknown one."""
    suffix = path.suffix.lower()
    if suffix in (".pdf", ".jsonl"):
        return suffix[1:]
    return "text" if suffix in TEXT_SUFFIXES else None


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
    docs = []
    for n, doc in enumerate(_read_file(file)):
        if n >= len(ids) or doc.sha256 != ids[n][1]:
            raise JobSpecError(
                "the file changed since the run listed its documents, or differs on this machine",
                path=file.path,
                expected=f"{counted(len(ids), 'document')} with the listed sha256",
                got=f"document {n + 1} with sha256 {doc.sha256[:12] or 'none'}",
            )
        docs.append(replace(doc, doc_id=ids[n][0]))
    if len(docs) != len(ids):
        raise JobSpecError(
            "the file changed since the run listed its documents, or differs on this machine",
            path=file.path,
            expected=f"{counted(len(ids), 'document')} with the listed sha256",
            got=counted(len(docs), "document"),
        )
    return docs


def expand_sources(sources: Iterable[DocumentSource]) -> list[SourceFile]:
    """The files named by `sources`, in job order then sorted by relative path, each file once
    (the same file named twice, also through a link, is read at its first place). A file an
    entry names directly is read with that entry's settings (text_field, format, ...) even
    where an earlier folder or glob took it: naming it is how a job gives it its own."""
    files: list[SourceFile] = []
    at: dict[object, int] = {}
    for index, source in enumerate(sources):
        for file in _expand(source, f"documents[{index}]"):
            key = _file_key(file.path)
            if key not in at:
                at[key] = len(files)
                files.append(file)
            elif _named(file) and not _named(first := files[at[key]]):
                files[at[key]] = replace(first, source=file.source)
    return files


def _named(file: SourceFile) -> bool:
    """Whether `file` is its entry's path (not one a folder's walk or a glob found)."""
    return file.path == Path(os.path.expanduser(str(file.source.path)))


def _expand(source: DocumentSource, where: str) -> list[SourceFile]:
    raw = os.path.expanduser(str(source.path))
    path = Path(raw)
    try:
        mode: int | None = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as e:
        if not globlib.has_magic(raw):
            # There, or maybe there, but not to be looked at (a folder on the way without
            # permission, a link loop): named directly, it is an error document, never dropped.
            return [SourceFile(path, _sanitize(path.name), source, _stat_reason(e))]
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        root, pattern, globbed = path, source.glob or "**/*", source.glob is not None
    elif mode is not None:
        if source.glob:
            raise JobSpecError(
                "glob applies to a folder, not a file", path=raw, field=f"{where}.glob"
            )
        return [SourceFile(path, _sanitize(path.name), source)]
    elif globlib.has_magic(raw) and globlib.has_magic((split := _split_glob(path))[1]):
        if source.glob:
            raise JobSpecError("path is already a glob pattern", path=raw, field=f"{where}.glob")
        (root, pattern), globbed = split, True
    elif os.path.islink(path):
        target = os.readlink(path)
        message = f"document path is a broken symbolic link (to {target}, which does not exist)"
        raise JobSpecError(message, path=raw, field=f"{where}.path")
    else:
        raise JobSpecError("document path does not exist", path=raw, field=f"{where}.path")

    if _missing(root):  # a glob's fixed leading folders
        raise JobSpecError(f"no such folder: {root}", path=raw, field=f"{where}.path")
    skip = frozenset(_file_key(Path(p)) for p in source.skip)  # what is not there: no match
    matches, others, unreadable = walk(root, pattern, _wanted(source, globbed), skip)
    if not matches and not unreadable:
        kinds = "files of a known type" if globbed else f"{_DEFAULT_TEXT} files"
        hint = f" ({others} of another type: give the entry a format:)" if others else ""
        field = f"{where}.glob" if source.glob else f"{where}.path"  # the part that missed
        raise JobSpecError(f"no {kinds} match {pattern!r} in {root}{hint}", path=raw, field=field)
    files = [(rel, SourceFile(root / rel, _sanitize(rel), source)) for rel in matches]
    for rel, reason in unreadable:
        # `root` itself (rel ""): its name, as a file named directly gets
        name = _sanitize(rel) or _sanitize(os.path.basename(os.path.abspath(root))) or "."
        files.append((rel, SourceFile(root / rel, name, source, reason)))
    return [file for _, file in sorted(files, key=lambda item: item[0])]


def _wanted(source: DocumentSource, globbed: bool) -> Callable[[str], bool]:
    """Which files a walk of `source` takes: every one with a format; with a glob, those of a
    known type; else those with `DEFAULT_SUFFIXES`."""
    if source.format:
        return lambda rel: True
    if globbed:
        return lambda rel: format_of(Path(rel)) is not None
    return lambda rel: Path(rel).suffix.lower() in DEFAULT_SUFFIXES


def walk(
    root: Path,
    pattern: str,
    wanted: Callable[[str], bool],
    skip: frozenset[object] = frozenset(),
) -> tuple[list[str], int, list[tuple[str, str]]]:
    """(the regular files under `root` that the glob `pattern` matches and `wanted` keeps, as
    sorted relative paths with `/`; how many more it matches that `wanted` leaves out; what it
    would have taken but cannot look at, as (relative path, `""` for `root`, and the reason):
    folders it cannot list or search, links to nothing and link loops whose names it would
    take). Files and folders whose (st_dev, st_ino) is in `skip` are passed over.

    Glob syntax: `*`, `?`, `[...]` within a name, `**` for any number of folders, letters of
    either case (`*.pdf` takes `SCAN.PDF`, as the default walk does); a name starting with `.`
    only where the pattern spells the dot (as `glob.glob`). Links are followed, but a folder
    is walked once: a link back up (into a folder being walked, or to one above `root`, which
    would widen the walk to its parents' other files) or to one walked before is not
    entered."""
    parts = tuple(part for part in pattern.split("/") if part not in ("", "."))
    end = len(parts)
    found: list[str] = []
    left_out = 0
    unreadable: list[tuple[str, str]] = []
    walked: set[tuple[int, int]] = set()
    above = _folders_above(root)

    def closure(states: set[int]) -> frozenset[int]:
        # `**` may match no folder at all: before it is also after it.
        out, todo = set(states), list(states)
        while todo:
            i = todo.pop()
            if i < end and parts[i] == "**" and i + 1 not in out:
                out.add(i + 1)
                todo.append(i + 1)
        return frozenset(out)

    def step(states: frozenset[int], name: str) -> frozenset[int]:
        """Where in the pattern a path can be after one more name."""
        out = set()
        for i in states:
            if i < end and parts[i] == "**":
                if not name.startswith("."):
                    out.add(i)
            elif i < end and _name_matches(name, parts[i]):
                out.add(i + 1)
        return closure(out)

    def visit(folder: Path, rel: str, states: frozenset[int]) -> None:
        nonlocal left_out
        try:
            # `folder/.` is reached through the folder: this needs the search (x) permission
            # that reading any file in it needs, as listing needs the read (r) one.
            info = os.stat(os.path.join(folder, "."))
            names = set(os.listdir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return  # gone since its parent was listed (or a glob's root that is not there)
        except OSError as e:
            reason = f"cannot read folder: {e.strerror or one_line(e)}"
            unreadable.append(
                (rel.rstrip("/"), f"{reason}; the files in it are left out until it can be read")
            )
            return
        if (info.st_dev, info.st_ino) in walked:
            return
        walked.add((info.st_dev, info.st_ino))
        # names the pattern spells out: `..`, or another case on a case-insensitive disk
        spelled = {parts[i] for i in states if i < end and not globlib.has_magic(parts[i])}
        names |= {name for name in spelled if os.path.lexists(folder / name)}
        for name in sorted(names):
            after = step(states, name)
            if not after:
                continue
            path, child = folder / name, rel + name
            try:
                mode, key = _mode_and_key(path)
            except OSError as e:
                # A name the walk would take, but a link to nothing or a link loop: reported.
                if end in after and wanted(child) and os.path.islink(path):
                    unreadable.append((child, _stat_reason(e)))
                continue
            if key in skip or (key in above and os.path.islink(path)):
                continue
            if end in after and stat.S_ISREG(mode):
                if wanted(child):
                    found.append(child)
                else:
                    left_out += 1
            # A name in a folder without search permission is never reached: `visit` reported
            # that folder.
            if any(i < end for i in after) and stat.S_ISDIR(mode):
                visit(path, child + "/", after)

    visit(root, "", closure({0}))
    return sorted(found), left_out, sorted(unreadable)


def _folders_above(root: Path) -> frozenset[tuple[int, int]]:
    """The (st_dev, st_ino) of the folders above `root` (its real path's parents)."""
    keys = set()
    for folder in Path(os.path.realpath(root)).parents:
        try:
            keys.add(_mode_and_key(folder)[1])
        except OSError:
            continue
    return frozenset(keys)


def _name_matches(name: str, part: str) -> bool:
    if name.startswith(".") and not part.startswith("."):
        return False  # hidden names only where the pattern spells the dot
    return fnmatch.fnmatchcase(name.casefold(), part.casefold())


def _mode_and_key(path: Path) -> tuple[int, tuple[int, int]]:
    """The mode and (st_dev, st_ino) of what `path` names, links followed."""
    info = path.stat()
    return info.st_mode, (info.st_dev, info.st_ino)


def _missing(path: Path) -> bool:
    """True when nothing is at `path` (False when something is there but cannot be looked at:
    the walk reports that)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def _stat_reason(e: OSError) -> str:
    """Why a path that is there cannot be looked at."""
    if e.errno == errno.ELOOP:
        return "cannot read file: a symbolic link loop (the link leads back to itself)"
    if isinstance(e, FileNotFoundError):
        return "cannot read file: a symbolic link to nothing (its target does not exist)"
    return f"cannot read file: {e.strerror or one_line(e)}"


def _split_glob(pattern: Path) -> tuple[Path, str]:
    """`/data/docs/**/*.pdf` -> (`/data/docs`, `**/*.pdf`): fixed leading folders, then the
    rest. A leading name with glob characters that is a folder here is that folder (`Contracts
    [2023]/*.txt`, or a job file's folder so named), not a pattern; the last name is always
    the pattern's."""
    parts, fixed = pattern.parts, 0
    while fixed < len(parts) - 1 and (
        not globlib.has_magic(parts[fixed]) or os.path.isdir(Path(*parts[: fixed + 1]))
    ):
        fixed += 1
    return Path(*parts[:fixed]) if fixed else Path("."), "/".join(parts[fixed:])


def _file_key(path: Path) -> object:
    """Identity of a file: the same inode however it is named (links, case-insensitive disks)."""
    try:
        info = path.stat()
    except OSError:
        return os.path.realpath(path)
    return (info.st_dev, info.st_ino)


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
    fmt = file.format
    if file.unread is not None:  # also for every file without a format
        return [(file.rel_id, "")]
    try:
        with _RegularFile(file.path) as f:
            if fmt == "jsonl":
                lines = _Lines(f, _limit(file, fmt))
                records = [_parse_record(file, number, raw)[:2] for number, raw in lines]
                return records or [(file.rel_id, lines.sha256)]
            data = _read_whole(f, file, fmt)
    except _Unreadable:
        return [(file.rel_id, "")]
    return [(file.rel_id, hashlib.sha256(data).hexdigest())]


def _read_file(file: SourceFile) -> Iterator[Document]:
    """The document(s) of one file; every failure becomes an error Document."""
    fmt = file.format

    def failed(reason: str, sha256: str = "", **kw: Any) -> Document:
        return Document(
            file.rel_id, str(file.path), "", sha256, error=reason, read_as=file.read_as, **kw
        )

    if (reason := file.unread) is not None:  # also for every file without a format
        yield failed(reason)
        return
    try:
        with _RegularFile(file.path) as f:
            if fmt == "jsonl":  # a record at a time, the file open in between
                yield from _read_jsonl(file, _Lines(f, _limit(file, fmt)))
                return
            data = _read_whole(f, file, fmt)
    except _Unreadable as e:
        yield failed(str(e))
        return
    sha256 = hashlib.sha256(data).hexdigest()
    if not data:
        yield failed("empty file (0 bytes)", sha256)
        return
    if fmt == "pdf":
        text, n_pages, error, meta = read_pdf(data)
    else:
        (text, error, meta), n_pages = decode_text(data), None
    if error:
        yield failed(error, sha256, n_pages=n_pages, meta=meta)
    else:
        read_as = file.read_as
        yield Document(
            file.rel_id, str(file.path), text, sha256, n_pages, meta=meta, read_as=read_as
        )


def count_documents(file: SourceFile) -> int:
    """How many documents `iter_documents` gives for `file` (a progress bar's total): the lines
    of a jsonl file are counted; no other file is read."""
    if file.format != "jsonl" or file.unread is not None:
        return 1
    try:
        with _RegularFile(file.path) as f:
            return max(1, sum(1 for _ in _Lines(f, _limit(file, "jsonl"))))
    except _Unreadable:
        return 1


# ---- reading bytes with care --------------------------------------------------------------------


class _Unreadable(Exception):
    """A file whose bytes are not read: the reason its error document gives."""


class _RegularFile:
    """A file opened for reading, only when it is a regular file (links followed): a FIFO
    waits for a writer forever and a device has no end. It is opened without blocking and
    checked again once open, in case it was replaced in between. Raises _Unreadable, also
    for an OSError while it is read."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> BinaryIO:
        try:
            _check_regular(os.stat(self.path).st_mode)
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise _Unreadable(f"cannot read file: {e.strerror or one_line(e)}") from None
        self.f = os.fdopen(fd, "rb", buffering=_LINE_CHUNK)
        try:
            _check_regular(os.fstat(fd).st_mode)
        except BaseException:
            self.f.close()
            raise
        return self.f

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        self.f.close()
        if isinstance(error, OSError):
            raise _Unreadable(f"cannot read file: {error.strerror or one_line(error)}") from None


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "of an unknown kind")
        raise _Unreadable(f"not a regular file: {kind}")


def _limit(file: SourceFile, fmt: str) -> int | None:
    """The most bytes a document of `file` may have, from the job's max_context."""
    tokens = file.source.max_tokens
    limit = None if tokens is None else tokens * BYTES_PER_TOKEN[fmt]
    return None if limit is None or limit >= 1 << 62 else limit  # past any file: none


def _too_large(size: int, file: SourceFile, fmt: str, what: str = "file") -> str:
    return (
        f"too large: {size_text(size)}, over the {size_text(_limit(file, fmt) or 0)} that "
        f"engine.max_context {file.source.max_tokens} tokens allows ({BYTES_PER_TOKEN[fmt]} "
        f"bytes a token); raise max_context or split the {what}"
    )


def _read_whole(f: BinaryIO, file: SourceFile, fmt: str) -> bytes:
    """All of a text or PDF file, unless it is over its limit: its size is looked at first;
    of a text file whose first tokens only are wanted, as much as they can take."""
    if fmt == "text" and file.source.first_tokens is not None:
        most = file.source.first_tokens * BYTES_PER_TOKEN[fmt]
        data = _read_most(f, most + 1)
        return data if len(data) <= most else _whole_characters(data[:most])
    limit = _limit(file, fmt)
    if limit is None:
        return f.read()
    size = os.fstat(f.fileno()).st_size
    if size > limit:
        raise _Unreadable(_too_large(size, file, fmt))
    data = _read_most(f, limit + 1)  # a file that grew, or one whose size says 0 (/proc)
    if len(data) > limit:
        raise _Unreadable(_too_large(max(size, len(data)), file, fmt))
    return data


_READ_PIECE = 1 << 24  # bytes


def _read_most(f: BinaryIO, most: int) -> bytes:
    """Up to `most` bytes of `f`, read a piece at a time: `f.read(most)` sets aside `most`
    bytes first, whatever the file holds (a max_context of 10^10 tokens failed every file)."""
    pieces, got = [], 0
    while got < most:
        want = min(most - got, _READ_PIECE)
        pieces.append(piece := f.read(want))
        got += len(piece)
        if len(piece) < want:  # the end of the file (a buffered read gives all it asks else)
            break
    return b"".join(pieces)


def _whole_characters(data: bytes) -> bytes:
    """`data` cut at its end without the start of a character the cut split, in the encoding
    the text is read in (UTF-8, or UTF-16/32 after a BOM: half a surrogate pair, a unit's
    first bytes); what that encoding cannot read at all is left to the decoding."""
    bom, codec = bom_codec(data)
    decoder = codecs.getincrementaldecoder(codec)("strict")
    try:
        decoder.decode(data[len(bom) :], final=False)  # keeps back a split end
    except UnicodeDecodeError:
        return data
    return data[: len(data) - len(decoder.getstate()[0])]


# ---- jsonl --------------------------------------------------------------------------------------


def _read_jsonl(file: SourceFile, lines: _Lines) -> Iterator[Document]:
    """One document per non-empty line; a bad line is an error document, the others go on."""
    n_records = 0
    for number, raw in lines:
        n_records += 1
        yield _read_record(file, number, raw)
    if n_records == 0:
        reason = "empty file (0 bytes)" if lines.size == 0 else "no records: every line is blank"
        read_as = file.read_as
        yield Document(file.rel_id, str(file.path), "", lines.sha256, error=reason, read_as=read_as)


class _Lines:
    """The non-blank lines of an open jsonl file with their 1-based numbers: a line's bytes,
    or for a line over `limit` bytes its size (the line is not kept, so memory stays within the
    limit however long a line is). Once iterated: `size`, the bytes read, and `sha256`, the
    file's digest when every line was blank (the one document of a file without records)."""

    def __init__(self, f: BinaryIO, limit: int | None) -> None:
        self.f, self.limit = f, limit
        self.size, self.sha256 = 0, ""

    def __iter__(self) -> Iterator[tuple[int, bytes | int]]:
        blank, digest, number = True, hashlib.sha256(), 0
        # a line of `limit` bytes fits with its "\r\n"; one byte more and it is over
        while raw := self.f.readline(-1 if self.limit is None else self.limit + 2):
            number += 1
            if blank:
                digest.update(raw)
            if number == 1 and (codec := bom_codec(raw)[1]) != "utf-8":
                raise _Unreadable(
                    f"a jsonl file must be UTF-8 and this one is {codec}: convert it, e.g. "
                    f"iconv -f {codec} -t utf-8"
                )
            line = raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw
            content = line.removesuffix(b"\n")
            if self.limit is not None and len(content.removesuffix(b"\r")) > self.limit:
                blank = False
                yield number, len(content) if line.endswith(b"\n") else self._skip(line)
            elif content.strip():
                blank = False
                yield number, content
        self.size = self.f.tell()
        self.sha256 = digest.hexdigest() if blank else ""

    def _skip(self, start: bytes) -> int:
        """Moves past the rest of a line over the limit (`start`: its bytes read so far);
        returns its size, newline not counted. The holes of a sparse file hold zeros, never a
        newline: they are stepped over, not read."""
        f = self.f
        begin = f.tell() - len(start)
        while chunk := f.read(_LINE_CHUNK):
            at = chunk.find(b"\n")
            if at >= 0:
                f.seek(at + 1 - len(chunk), os.SEEK_CUR)
                return f.tell() - 1 - begin
            _past_hole(f)
        return f.tell() - begin


def _past_hole(f: BinaryIO) -> None:
    """Seeks to the next data of a sparse file when a hole starts where `f` stands. The file
    descriptor under `f`'s buffer is asked, then put back where the buffer left it: `f`
    itself only moves forward, and only past a hole."""
    if not hasattr(os, "SEEK_DATA"):
        return
    fd, here = f.fileno(), f.tell()
    raw = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        data = os.lseek(fd, here, os.SEEK_DATA)
    except OSError:  # no data after this: the rest is a hole
        data = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, raw, os.SEEK_SET)
    if data > here:
        f.seek(data)


def _parse_record(
    file: SourceFile, number: int, raw: bytes | int
) -> tuple[str, str, dict[str, Any] | None, str | None]:
    """(doc_id, sha256, record, problem) of line `number`: its id and hash as `Document` gives
    them, the JSON object (None when the line holds none), and why it is not a usable record.
    A line over the limit (`raw`: its size) is not hashed."""
    id_field = file.source.id_field
    doc_id = f"{file.rel_id}#L{number}"
    if isinstance(raw, int):
        return doc_id, "", None, _too_large(raw, file, "jsonl", "line")
    sha256 = hashlib.sha256(raw.strip()).hexdigest()
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return doc_id, sha256, None, decode_reason(e, "utf-8")
    except json.JSONDecodeError as e:
        return doc_id, sha256, None, f"invalid JSON: {e.msg} at column {e.colno}"
    except RecursionError:  # arrays nested past Python's stack
        return doc_id, sha256, None, "invalid JSON: nested too deeply"
    except ValueError:  # Python's limit on an integer's digits
        return doc_id, sha256, None, "invalid JSON: an integer of more than 4,300 digits"
    if not isinstance(record, dict):
        return doc_id, sha256, None, f"expected a JSON object, got {type(record).__name__}"

    canonical = _canonical(record)
    if canonical is not None:  # else the line's hash stands
        sha256 = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    raw_id, problem = record.get(id_field), None
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int, type(None))):
        problem = f"id field {id_field!r} must be a string or integer, got {type(raw_id).__name__}"
    elif raw_id is not None:
        doc_id = _sanitize(str(raw_id)) or doc_id
    if canonical is None:
        field = next(k for k, v in record.items() if _canonical({k: v}) is None)
        surrogate = (
            f"field {ascii(field)} holds a lone surrogate (a \\uD800-\\uDFFF escape without "
            "its pair), which is not text"
        )
        return doc_id, sha256, None, problem or surrogate
    return doc_id, sha256, record, problem


def _canonical(record: dict[str, Any]) -> str | None:
    """A record's canonical JSON (see `Document.sha256`), or None when UTF-8 cannot hold it."""
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return None if not_utf8(text, from_bytes=False) else text


def _read_record(file: SourceFile, number: int, raw: bytes | int) -> Document:
    """The document of line `number` (1-based) of a jsonl file (`raw`: its bytes, or its size
    when it is over the limit)."""
    text_field, id_field = file.source.text_field, file.source.id_field
    doc_id, sha256, record, problem = _parse_record(file, number, raw)
    meta: dict[str, Any] = {"line": number}

    def failed(reason: str) -> Document:
        error = f"line {number} of {file.rel_id}: {reason}"
        return Document(
            doc_id, str(file.path), "", sha256, error=error, meta=meta, read_as=file.read_as
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
    return Document(doc_id, str(file.path), text, sha256, meta=meta, read_as=file.read_as)
