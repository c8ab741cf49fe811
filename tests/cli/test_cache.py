"""`salabatch cache ls|prune|clear` over a store folder that does not exist."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from salabatch.cli import main


@pytest.mark.parametrize(
    "args", [["ls"], ["prune", "--max-gb", "0"], ["prune", "--older-than", "1"], ["clear", "--yes"]]
)
def test_a_missing_store_is_empty_and_stays_missing(tmp_path, args):
    """prune and clear made the folder they were pointed at (a typo in --dir became a store);
    every command reports it empty, saying no store is there, and creates nothing. clear does
    not ask about it either."""
    missing = tmp_path / "no" / "store"
    got = CliRunner().invoke(main, ["cache", *args, "--dir", str(missing)], input="")
    assert got.exit_code == 0, got.output
    assert not (tmp_path / "no").exists()
    assert got.output.splitlines()[-1] in (
        f"no stored prefixes (no store at {missing})",
        f"removed 0 entries, 0 B (no store at {missing})",
        f"freed 0 B (no store at {missing})",
    )


def test_clear_without_yes_on_a_missing_store_does_not_ask(tmp_path):
    got = CliRunner().invoke(main, ["cache", "clear", "--dir", str(tmp_path / "none")], input="")
    assert got.exit_code == 0 and "remove every" not in got.output
    assert not (tmp_path / "none").exists()
