"""Stage 1: files, folders, globs, text and jsonl in; Documents (text or a reason) out."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from salabatch.errors import JobSpecError
from salabatch.jobs.ingest.documents import (
    Document,
    DocumentSource,
    expand_sources,
    identify_documents,
    iter_documents,
)


def read(*sources: DocumentSource | Path | str) -> list[Document]:
    return list(
        iter_documents([s if isinstance(s, DocumentSource) else DocumentSource(s) for s in sources])
    )


def read_one(path: Path | str) -> Document:
    (doc,) = read(path)
    return doc


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF, one line of Helvetica text per page, xref offsets computed."""
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    kids = []
    for text in pages:
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        objects.append(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {len(objects)} 0 R >>"
        )
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(pages)} >>"
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += (
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return bytes(out)


TWO_PAGES = ["The first page says hello to the reader.", "The second page says goodbye again."]


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# ---- text files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "reason"),
    [
        ("empty.txt", b"", "empty file (0 bytes)"),
        ("blank.md", b"  \n\t\r\n  \n", "empty document (only whitespace)"),
        ("nuls.txt", b"\x00\x00\n", "empty document (only whitespace and NUL bytes)"),
        (
            "latin1.txt",
            "café au lait".encode("latin-1"),
            "not valid UTF-8 text: byte 0xe9 at offset 3 (text files are read as UTF-8, or "
            "UTF-16/32 with a BOM; convert this one, e.g. iconv -f cp1252 -t utf-8)",
        ),
        (
            "really-a-pdf.txt",
            b"%PDF-1.7\n\xe2\xe3\xcf\xd3\n",
            "not valid UTF-8 text: byte 0xe2 at offset 9: it is a PDF; name it .pdf or give "
            "the entry format: pdf",
        ),
        ("bad16.txt", b"\xff\xfe\x00\xd8", "not valid utf-16-le text: byte 0x00 at offset 2"),
    ],
)
def test_bad_text_files_are_error_documents(tmp_path, name, data, reason):
    doc = read_one(write(tmp_path / name, data))
    assert (doc.doc_id, doc.text, doc.error) == (name, "", reason)
    assert doc.sha256 == hashlib.sha256(data).hexdigest()


def test_text_is_normalized(tmp_path):
    doc = read_one(write(tmp_path / "a.md", b"\xef\xbb\xbf# Title\r\nline\x00 two\rthree\n"))
    assert doc.ok and doc.n_pages is None and doc.meta == {}
    assert doc.text == "# Title\nline two\nthree\n"


def test_utf16_with_bom_is_decoded(tmp_path):
    doc = read_one(write(tmp_path / "w.txt", "\ufeffNotes: Grüße\r\n".encode("utf-16-le")))
    assert doc.text == "Notes: Grüße\n"
    assert doc.meta == {"encoding": "utf-16-le"}
    # a U+0000 first: FF FE 00 00 is also UTF-32-LE's BOM, which the rest is not
    doc = read_one(write(tmp_path / "z.txt", "\ufeff\x00Notes\r\n".encode("utf-16-le")))
    assert (doc.text, doc.meta) == ("Notes\n", {"encoding": "utf-16-le"})
    doc = read_one(write(tmp_path / "u.txt", "\ufeffNotes\n".encode("utf-32-le")))
    assert (doc.text, doc.meta) == ("Notes\n", {"encoding": "utf-32-le"})


def test_unsupported_file_named_directly_is_an_error_document(tmp_path):
    doc = read_one(write(tmp_path / "memo.docx", b"PK\x03\x04"))
    assert doc.error.startswith("unsupported file type .docx; supported: .txt .md .pdf .jsonl")
    assert doc.error.endswith("or any file with the entry's format:")
    assert doc.doc_id == "memo.docx"


# ---- folders, globs, ids ------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "docs"
    write(root / "b.txt", "bee")
    write(root / "a.md", "# A")
    write(root / "sub" / "c.txt", "sea")
    write(root / "sub" / "deep" / "d.PDF", make_pdf(TWO_PAGES))
    write(root / "sub" / "e.jsonl", '{"id": "e1", "text": "first"}\n')
    write(root / "junk.docx", b"PK")  # unsupported: skipped in a walk
    write(root / "noext", "no extension")
    write(root / ".hidden" / "secret.txt", "hidden folder")
    write(root / "._a.md", b"\x00\x05\x16\x07")  # macOS AppleDouble junk
    (root / "empty-dir").mkdir()
    return root


