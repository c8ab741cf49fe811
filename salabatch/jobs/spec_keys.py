"""What identifies a job and a question's answers: the spec's canonical JSON and fingerprint (file
metadata), and a question's effective generation settings (part of every row's key)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from salabatch.jobs.spec import GenerationSettings, JobSpec, Question


def spec_json(spec: JobSpec) -> str:
    """The spec as canonical JSON (sorted keys, resolved paths): for file metadata."""
    return json.dumps(
        spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def spec_fingerprint(spec: JobSpec) -> str:
    """sha256 (hex) of `spec_json(spec)`. Any change, paths and engine settings included,
    changes it; row-level resume keys should use `generation_key` instead."""
    return hashlib.sha256(spec_json(spec).encode("utf-8")).hexdigest()


def effective_generation(spec: JobSpec, question: Question) -> GenerationSettings:
    """The job's `generation:` with the question's own overrides applied."""
    update = {
        key: value
        for key, value in (("max_tokens", question.max_tokens), ("think", question.think))
        if value is not None
    }
    return spec.generation.model_copy(update=update)


def generation_key(spec: JobSpec, question: Question) -> dict[str, Any]:
    """The effective generation settings of one question, as plain JSON values."""
    return effective_generation(spec, question).model_dump(mode="json")
