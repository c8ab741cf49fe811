"""A job made from an OpenAI Batch requests file alone: `salabatch run --requests FILE` without a
job file, named after the file, its model the one every request names (or `--model`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from salabatch.errors import JobSpecError, JobValidationError
from salabatch.jobs.job_yaml import apply_override
from salabatch.jobs.spec import JobSpec, slug
from salabatch.jobs.spec_errors import error_lines


def requests_job(
    requests: str | Path, model: str | None = None, overrides: Sequence[str] = ()
) -> JobSpec:
    """A job for `salabatch run --requests FILE` without a job file: named after the file, the
    model from `model` or else the one model every request names; results under ./results."""
    path = Path(os.path.expanduser(requests)).absolute()
    data: dict[str, Any] = {
        "name": slug(path.stem) or "requests",
        "model": _requests_model(path) if model is None else model,
        "requests": str(path),
    }
    for override in overrides:
        apply_override(data, override)
    try:
        return JobSpec.model_validate(data, context={"base_dir": Path.cwd()})
    except ValidationError as e:
        raise JobValidationError(path, error_lines(e, JobSpec)) from None


def _requests_model(path: Path) -> str:
    """The one model every request of an OpenAI batch file names."""
    names = set()
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                body = json.loads(line).get("body") or {}
                names.add(body.get("model"))
    except (OSError, ValueError, AttributeError) as e:
        raise JobSpecError(f"cannot read the model from the requests ({e})", path=path) from None
    names.discard(None)
    if len(names) != 1:
        raise JobSpecError(
            "give --model: the requests name "
            + (f"several models ({', '.join(sorted(map(str, names)))})" if names else "none"),
            path=path,
        )
    return names.pop()