def ids(docs: list[Document]) -> list[str]:
    return [doc.doc_id for doc in docs]


def test_folder_walks_supported_files_sorted_skipping_junk(tree):
    docs = read(tree)
    assert ids(docs) == ["a.md", "b.txt", "sub/c.txt", "sub/deep/d.PDF", "e1"]
    assert all(doc.ok for doc in docs)
    assert docs[2].path == str(tree / "sub" / "c.txt")


def test_folder_with_glob(tree):
    assert ids(read(DocumentSource(tree, glob="**/*.txt"))) == ["b.txt", "sub/c.txt"]
    assert ids(read(DocumentSource(tree, glob="*.txt"))) == ["b.txt"]


def test_glob_path_ids_are_relative_to_its_fixed_folders(tree):
    assert ids(read(tree / "sub" / "**" / "*.*")) == ["c.txt", "deep/d.PDF", "e1"]


def test_ids_and_sha256_are_stable_across_calls(tree):
    first, second = read(tree), read(tree)
    assert first == second
    assert first[1].sha256 == hashlib.sha256(b"bee").hexdigest()


def test_ids_are_sanitized_readable_and_nfc(tmp_path):
    write(tmp_path / "My Report (final).txt", "x")
    write(tmp_path / unicodedata.normalize("NFD", "Grüße.md"), "y")  # how macOS stores names
    assert ids(read(tmp_path)) == ["Grüße.md", "My_Report_final_.txt"]


def test_same_file_named_twice_is_read_once(tree):
    docs = read(tree / "b.txt", tree, DocumentSource(str(tree / "sub" / ".." / "b.txt")))
    assert ids(docs).count("b.txt") == 1
    assert len(docs) == 5


def test_clashing_ids_get_a_suffix(tmp_path):
    write(tmp_path / "x" / "a.txt", "one")
    write(tmp_path / "y" / "a.txt", "two")
    docs = read(tmp_path / "x", tmp_path / "y")
    assert ids(docs) == ["a.txt", "a.txt~2"]
    assert [doc.text for doc in docs] == ["one", "two"]


def test_missing_path_is_a_job_error_naming_it(tmp_path):
    write(tmp_path / "a.txt", "a")
    missing = tmp_path / "nope" / "contracts"
    with pytest.raises(JobSpecError) as info:
        iter_documents([DocumentSource(tmp_path / "a.txt"), DocumentSource(missing)])  # eager
    assert info.value.exit_code == 2
    assert info.value.path == str(missing)
    assert info.value.field == "documents[1].path"
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    "source",
    [
        lambda root: DocumentSource(root / "*.pdf"),
        lambda root: DocumentSource(root, glob="**/*.pdf"),
        lambda root: DocumentSource(root / "empty-dir"),
    ],
    ids=["glob-path", "folder-glob", "empty-folder"],
)
def test_source_matching_nothing_is_a_job_error(tree, source):
    (tree / "sub" / "deep" / "d.PDF").unlink()
    with pytest.raises(
        JobSpecError, match=r"no (files of a known type|\.txt \.md \.pdf \.jsonl files) match"
    ) as info:
        expand_sources([source(tree)])
    # the part of the entry that matched nothing: its glob, where it has one
    part = "glob" if source(tree).glob else "path"
    assert info.value.field == f"documents[0].{part}"


def test_glob_on_a_file_is_a_job_error(tree):
    with pytest.raises(JobSpecError) as info:
        expand_sources([DocumentSource(tree / "b.txt", glob="*.txt")])
    assert info.value.field == "documents[0].glob"


# ---- jsonl --------------------------------------------------------------------------------------


