"""How a salabatch error reads: where, what, and what it expected and got."""

from __future__ import annotations


def test_an_error_shows_what_it_got_without_an_expectation_it_does_not_have():
    """`got` alone: "(got X)", not "(expected None, got X)"; both: both."""
    from salabatch.errors import SalabatchError

    assert str(SalabatchError("not an object", path="c.json", got="list")) == (
        "c.json: not an object (got 'list')"
    )
    assert str(SalabatchError("bad", field="f", expected="a list", got=3)) == (
        "f: bad (expected a list, got 3)"
    )
