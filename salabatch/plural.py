"""Counts in what salabatch prints: `counted(1, "row")` is "1 row", `counted(3, "row")` "3
rows"; a noun whose plural is not noun + s names it (`counted(2, "entry", "entries")`)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, in the plural unless n is 1 (0 rows, 1 row, 2 rows)."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"