def test_jsonl_one_document_per_line_bad_lines_are_errors(tmp_path):
    lines = [
        json.dumps({"id": "doc-1", "text": "first text", "lang": "en"}),
        json.dumps({"text": "no id here"}),
        "",
        '{"id": "doc-3", "text": ',
        json.dumps({"id": "doc-4", "body": "wrong field"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"id": 7, "text": "integer id\r\nand CRLF"}),
        json.dumps({"id": {"nested": 1}, "text": "bad id"}),
    ]
    write(tmp_path / "batch.jsonl", "\n".join(lines) + "\n")
    docs = read(tmp_path / "batch.jsonl")
    got = [(doc.doc_id, doc.error) for doc in docs]
    assert got == [
        ("doc-1", None),
        ("batch.jsonl#L2", None),
        ("batch.jsonl#L4", "line 4 of batch.jsonl: invalid JSON: Expecting value at column 25"),
        ("doc-4", "line 5 of batch.jsonl: missing text field 'text' (fields: id, body)"),
        ("batch.jsonl#L6", "line 6 of batch.jsonl: expected a JSON object, got list"),
        ("7", None),
        (
            "batch.jsonl#L8",
            "line 8 of batch.jsonl: id field 'id' must be a string or integer, got dict",
        ),
    ]
    first = docs[0]
    assert first.text == "first text"
    assert first.meta == {"line": 1, "id": "doc-1", "fields": {"lang": "en"}}
    canonical = '{"id":"doc-1","lang":"en","text":"first text"}'
    assert first.sha256 == hashlib.sha256(canonical.encode()).hexdigest()
    assert docs[5].text == "integer id\nand CRLF"
    assert all(doc.path == str(tmp_path / "batch.jsonl") for doc in docs)


def test_jsonl_lines_python_cannot_hold_are_error_records_and_the_others_go_on(tmp_path):
    lines = ['{"id": "big", "n": 1' + "0" * 5000 + ', "text": "x"}', "[" * 100_000]
    lines.append(json.dumps({"id": "fine", "text": "read"}))
    write(tmp_path / "odd.jsonl", "\n".join(lines) + "\n")
    docs = read(tmp_path / "odd.jsonl")
    assert [(doc.doc_id, doc.error) for doc in docs] == [
        ("odd.jsonl#L1", "line 1 of odd.jsonl: invalid JSON: an integer of more than 4,300 digits"),
        ("odd.jsonl#L2", "line 2 of odd.jsonl: invalid JSON: nested too deeply"),
        ("fine", None),
    ]
    (found,) = identify_documents([DocumentSource(tmp_path / "odd.jsonl")])
    assert list(found.ids) == [(doc.doc_id, doc.sha256) for doc in docs]


def test_a_huge_max_context_or_first_tokens_reads_a_small_file(tmp_path):
    """The byte limit of a max_context of 10^18 tokens: the reader set aside that many bytes
    before reading a 50-byte file (MemoryError, or OverflowError, for every document)."""
    path = write(tmp_path / "a.txt", "The ferry leaves at 7:10.")
    for source in (
        DocumentSource(path, max_tokens=10**18),
        DocumentSource(path, first_tokens=10**18),
        DocumentSource(write(tmp_path / "r.jsonl", '{"text": "x"}\n'), max_tokens=10**18),
    ):
        (doc,) = read(source)
        assert doc.ok and doc.text in ("The ferry leaves at 7:10.", "x")


def test_a_file_named_after_a_folder_that_holds_it_is_read_with_its_own_settings(tmp_path):
    """`documents: [{path: docs}, {path: docs/records.jsonl, text_field: body}]`: the folder's
    walk took the file first, with its defaults, and every record was an error row."""
    write(tmp_path / "docs" / "a.txt", "A note.")
    write(tmp_path / "docs" / "records.jsonl", json.dumps({"ref": "r1", "body": "The body."}))
    named = DocumentSource(tmp_path / "docs" / "records.jsonl", text_field="body", id_field="ref")
    for sources in ([DocumentSource(tmp_path / "docs"), named], [named, DocumentSource(tmp_path)]):
        docs = list(iter_documents(sources))
        assert [(d.doc_id, d.text, d.error) for d in docs if d.path.endswith(".jsonl")] == [
            ("r1", "The body.", None)
        ]
        assert len(docs) == 2


def test_jsonl_custom_fields(tmp_path):
    write(tmp_path / "c.jsonl", json.dumps({"key": "k 1", "body": "hello"}) + "\n")
    (doc,) = read(DocumentSource(tmp_path / "c.jsonl", text_field="body", id_field="key"))
    assert (doc.doc_id, doc.text, doc.meta) == ("k_1", "hello", {"line": 1, "id": "k 1"})


def test_jsonl_with_only_blank_lines_is_an_error_document(tmp_path):
    (doc,) = read(write(tmp_path / "blank.jsonl", "\n  \n"))
    assert doc.error == "no records: every line is blank"


