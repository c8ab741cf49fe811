"""Counts as salabatch prints them."""

from salabatch.plural import counted


def test_one_is_singular_every_other_count_plural():
    assert [counted(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]
    assert counted(1, "more line") == "1 more line" and counted(3, "token") == "3 tokens"
    assert [counted(n, "entry", "entries") for n in (1, 5)] == ["1 entry", "5 entries"]
