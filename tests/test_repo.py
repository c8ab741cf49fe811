"""The repository itself: every tracked file is one git would add again.

A .gitignore pattern that matches a tracked file hides it from every tool that walks the tree
as git does: ruff skips ignored paths (an unanchored `results/` once hid the whole
salabatch/jobs/results package from `make lint`), and `git add` leaves a new file there out of
the commit while the checkout that wrote it still passes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_tracked_file_is_ignored():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--ignored", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert listed == [], f"tracked files that .gitignore matches (anchor its pattern): {listed}"
