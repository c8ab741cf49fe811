"""The test suite; it mirrors the package tree. REPO is this checkout; SHARED is ../shared beside
it (golden vectors, sample PDFs), which tests that need it skip without, saying why."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
