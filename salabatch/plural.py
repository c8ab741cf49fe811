"""Counts in what salabatch prints: `counted(1, "row")` is "1 row", `counted(3, "row")` "3
rows". Every noun it counts takes an s, so there is no table of irregular plurals."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, with an s unless n is 1 (0 rows, 1 row, 2 rows)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