# ---- hostile files: links, pipes, devices, sizes -----------------------------------------------


def test_a_folder_walk_never_follows_a_link_back_into_a_walked_folder(tmp_path):
    # Defect 3: a recursive glob followed `up -> ..` round and round (ids a/up/a/up/.../ok.txt).
    root = tmp_path / "docs"
    write(root / "a" / "ok.txt", "fine")
    write(root / "b" / "also.md", "fine too")
    write(tmp_path / "outside" / "x.txt", "a folder linked from inside is walked once")
    (root / "a" / "up").symlink_to("..")
    (root / "a" / "out").symlink_to(tmp_path / "outside")
    (root / "b" / "loop").symlink_to(root / "b")
    assert ids(read(root)) == ["a/ok.txt", "a/out/x.txt", "b/also.md"]
    assert ids(read(DocumentSource(root, glob="**/*.txt"))) == ["a/ok.txt", "a/out/x.txt"]
    assert ids(read(root / "**" / "*.md")) == ["b/also.md"]
    # a link up out of the entry's folder is a link back up too: the walk took the files
    # beside its folder (`a/up/outside/x.txt`), every other job's results beside it
    assert ids(read(root / "a")) == ["ok.txt", "out/x.txt"]


def test_a_folder_with_two_upward_link_loops_lists_each_folder_once_a_way_in(tmp_path, monkeypatch):
    # Two loops made the walk exponential, with memory growing without bound: validate runs in
    # a child that is killed if it hangs, then the walk counts its listings.
    root = tmp_path / "docs"
    write(root / "a" / "ok.txt", "fine")
    (root / "a" / "up").symlink_to("..")
    (root / "a" / "top").symlink_to(root)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: loops\nmodel: builtin:random\ndocuments: [{path: docs}]\n"
        "questions: [{text: Summarize.}]\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "salabatch.cli", "validate", str(job), "--schema-only"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    listed = []
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: listed.append(path) or listdir(path))
    assert ids(read(root)) == ["a/ok.txt"]
    # docs and docs/a, then docs once more through each link back (seen, and not entered)
    assert len(listed) == 4


def test_a_fifo_or_a_device_named_as_a_document_is_an_error_document_not_a_hang(tmp_path):
    # Defect 4: reading a FIFO waited for a writer forever; /dev/zero never ends.
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "null.jsonl").symlink_to("/dev/null")
    sources = [DocumentSource(tmp_path / n) for n in ("pipe.txt", "zero.txt", "null.jsonl")]
    docs = list(iter_documents(sources))
    assert [(d.doc_id, d.error, d.sha256) for d in docs] == [
        ("pipe.txt", "not a regular file: a FIFO (named pipe)", ""),
        ("zero.txt", "not a regular file: a character device", ""),
        ("null.jsonl", "not a regular file: a character device", ""),
    ]
    identified = [f.ids for f in identify_documents(sources)]
    assert identified == [(("pipe.txt", ""),), (("zero.txt", ""),), (("null.jsonl", ""),)]
    write(tmp_path / "real.txt", "a walk reads regular files only, as before")
    assert ids(read(DocumentSource(tmp_path, glob="*.txt"))) == ["real.txt"]


