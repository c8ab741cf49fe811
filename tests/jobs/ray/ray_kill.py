"""The Ray worker setup hook of tests/jobs/ray/test_ray.py, alone in its module: Ray imports it in
each worker as the worker starts, before the actor's modules, and it must import no MLX there
(the actor loads the fast BLAS first) nor bind `read_documents` before it is replaced."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from salabatch.jobs.ingest import documents

KILL_DIR = "SALABATCH_TEST_KILL_DIR"


def die_on_marker() -> None:
    """A unit whose file NAME has a marker in the folder $SALABATCH_TEST_KILL_DIR ends its
    worker process as it starts: `NAME.once` on the first attempt only (the marker is renamed
    to `NAME.died` first, so one attempt takes it), `NAME.always` on every attempt."""
    folder, read = Path(os.environ[KILL_DIR]), documents.read_documents

    def read_or_die(file, ids):
        with contextlib.suppress(FileNotFoundError):
            (folder / f"{file.path.name}.once").rename(folder / f"{file.path.name}.died")
            os._exit(1)
        if (folder / f"{file.path.name}.always").exists():
            os._exit(1)
        return read(file, ids)

    documents.read_documents = read_or_die
