"""Bytes to text as a Document holds it, and failures as the one-line reasons it gives.

Text files are UTF-8 (with or without a BOM), or UTF-16/32 when a BOM says so; any newline
becomes `\\n` and NUL bytes go. Reasons are short, single-line and the same on every run.
"""

from __future__ import annotations

import codecs
import re
from typing import Any

from salabatch.errors import not_utf8

_MAX_REASON_CHARS = 200

# UTF-32 before UTF-16: the UTF-32-LE BOM starts with the UTF-16-LE one.
_BOMS = (
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_NOT_UTF8_HINT = (
    "text files are read as UTF-8, or UTF-16/32 with a BOM; convert this one, e.g. "
    "iconv -f cp1252 -t utf-8"
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _decodes(data: bytes, codec: str) -> bool:
    try:
        data.decode(codec)
    except UnicodeDecodeError:
        return False
    return True


def decode_text(data: bytes) -> tuple[str, str | None, dict[str, Any]]:
    """(text, error, meta) of a text file: UTF-8 (BOM or not), or UTF-16/32 when a BOM says so."""
    bom, codec = bom_codec(data)
    if codec == "utf-32-le" and not _decodes(data[len(bom) :], codec):
        # FF FE 00 00: also UTF-16-LE's BOM before a U+0000, which that reading then holds
        bom, codec = codecs.BOM_UTF16_LE, "utf-16-le"
    try:
        text = data[len(bom) :].decode(codec)
    except UnicodeDecodeError as e:
        reason = decode_reason(e, codec, offset=len(bom))
        if data.startswith(b"%PDF-"):
            return "", f"{reason}: it is a PDF; name it .pdf or give the entry format: pdf", {}
        if codec == "utf-8":
            reason += f" ({_NOT_UTF8_HINT})"
        return "", reason, {}
    meta = {} if codec == "utf-8" else {"encoding": codec}
    text = clean_text(text)
    if not text.strip():
        nul = " and NUL bytes" if b"\x00" in data else ""
        return "", f"empty document (only whitespace{nul})", meta
    return text, None, meta


def bom_codec(data: bytes) -> tuple[bytes, str]:
    """(the BOM `data` starts with, or b""; the codec it names, UTF-8 without one)."""
    return next(((b, c) for b, c in _BOMS if data.startswith(b)), (b"", "utf-8"))


def decode_reason(e: UnicodeDecodeError, codec: str, offset: int = 0) -> str:
    name = "UTF-8" if codec == "utf-8" else codec
    return f"not valid {name} text: byte 0x{e.object[e.start]:02x} at offset {e.start + offset}"


def clean_text(text: str) -> str:
    """Newlines as `\\n`, no NUL bytes (tokenizers and Parquet readers choke on them), a lone
    surrogate (a PDF font's broken ToUnicode entry can map a glyph to one) as U+FFFD: UTF-8
    cannot hold it."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    if not_utf8(text, from_bytes=False) is not None:
        text = _SURROGATE.sub("\ufffd", text)
    return text


def one_line(e: object) -> str:
    """A short, single-line, run-independent reason from an exception or a log message."""
    text = str(e) or type(e).__name__
    if isinstance(e, BaseException) and not type(e).__module__.startswith("pypdf"):
        text = f"{type(e).__name__}: {text}"  # KeyError('/Root') alone would read as "'/Root'"
    # pypdf prints objects with their id(), which changes every run: drop it.
    text = re.sub(r"IndirectObject\((\d+), (\d+), \d+\)", r"IndirectObject(\1, \2)", text)
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 1] + "…"


def size_text(n: int) -> str:
    """A byte count for a reason: `800 B`, `16.0 KB`, `3.0 GB`."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"
    return f"{n:.1f} GB"