def test_a_document_over_the_byte_limit_of_max_context_is_not_read(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(3 * 2**30)  # 3 GB, sparse: costs no disk
    small = write(tmp_path / "small.md", "x" * 1000)
    reads = []
    fdopen = os.fdopen

    def counted(fd, *args, **kw):
        f = fdopen(fd, *args, **kw)
        read = f.read
        f.read = lambda n=-1: reads.append((os.fstat(fd).st_size, n)) or read(n)
        return f

    monkeypatch.setattr(os, "fdopen", counted)
    docs = read(DocumentSource(big, max_tokens=1024), DocumentSource(small, max_tokens=1024))
    assert reads == [(1000, 16 * 1024 + 1)]  # the small one only, the big one never read
    assert docs[0].error == (
        "too large: 3.0 GB, over the 16.0 KB that engine.max_context 1024 tokens allows "
        "(16 bytes a token); raise max_context or split the file"
    )
    assert docs[0].sha256 == "" and docs[1].ok
    limited = read(DocumentSource(small, max_tokens=50))
    assert limited[0].error.startswith("too large: 1000 B, over the 800 B")
    pdf = write(tmp_path / "a.pdf", make_pdf(TWO_PAGES))
    assert read(DocumentSource(pdf, max_tokens=10))[0].ok  # a PDF holds more than its text


def test_a_jsonl_line_over_the_byte_limit_is_an_error_record_and_the_others_go_on(tmp_path):
    lines = [json.dumps({"id": "a", "text": "short"}), json.dumps({"id": "b", "text": "y" * 900})]
    path = write(tmp_path / "r.jsonl", "\n".join([*lines, lines[0].replace('"a"', '"c"')]) + "\n")
    source = DocumentSource(path, max_tokens=50)  # 800 bytes a line
    docs = read(source)
    assert [(d.doc_id, d.error) for d in docs] == [
        ("a", None),
        (
            "r.jsonl#L2",
            "line 2 of r.jsonl: too large: 923 B, over the 800 B that engine.max_context 50 "
            "tokens allows (16 bytes a token); raise max_context or split the line",
        ),
        ("c", None),
    ]
    (found,) = identify_documents([source])
    assert found.ids == tuple((d.doc_id, d.sha256) for d in docs)


# ---- folders that cannot be read ---------------------------------------------------------------


@pytest.fixture
def lock(monkeypatch):
    """`lock(folder)` makes a folder unreadable as mode 000 makes it for a user other than root
    (the tests run as root, whom permissions do not stop): the folder itself can be looked at,
    nothing in it, and it cannot be listed; `listable=True`: mode 444, listed but nothing in it
    reached."""
    locked: dict[str, bool] = {}  # folder -> listable
    real_stat, real_lstat, real_listdir = os.stat, os.lstat, os.listdir

    def inside(path) -> bool:
        # `folder/.` is inside the folder: reaching it needs the folder's search permission
        raw = os.fsdecode(path)
        full = os.path.join(os.path.abspath(os.path.dirname(raw)), os.path.basename(raw))
        return any(full.startswith(folder + os.sep) for folder in locked)

    def denied(path):
        return PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))

    def stat(path, *args, **kwargs):
        if not isinstance(path, int) and inside(path):
            raise denied(path)
        return real_stat(path, *args, **kwargs)

    def lstat(path, *args, **kwargs):
        if inside(path):
            raise denied(path)
        return real_lstat(path, *args, **kwargs)

    def listdir(path="."):
        if inside(path) or locked.get(os.path.abspath(path)) is False:
            raise denied(path)
        return real_listdir(path)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "listdir", listdir)
    return lambda folder, listable=False: locked.__setitem__(str(folder), listable)


def test_a_file_named_directly_in_an_unreadable_folder_is_an_error_document(tmp_path, lock):
    path = write(tmp_path / "locked" / "a.txt", "out of reach")
    lock(tmp_path / "locked")
    (doc,) = read(path)
    assert (doc.doc_id, doc.error) == ("a.txt", "cannot read file: Permission denied")
    assert expand_sources([DocumentSource(path)])[0].unread == doc.error
    (found,) = identify_documents([DocumentSource(path)])
    assert found.ids == (("a.txt", ""),)


@pytest.mark.parametrize("listable", [False, True])
def test_an_unreadable_folder_in_a_walk_is_an_error_document_in_place_of_its_files(
    tree, lock, listable
):
    lock(tree / "sub", listable)
    docs = read(tree)
    assert ids(docs) == ["a.md", "b.txt", "sub"]
    assert docs[2].error == (
        "cannot read folder: Permission denied; the files in it are left out until it can be read"
    )
    assert [i for f in identify_documents([DocumentSource(tree)]) for i, _ in f.ids] == ids(docs)
    # a walk that would not look in it says nothing of it
    assert ids(read(DocumentSource(tree, glob="*.txt"))) == ["b.txt"]


def test_an_unreadable_folder_named_or_globbed_is_one_error_document(tmp_path, lock):
    write(tmp_path / "locked" / "a.txt", "out of reach")
    lock(tmp_path / "locked")
    for source in (tmp_path / "locked", DocumentSource(tmp_path / "locked", glob="*.txt")):
        (doc,) = read(source)
        assert doc.doc_id == "locked" and doc.error.startswith("cannot read folder: Permission")
    (doc,) = read(tmp_path / "locked" / "*.txt")  # a glob's fixed folder
    assert doc.doc_id == "locked" and doc.error.startswith("cannot read folder: Permission")


# ---- what a file is: format and suffixes -------------------------------------------------------


