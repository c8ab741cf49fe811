"""PDFs in: the shared real-world samples and small ones made here; text or a reason out."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from salabatch.jobs.ingest.documents import Document
from salabatch.jobs.ingest.pdf import PAGE_BREAK
from tests import SHARED
from tests.jobs.ingest.test_documents import TWO_PAGES, make_pdf, read, read_one, write

# The shared sample PDFs (CC-BY-SA) live beside the repo, never in it.
SHARED_PDFS = SHARED / "pdfs"
NO_SHARED = f"shared sample PDFs not found at {SHARED_PDFS}"
SHARED_NAMES = sorted(p.name for p in SHARED_PDFS.glob("*.pdf")) if SHARED_PDFS.is_dir() else []
EXPECTED_ERRORS = {
    "libreoffice-writer-password.pdf": "encrypted PDF (password required)",
    "imagemagick-images.pdf": "no extractable text: 6 pages",
}


# ---- the shared real-world PDFs -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name", SHARED_NAMES or [pytest.param("", marks=pytest.mark.skip(reason=NO_SHARED))]
)
def test_shared_pdf_gives_text_or_error_never_raises(name):
    doc = read_one(SHARED_PDFS / name)
    assert doc.doc_id == name
    assert doc.sha256 == hashlib.sha256((SHARED_PDFS / name).read_bytes()).hexdigest()
    if name in EXPECTED_ERRORS:
        assert not doc.ok and doc.text == ""
        assert doc.error.startswith(EXPECTED_ERRORS[name])
        return
    assert doc.ok, doc.error
    expected_pages = {
        Path(f["path"]).name: f["pages"]
        for f in json.loads((SHARED_PDFS / "files.json").read_text())
    }
    assert doc.n_pages == expected_pages[name]
    assert len(doc.text.split(PAGE_BREAK)) == doc.n_pages
    assert len(doc.text.strip()) > 15
    assert "\x00" not in doc.text and "\r" not in doc.text


def shared(name: str) -> Document:
    if name not in SHARED_NAMES:
        pytest.skip(NO_SHARED)
    return read_one(SHARED_PDFS / name)


def test_shared_pdflatex_four_pages_are_separated_by_page_break():
    doc = shared("pdflatex-4-pages.pdf")
    pages = doc.text.split(PAGE_BREAK)
    assert doc.n_pages == 4 and len(pages) == 4
    assert all(len(page) > 1000 for page in pages)


def test_shared_arabic_pdf_gives_arabic_letters():
    doc = shared("habibi.pdf")
    assert doc.ok
    assert sum("\u0600" <= c <= "\u06ff" for c in doc.text) >= 10
    assert "habibi" in doc.text


def test_shared_two_column_pdf_reads_column_by_column():
    doc = shared("multicolumn.pdf")
    # The first column's sentence runs on unbroken: columns are not interleaved line by line.
    assert "Lorem ipsum dolor sit amet, consectetuer adip-\niscing elit. Ut purus elit" in doc.text
    assert "two columns filled" in doc.text  # the "ﬁ" ligature is spelled out


def test_shared_image_only_pdf_reports_page_count():
    doc = shared("imagemagick-images.pdf")
    assert doc.n_pages == 6
    assert "probably scanned images" in doc.error
    assert doc.meta["title"] == "imagemagick-images"  # the NUL in the info dict is gone


def test_shared_pdfs_print_nothing_and_restore_pypdf_logger(capsys):
    if not SHARED_NAMES:
        pytest.skip(NO_SHARED)
    logger = logging.getLogger("pypdf")
    before = (logger.level, logger.propagate, list(logger.handlers))
    docs = read(SHARED_PDFS)
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
    assert capsys.readouterr().err == ""
    assert len(docs) == len(SHARED_NAMES) + 1  # + README.md


# ---- PDFs made here -----------------------------------------------------------------------------


def test_small_pdf_pages_joined_by_page_break(tmp_path):
    doc = read_one(write(tmp_path / "two.pdf", make_pdf(TWO_PAGES)))
    assert doc.ok and doc.n_pages == 2
    assert doc.text.split(PAGE_BREAK) == TWO_PAGES


@pytest.mark.parametrize(
    "data",
    [b"this is not a pdf at all", b"%PDF-1.4\n1 0 obj\n<<", make_pdf(TWO_PAGES)[:150]],
    ids=["garbage", "header-only", "truncated"],
)
def test_corrupt_pdf_is_an_error_document(tmp_path, data):
    doc = read_one(write(tmp_path / "broken.pdf", data))
    assert not doc.ok and doc.text == ""
    assert doc.error.startswith(("corrupt PDF: ", "no extractable text"))
    assert "\n" not in doc.error and len(doc.error) <= 200
    assert doc.sha256 == hashlib.sha256(data).hexdigest()


def test_encrypted_pdf_with_empty_user_password_opens(tmp_path):
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(write(tmp_path / "plain.pdf", make_pdf(TWO_PAGES))))
    writer.encrypt(user_password="", owner_password="owner", algorithm="RC4-128")
    writer.write(tmp_path / "open.pdf")
    doc = read_one(tmp_path / "open.pdf")
    assert doc.ok and doc.meta["encrypted"] is True
    assert doc.text.split(PAGE_BREAK) == TWO_PAGES


@pytest.mark.parametrize("algorithm", ["RC4-128", "AES-128", "AES-256"])
def test_encrypted_pdf_with_password_is_an_error_document(tmp_path, algorithm):
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(write(tmp_path / "plain.pdf", make_pdf(TWO_PAGES))))
    writer.encrypt(user_password="secret", algorithm=algorithm)
    writer.write(tmp_path / "locked.pdf")
    doc = read_one(tmp_path / "locked.pdf")
    assert doc.error == "encrypted PDF (password required)"


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256"])
def test_an_aes_encrypted_pdf_with_an_empty_password_opens(tmp_path, algorithm):
    # What current editors write for a "protected" PDF; pypdf needs `cryptography` for it.
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(write(tmp_path / "plain.pdf", make_pdf(TWO_PAGES))))
    writer.encrypt(user_password="", owner_password="owner", algorithm=algorithm)
    writer.write(tmp_path / "aes.pdf")
    doc = read_one(tmp_path / "aes.pdf")
    assert doc.ok and doc.meta["encrypted"] is True
    assert doc.text.split(PAGE_BREAK) == TWO_PAGES


def test_a_pdf_that_needs_a_missing_package_says_so_not_corrupt(tmp_path, monkeypatch):
    from pypdf.errors import DependencyError

    from salabatch.jobs.ingest import pdf

    def missing(data, meta):
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pdf, "_extract_pdf", missing)
    doc = read_one(write(tmp_path / "aes.pdf", make_pdf(TWO_PAGES)))
    assert doc.error == (
        "encrypted PDF: reading it needs a package not installed (cryptography>=3.1 is "
        "required for AES algorithm)"
    )


def test_a_lone_surrogate_in_a_pdf_text_becomes_a_replacement_character(tmp_path, monkeypatch):
    # A font whose ToUnicode map gives U+D800 for a glyph: the rest of the text stands.
    from salabatch.jobs.ingest import pdf

    page = pdf._clean_page
    monkeypatch.setattr(pdf, "_clean_page", lambda text: page(text.replace("hello", "h\ud800llo")))
    doc = read_one(write(tmp_path / "sur.pdf", make_pdf(TWO_PAGES)))
    assert doc.ok and doc.text.split(PAGE_BREAK)[0] == TWO_PAGES[0].replace("hello", "h\ufffdllo")
    doc.text.encode("utf-8")


def test_blank_pdf_is_no_extractable_text(tmp_path):
    from pypdf import PdfWriter

    writer = PdfWriter()
    for _ in range(3):
        writer.add_blank_page(612, 792)
    writer.write(tmp_path / "blank.pdf")
    doc = read_one(tmp_path / "blank.pdf")
    assert doc.n_pages == 3
    assert doc.error.startswith("no extractable text: 3 pages, probably scanned images")


def test_one_bad_page_keeps_the_others(tmp_path, monkeypatch):
    from pypdf import PageObject

    original = PageObject.extract_text

    def flaky(page, *args, **kwargs):
        text = original(page, *args, **kwargs)
        if "second" in text:
            raise ValueError("broken content stream")
        return text

    monkeypatch.setattr(PageObject, "extract_text", flaky)
    doc = read_one(write(tmp_path / "two.pdf", make_pdf(TWO_PAGES)))
    assert doc.ok
    assert doc.text.split(PAGE_BREAK) == [TWO_PAGES[0], ""]
    assert doc.meta["bad_pages"] == [2]
    assert doc.meta["page_errors"] == ["page 2: ValueError: broken content stream"]


def test_pdf_extraction_failing_on_every_page_is_corrupt(tmp_path, monkeypatch):
    from pypdf import PageObject

    def broken(page, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(PageObject, "extract_text", broken)
    doc = read_one(write(tmp_path / "two.pdf", make_pdf(TWO_PAGES)))
    assert doc.error == "corrupt PDF: text extraction failed on all 2 pages (RuntimeError: boom)"
    doc = read_one(write(tmp_path / "one.pdf", make_pdf(TWO_PAGES[:1])))
    assert doc.error == "corrupt PDF: text extraction failed on its only page (RuntimeError: boom)"


def test_pypdf_warnings_go_to_meta_not_stderr(tmp_path, monkeypatch, capsys):
    from pypdf import PageObject

    original = PageObject.extract_text

    def noisy(page, *args, **kwargs):
        for _ in range(3):  # repeated warnings are kept once
            logging.getLogger("pypdf._page").warning("odd font IndirectObject(7, 0, 140234567890)")
        return original(page, *args, **kwargs)

    monkeypatch.setattr(PageObject, "extract_text", noisy)
    logger = logging.getLogger("pypdf")
    before = (logger.level, logger.propagate, list(logger.handlers))
    doc = read_one(write(tmp_path / "two.pdf", make_pdf(TWO_PAGES)))
    assert doc.ok
    assert doc.meta["warnings"] == ["odd font IndirectObject(7, 0)"]  # no run-dependent id()
    assert capsys.readouterr().err == ""
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
