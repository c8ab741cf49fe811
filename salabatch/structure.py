"""What an answer must be, as the regular expression it must match whole: JSON a schema
validates, any JSON object, or one of a list of strings. outlines-core writes a schema's pattern
(no MLX: a job file is checked with these); `salabatch.engine.grammar` compiles a pattern against
a tokenizer's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from outlines_core.json_schema import build_regex_from_schema

ANY_OBJECT = {"type": "object"}  # what `json_object` asks for (objects nested 3 deep at most)


def schema_pattern(schema: dict) -> str:
    """The pattern of JSON text `schema` validates, its objects' keys in the schema's order (as
    OpenAI's structured outputs write them: a `reasoning` key before `answer` has the model
    reason first); ValueError saying why outlines-core cannot write one."""
    try:
        return build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"the JSON schema cannot be used ({e})") from None


def choice_pattern(choices: Sequence[str]) -> str:
    """The pattern of exactly one of `choices`."""
    return "|".join(f"({_literal(c)})" for c in choices)


def _literal(text: str) -> str:
    """`text` as a pattern that matches it literally: every ASCII character but letters,
    digits, space and `_` as its hex escape (`\\x3c`), since a backslash before some of them
    means something else in outlines-core's regex syntax (`\\<`: the start of a word)."""
    return "".join(
        c if c.isalnum() or c in " _" or not c.isascii() else f"\\x{ord(c):02x}" for c in text
    )