def test_rst_html_and_code_are_read_as_text_when_named_or_globbed(tmp_path):
    write(tmp_path / "guide.rst", "Guide\n=====\n")
    write(tmp_path / "page.html", "<p>Hello</p>")
    write(tmp_path / "tool.py", "print('hi')\n")
    write(tmp_path / "notes.txt", "notes")
    docs = read(tmp_path / "guide.rst", tmp_path / "page.html")
    assert [(d.doc_id, d.text) for d in docs] == [
        ("guide.rst", "Guide\n=====\n"),
        ("page.html", "<p>Hello</p>"),  # as it is: markup and all
    ]
    assert ids(read(tmp_path)) == ["notes.txt"]  # a walk without a glob: .txt .md .pdf .jsonl
    assert ids(read(DocumentSource(tmp_path, glob="*"))) == [
        "guide.rst",
        "notes.txt",
        "page.html",
        "tool.py",
    ]


def test_files_without_a_suffix_are_read_with_the_entry_format(tmp_path):
    write(tmp_path / "LICENSE", "Permission is hereby granted")
    write(tmp_path / "records", json.dumps({"id": "r1", "text": "a record"}) + "\n")
    with pytest.raises(JobSpecError, match=r"\(2 of another type: give the entry a format:\)"):
        expand_sources([DocumentSource(tmp_path, glob="*")])
    docs = read(DocumentSource(tmp_path / "LICENSE", format="text"))
    assert [(d.doc_id, d.text) for d in docs] == [("LICENSE", "Permission is hereby granted")]
    assert read_one(tmp_path / "LICENSE").error.startswith("unsupported file type (none)")
    (record,) = read(DocumentSource(tmp_path / "records", format="jsonl"))
    assert (record.doc_id, record.text) == ("r1", "a record")
    assert ids(read(DocumentSource(tmp_path, glob="*", format="text"))) == ["LICENSE", "records"]


def test_a_sparse_jsonl_line_is_stepped_over_and_the_next_record_read(tmp_path):
    path = tmp_path / "holes.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"id": "a", "text": "first"}\n')
        f.truncate(64 * 2**20)  # a line of 64 MB of zeros: a hole, never read
        f.seek(0, os.SEEK_END)
        f.write(b'\n{"id": "b", "text": "after the hole"}\n')
    source = DocumentSource(path, max_tokens=1024)
    docs = read(source)
    assert [(d.doc_id, d.ok) for d in docs] == [("a", True), ("holes.jsonl#L2", False), ("b", True)]
    assert docs[1].error.startswith("line 2 of holes.jsonl: too large: 64.0 MB, over the 16.0 KB")
    assert docs[2].text == "after the hole"


def test_a_dense_jsonl_line_over_a_megabyte_and_the_limit_keeps_the_later_lines_right(tmp_path):
    # The 1 MB reads past an over-long line must not lose their place (no hole to step over).
    path = tmp_path / "long.jsonl"
    long = json.dumps({"id": "h", "text": "x" * (3 * 2**20)}).encode()
    path.write_bytes(b'{"id": "a", "text": "first"}\n' + long + b'\n{"text": "third"}\n')
    docs = read(DocumentSource(path, max_tokens=64))
    assert [(d.doc_id, d.ok) for d in docs] == [("a", True), ("long.jsonl#L2", False),
                                                ("long.jsonl#L3", True)]  # fmt: skip
    assert docs[1].error.startswith("line 2 of long.jsonl: too large: 3.0 MB, over the 1.0 KB")
    assert docs[2].text == "third"


def test_a_jsonl_record_with_a_lone_surrogate_is_an_error_naming_its_field(tmp_path):
    path = write(
        tmp_path / "s.jsonl",
        '{"id": "a", "text": "fine"}\n'
        '{"id": "b", "text": "lone \\ud800 here"}\n'
        '{"id": "c", "text": "fine", "note": "bad \\udc80"}\n'
        '{"id": "d", "text": "after"}\n',
    )
    docs = read(path)
    assert [(d.doc_id, d.error) for d in docs] == [
        ("a", None),
        ("b", "line 2 of s.jsonl: field 'text' holds a lone surrogate (a \\uD800-\\uDFFF "
              "escape without its pair), which is not text"),
        ("c", "line 3 of s.jsonl: field 'note' holds a lone surrogate (a \\uD800-\\uDFFF "
              "escape without its pair), which is not text"),
        ("d", None),
    ]  # fmt: skip
    lines = path.read_bytes().splitlines()
    assert docs[1].sha256 == hashlib.sha256(lines[1]).hexdigest()  # the line's bytes
    assert docs[2].meta == {"line": 3}  # nothing UTF-8 cannot hold reaches the results
    assert [f.ids for f in identify_documents([DocumentSource(path)])] == [
        tuple((d.doc_id, d.sha256) for d in docs)
    ]


