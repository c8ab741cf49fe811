"""PDF text extraction with pypdf: pages joined by PAGE_BREAK, every failure a reason.

`read_pdf(data)` never raises: an encrypted, corrupt or scanned PDF gives an error reason, a page
that fails loses only itself, and pypdf's log warnings go to the document's meta, not stderr.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from salabatch.jobs.ingest.text import clean_text, one_line
from salabatch.plural import counted

# Pages of a PDF are joined with a form feed between blank lines. The form feed is the page break
# pdftotext writes too; byte-level tokenizers keep it (one byte token), and the blank lines around
# it keep the last paragraph of a page apart from the first of the next, for the model and for a
# person reading the text. Form feeds inside a page become newlines, so
# `doc.text.split(PAGE_BREAK)` gives back exactly `doc.n_pages` pages (empty ones included).
PAGE_BREAK = "\n\n\f\n\n"

# A PDF with fewer non-blank characters than this per page, on average, is treated as scanned
# images: image-only PDFs often carry a stray label or page number (imagemagick-images.pdf has
# "Background" on 4 of 6 pages, 6.7 characters a page), while one short real line has more.
MIN_CHARS_PER_PAGE = 10

_MAX_WARNINGS = 20

# Latin ligatures as pdfTeX fonts emit them ("ﬁlled"); spelled out they tokenize like the word.
_LIGATURES = str.maketrans(
    {
        "\ufb00": "ff",
        "\ufb01": "fi",
        "\ufb02": "fl",
        "\ufb03": "ffi",
        "\ufb04": "ffl",
        "\ufb05": "st",
        "\ufb06": "st",
    }
)


def read_pdf(data: bytes) -> tuple[str, int | None, str | None, dict[str, Any]]:
    """(text, n_pages, error, meta) of a PDF. Everything pypdf raises on a broken file is caught."""
    meta: dict[str, Any] = {}
    with _pypdf_warnings() as warnings:
        try:
            text, n_pages, error = _extract_pdf(data, meta)
        except Exception as e:  # a corrupt file can fail anywhere in pypdf; the job goes on
            # pypdf's first complaint ("EOF marker not found") often says more than the exception.
            hint = f" ({warnings[0]})" if warnings else ""
            text, n_pages, error = "", None, one_line(f"corrupt PDF: {one_line(e)}{hint}")
            if type(e).__name__ == "DependencyError":  # pypdf's: AES needs `cryptography`
                error = f"encrypted PDF: reading it needs a package not installed ({one_line(e)})"
    if warnings:
        meta["warnings"] = warnings
    return text, n_pages, error, meta


def _extract_pdf(data: bytes, meta: dict[str, Any]) -> tuple[str, int | None, str | None]:
    from pypdf import PdfReader  # only jobs with PDFs pay for the import

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted:
        # Many PDFs are encrypted only against editing, with an empty user password: they open.
        try:
            opened = reader.decrypt("")
        except Exception as e:
            return "", None, f"encrypted PDF (cannot decrypt: {one_line(e)})"
        if not opened:
            return "", None, "encrypted PDF (password required)"
        meta["encrypted"] = True
    with suppress(Exception):  # a broken info dictionary costs the title, not the document
        title = clean_text(reader.metadata.title or "").strip() if reader.metadata else ""
        if title:
            meta["title"] = title

    n_pages = len(reader.pages)
    if n_pages == 0:
        return "", 0, "PDF has no pages"
    pages: list[str] = []
    bad: dict[int, str] = {}
    for number in range(1, n_pages + 1):
        try:
            # "plain" mode follows the content stream: columns stay whole (multicolumn.pdf) and
            # right-to-left text keeps its logical order (habibi.pdf); "layout" would interleave.
            page_text = reader.pages[number - 1].extract_text(extraction_mode="plain")
        except Exception as e:  # one bad page must not lose the document
            bad[number] = one_line(e)
            page_text = ""
        pages.append(_clean_page(page_text))
    if bad:
        meta["bad_pages"] = sorted(bad)
        meta["page_errors"] = [f"page {n}: {reason}" for n, reason in sorted(bad.items())]

    n_chars = sum(not c.isspace() for page in pages for c in page)
    if len(bad) == n_pages:
        where = "its only page" if n_pages == 1 else f"all {n_pages} pages"
        return "", n_pages, f"corrupt PDF: text extraction failed on {where} ({bad[1]})"
    if n_chars < MIN_CHARS_PER_PAGE * n_pages:
        reason = f"no extractable text: {counted(n_pages, 'page')}, probably scanned images"
        return "", n_pages, f"{reason} ({n_chars} non-blank characters in all)"
    return PAGE_BREAK.join(pages), n_pages, None


def _clean_page(text: str) -> str:
    text = clean_text(text).replace("\f", "\n").translate(_LIGATURES)
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()


class _ListHandler(logging.Handler):
    """Keeps each distinct log message once, up to _MAX_WARNINGS, in a list."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        with suppress(Exception):
            message = one_line(record.getMessage())
            if message not in self.messages and len(self.messages) < _MAX_WARNINGS:
                self.messages.append(message)


@contextmanager
def _pypdf_warnings() -> Iterator[list[str]]:
    """Collect pypdf's log warnings for one document instead of printing them (restored after).

    pypdf logs a line for every font or xref table it repairs, often dozens per file; on stderr
    they drown a batch job's progress, but they belong to the document, so they go to its meta.
    The pypdf logger is process-wide: extract PDFs from one thread at a time.
    """
    logger = logging.getLogger("pypdf")
    messages: list[str] = []
    handler = _ListHandler(messages)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