def test_a_utf16_jsonl_file_is_one_error_saying_to_convert_it(tmp_path):
    data = '{"id": "a", "text": "hi"}\n'.encode("utf-16")
    doc = read_one(write(tmp_path / "u16.jsonl", data))
    assert doc.error == (
        "a jsonl file must be UTF-8 and this one is utf-16-le: convert it, e.g. "
        "iconv -f utf-16-le -t utf-8"
    )


def test_a_jsonl_line_of_exactly_the_limit_with_crlf_is_read(tmp_path):
    record = json.dumps({"id": "a", "text": "y" * 100}).encode()
    record += b" " * (-len(record) % 16)  # exactly max_tokens · 16 bytes, the limit
    path = write(tmp_path / "crlf.jsonl", record + b"\r\n" + record + b" \r\n")
    docs = read(DocumentSource(path, max_tokens=len(record) // 16))
    assert [(d.doc_id, d.ok) for d in docs] == [("a", True), ("crlf.jsonl#L2", False)]


def test_jsonl_records_are_read_one_at_a_time(tmp_path, monkeypatch):
    from salabatch.jobs.ingest import documents

    path = write(
        tmp_path / "r.jsonl", "".join(f'{{"id": "{i}", "text": "t{i}"}}\n' for i in range(5))
    )
    parsed = []
    parse = documents._parse_record
    monkeypatch.setattr(documents, "_parse_record", lambda *a: parsed.append(a[1]) or parse(*a))
    docs = iter_documents([DocumentSource(path)])
    assert next(docs).doc_id == "0" and parsed == [1]  # the later lines not parsed yet
    assert [d.doc_id for d in docs] == ["1", "2", "3", "4"]


def test_a_glob_matches_names_in_either_case(tmp_path):
    write(tmp_path / "docs" / "lower.pdf", make_pdf(["a lower case name here"]))
    write(tmp_path / "docs" / "SCAN.PDF", make_pdf(["an upper case name here"]))
    source = DocumentSource(tmp_path / "docs", glob="**/*.pdf")
    assert [f.rel_id for f in expand_sources([source])] == ["SCAN.PDF", "lower.pdf"]


def test_broken_links_and_link_loops_in_a_walk_are_error_documents(tmp_path):
    docs = tmp_path / "docs"
    write(docs / "a.txt", "a real document")
    os.symlink("nowhere.txt", docs / "dangling.txt")
    os.symlink("loopb.txt", docs / "loopa.txt")
    os.symlink("loopa.txt", docs / "loopb.txt")
    os.symlink("nowhere.bin", docs / "other.bin")  # a name the walk would not take anyway
    got = [(d.doc_id, d.error) for d in read(docs)]
    loop = "cannot read file: a symbolic link loop (the link leads back to itself)"
    assert got == [
        ("a.txt", None),
        ("dangling.txt", "cannot read file: a symbolic link to nothing (its target does not "
                         "exist)"),
        ("loopa.txt", loop),
        ("loopb.txt", loop),
    ]  # fmt: skip
    # named directly: a loop is an error document, a link to nothing a mistake in the job
    assert read_one(docs / "loopa.txt").error == loop
    with pytest.raises(JobSpecError, match=r"broken symbolic link \(to nowhere.txt"):
        read(docs / "dangling.txt")


def test_folders_named_with_glob_characters_are_folders(tmp_path):
    """`Contracts [2023]`: with a glob, under a pattern, and as the folder of the job file a
    relative pattern is resolved against: `[2023]` was read as a character class (no file
    matched), and a folder so named could not take a glob."""
    from salabatch.jobs.spec.load import load_job

    base = tmp_path / "jobs [old]"
    write(base / "Contracts [2023]" / "a.txt", "The provider is Acme.")
    write(base / "Contracts [2023]" / "sub" / "b.txt", "The term is two years.")
    write(base / "Contracts [2023]" / "c.md", "Not a txt.")
    job = base / "job.yaml"
    for entry, expected in [
        ({"path": "./Contracts [2023]", "glob": "**/*.txt"}, ["a.txt", "sub/b.txt"]),
        ({"path": "./Contracts [2023]/*.md"}, ["c.md"]),
        ({"path": "./Contracts [2023]/sub/*.txt"}, ["b.txt"]),
    ]:
        body = {"name": "j", "model": "builtin:tiny", "documents": [entry], "questions": ["Who?"]}
        job.write_text(json.dumps(body))
        assert ids(iter_documents(load_job(job, check_files=True).sources())) == expected
    with pytest.raises(JobSpecError, match="document path does not exist"):
        expand_sources([DocumentSource(base / "Contracts [2023]" / "nothere.txt")])


def test_a_glob_under_a_missing_folder_says_the_folder_is_missing(tmp_path):
    with pytest.raises(JobSpecError, match="no such folder: .*nothere"):
        expand_sources([DocumentSource(tmp_path / "nothere" / "*.txt")])


def test_the_jobs_own_files_in_a_documents_folder_are_never_documents(tmp_path):
    from salabatch.jobs.spec.load import load_job

    docs = tmp_path / "w"
    write(docs / "a.txt", "The provider is Acme.")
    for name in ("answers.jsonl", "answers.parquet", "answers.parquet.parts/0001.jsonl",
                 "requests.jsonl"):  # fmt: skip
        write(docs / name, '{"id": "x", "text": "not a document"}\n')
    job = write(
        tmp_path / "job.yaml",
        "name: w\nmodel: builtin:tiny\ndocuments: [{path: ./w}]\nquestions: [q]\n"
        "requests: ./w/requests.jsonl\noutput: {path: ./w/answers.jsonl}\n",
    )
    spec = load_job(job)
    assert [f.rel_id for f in expand_sources(spec.sources())] == ["a.txt"]
    # the same folder for another job: they are documents (.parquet is not a document type)
    assert len(expand_sources([DocumentSource(docs)])) == 4
    # a job without Batch output: a .jsonl named as its results is a user's file, unless it
    # holds Batch output lines (an earlier run's with requests)
    job.write_text(
        "name: w\nmodel: builtin:tiny\ndocuments: [{path: ./w}]\nquestions: [q]\n"
        "output: {path: ./w/answers.parquet}\n"
    )
    read_files = ["a.txt", "answers.jsonl", "requests.jsonl"]
    assert [f.rel_id for f in expand_sources(load_job(job).sources())] == read_files
    batch_line = {"id": "batch_req_" + "0" * 32, "custom_id": "a", "response": {}, "error": None}
    write(docs / "answers.jsonl", json.dumps(batch_line) + "\n")
    assert [f.rel_id for f in expand_sources(load_job(job).sources())] == [
        "a.txt",
        "requests.jsonl",
    ]


def test_a_text_whose_first_tokens_only_are_wanted_is_cut_at_a_characters_end(tmp_path):
    """`first_tokens` (perplexity --max-tokens): a text file is read as far as 16 bytes a token
    reach, cut where a character ends (a cut inside "é" is no decoding error), never refused
    for its size however small max_tokens is."""
    path = tmp_path / "accents.txt"
    path.write_text("é" * 1000)  # 2,000 bytes: 3 tokens' 48 bytes end inside no character
    for first, chars in ((3, 24), (1, 8)):
        source = DocumentSource(path, max_tokens=2, first_tokens=first)
        (doc,) = iter_documents([source])
        assert doc.ok and doc.text == "é" * chars, doc.error
    odd = tmp_path / "odd.txt"
    odd.write_text("a" + "é" * 1000)  # 16 bytes end inside the eighth "é": it goes
    (doc,) = iter_documents([DocumentSource(odd, first_tokens=1)])
    assert doc.ok and doc.text == "a" + "é" * 7
    # UTF-16 after its BOM: 16 bytes end inside the emoji's surrogate pair (the text was "not
    # valid utf-16-le"): the pair goes
    wide = tmp_path / "wide.txt"
    wide.write_bytes(("\ufeffabcdef😀" * 20).encode("utf-16-le"))
    (doc,) = iter_documents([DocumentSource(wide, first_tokens=1)])
    assert doc.ok and doc.text == "abcdef", doc.error
